"""The plan's schema: what `moecc compile` writes and `moecc exec` reads, in one typed place.

The plan is plain data (dicts, lists, strings, numbers, one tensor), so the runtime reads it
with torch's weights-only loader (runtime/plan.py) and nothing in it can run code. Its shape is declared here as
TypedDicts, and `validate()` checks a loaded plan against them field by field: a missing,
unknown or mistyped field is refused with its path (`plan.batch.kv.block_size: missing`).

The runtime owns this schema; the compiler imports it. The rules both sides compute (block
math, the prefix walk, placement bytes, dtypes, residency groups, speculation, the KV
geometry and the model info) live in moecc_runtime/contract/, one file each; the records
`model.info` (contract.model_info.ModelInfo) and `batch.kv` (contract.kv_geometry.KVGeometry)
are those dataclasses, validated field by field like the TypedDicts here (every field
required). Each op kind's `attrs` is its own record (plan_ops.OP_ATTRS), validated too.

Version 5 (this one) moved the prefix sharing a plan was sized for from `predicted` into
`batch.workload.shared_prefix` (None when none), recorded the compile options a recompile
keeps as `compiled_with` (attention, hardware, dtype, budgets; was `predicted.compiled_with`
with the first three), and validates every op's attrs by its kind.
Version 4 added each phase's attention placement (`batch.<phase>.attention`,
`AttentionPlacement`; the compiler always writes it). Version 3 added each module's
`residency_group` and the KV geometry (`layers`, `heads`, `key_dim`, `value_dim`) under
`batch.kv`, made `batch.kv.block_size` required,
dropped the unused `output` key, and records each weight file's header hash in the
fingerprint. Plans of other versions are refused with "recompile". Added within version 3,
as optional fields (plans without them load as before): weight formats (`WeightEntry.format`
and its parts) and the sidecar of weights quantized at compile (`Fingerprint.sidecar`,
`StoredTensor.root`), kept since.
"""

# no `from __future__ import annotations`: TypedDict reads NotRequired from live annotations
import dataclasses
import functools
import types
import typing
from typing import Any, Literal, NotRequired, TypedDict, Union

import torch

# the rules both sides compute (moecc_runtime/contract/), named here too for the plan's readers
from moecc_runtime.contract.blocks import KV_BLOCK_SIZE  # noqa: F401
from moecc_runtime.contract.job_kinds import COMPUTE_JOB_KINDS, COPY_JOB_KINDS, OP_JOB_KIND  # noqa: F401
from moecc_runtime.contract.kv_geometry import KVGeometry, kv_geometry  # noqa: F401
from moecc_runtime.contract.model_info import ModelInfo
from moecc_runtime.contract.placement import ALIGN  # noqa: F401
from moecc_runtime.contract.residency import expert_group, residency_group  # noqa: F401
from moecc_runtime.contract.speculation import SPECULATE_ROUTED_PER_EXPERT, speculates  # noqa: F401
from moecc_runtime.plan_ops import OP_ATTRS

SCHEMA = "moecc.plan"
SCHEMA_VERSION = 5

# -- the op vocabulary ---------------------------------------------------------------------
#: Every op a plan's schedule may hold, and so every op this runtime implements.
OpName = Literal["embed", "rope", "rmsnorm", "attention", "router", "experts", "mlp", "linear", "add", "mul",
                 "sigmoid", "lm_head", "host_buffer", "fetch_weights", "fetch_experts", "kv_load", "kv_store"]
OPS: frozenset[str] = frozenset(typing.get_args(OpName))
#: Ops that move data (weights to the device, KV between host and device) rather than compute.
TRANSFER_OPS: frozenset[str] = frozenset({"fetch_weights", "fetch_experts", "kv_load", "kv_store"})


# -- the schema -----------------------------------------------------------------------------
class Sidecar(TypedDict):
    """The quantized weights file `moecc compile --quantize` wrote beside the plan
    (runtime/plan.py sidecar_path: the plan's file name + ".weights.safetensors", resolved
    from where the plan is read, never from a path in the plan)."""

    file: str  # its name when compiled (for messages)
    size: int  # bytes
    header_sha256: str  # of its safetensors header (tensor layout, and a digest of the data in its metadata)
    quantize: dict[str, Any]  # scheme, group_size, scope, symmetric: the options that made it


class Fingerprint(TypedDict):
    config_sha256: str
    weight_files: dict[str, int]  # file name in the checkpoint dir -> size in bytes
    weight_headers: dict[str, str]  # file name -> sha256 of its safetensors header (the tensor layout)
    sidecar: NotRequired[Sidecar]  # a plan with weights quantized at compile


class ModelSection(TypedDict):
    dir: str
    architecture: str
    model_type: str
    fingerprint: Fingerprint
    info: ModelInfo


class AttentionPlacement(TypedDict):
    """Where a phase's attention runs: on the device over KV brought there ("device"), on the
    host next to the paged KV pool, only the step's queries and outputs crossing ("host"), or
    the first `host_fraction` of each step's sequences on the host and the rest on the
    device ("split"), the two parts at once. A phase on the host gathers no KV and uses no
    device KV buffer: when both phases are, `Arena.kv_buffer_tokens` is 0; a split's buffers
    are sized for its device part's micro-batches. The planner chooses it per phase
    (moecc/planner/solve.py) unless `moecc compile --attention host|device` forces it."""

    where: Literal["host", "device", "split"]
    host_fraction: float  # 1.0 for "host", 0.0 for "device"


class PhaseSizes(TypedDict):
    B: int  # sequences in flight
    b_a: int  # sequences per attention micro-batch
    b_e: int  # rows per expert chunk
    tokens_per_step: NotRequired[int]  # prefill: prompt tokens per step
    attention: NotRequired[AttentionPlacement]  # absent (older plans): the runtime's default


class Overlap(TypedDict):
    expert_slots: int
    prefetch: int
    resident: list[str]  # residency groups kept on the device


class SharedPrefix(TypedDict):
    """The prefix sharing a plan was sized for (`moecc compile --prompts`:
    moecc/planner/shared_prefix.py): the share of prompt tokens computed once, per request
    the prompt and shared tokens (means), the prefill work left and the block size counted in."""

    share: float  # in [0, 1)
    prompt_tokens: float
    shared_tokens: float
    prefill_work: float  # 1 - share
    block_size: int
    note: str


class Workload(TypedDict):
    prompt_tokens: float
    output_tokens: float
    seq_len: int
    shared_prefix: SharedPrefix | None  # None: sized as if no prompt shared a prefix


class CompiledWith(TypedDict):
    """The compile options a recompile must keep (moecc/replan.py), as `moecc compile` was given them."""

    attention: str  # auto, host, device
    hardware: str | None  # a preset name or a profile path; None: the compiling machine's
    dtype: str  # auto or a compute dtype
    gpu_mem: int | None
    host_mem: int | None
    host_reserve: int | None
    device_reserve: int | None
    max_batch: int


class Batch(TypedDict):
    prefill: PhaseSizes
    decode: PhaseSizes
    kv: KVGeometry
    overlap: Overlap
    workload: Workload
    rule: str


class Arena(TypedDict):
    bytes: int
    resident: list[str]
    dense_slot_bytes: int
    expert_slots: int
    expert_slot_bytes: int
    kv_buffer_tokens: int
    stage_bytes: int


class StoredTensor(TypedDict):
    """Bytes of one checkpoint tensor (or a slice of it) as stored."""

    tensor: str  # the checkpoint tensor
    dtype: str
    shape: list[int]
    index: int | None  # expert index into a fused 3-D tensor
    rows: list[int] | None  # [first, end) rows of it
    file: str | None  # None: a config-only plan
    offset: int | None  # absolute byte offset in the file
    nbytes: int
    root: NotRequired[Literal["plan"]]  # "plan": in the plan's sidecar (Fingerprint.sidecar), not the checkpoint


class WeightEntry(StoredTensor):
    """One weight an op reads: its stored data tensor (the fields above) and, for a stored
    format other than dense (runtime/formats/), the other stored tensors and the format's
    facts. Absent format: dense, read as it is (cast to the compute dtype if need be)."""

    format: NotRequired[str]  # dense, fp8_block, mxfp4, int8_channel, int4_group
    logical_shape: NotRequired[list[int]]  # the weight as ops see it (shape is the data part's)
    parts: NotRequired[dict[str, StoredTensor]]  # e.g. {"scale": ...}: the other stored tensors
    format_attrs: NotRequired[dict[str, Any]]  # block sizes, the first row's offset into its block


class Rope(TypedDict):
    inv_freq: torch.Tensor  # [D/2] fp32
    attention_scaling: float


class Op(TypedDict):
    """One op of the schedule; its `attrs` follow its kind's record (plan_ops.OP_ATTRS[op])."""

    op: OpName
    name: str
    inputs: list[str]
    weights: dict[str, str]  # local name -> weight manifest key
    attrs: dict[str, Any]  # op-specific: validated against OP_ATTRS[op]


class Module(TypedDict):
    module: str
    kind: str  # stem, attn, moe, mlp, head, ...
    layer: int | None
    residency_group: str | None
    ops: list[Op]


class Plan(TypedDict):
    schema: Literal["moecc.plan"]
    version: int
    model: ModelSection
    batch: Batch
    memory: dict[str, dict[str, Any]]  # device, host: bytes; host_model: the reserve and why the KV pool is its size
    arena: Arena | None  # None: weights read in place (no device budget)
    weights: dict[str, WeightEntry]
    rope: Rope
    schedule: list[Module]
    timeline: dict[str, Any] | None  # the predicted step DAGs (moecc explain --timeline)
    predicted: dict[str, Any]
    compiled_with: CompiledWith


class SchemaError(ValueError):
    """A plan field is missing, unknown or of the wrong type; `path` names it."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


def validate(data: Any, spec: Any = Plan, path: str = "plan") -> None:
    """Check `data` against the schema type `spec`; raise SchemaError naming the first bad field."""
    origin = typing.get_origin(spec)
    if spec is Any:
        return
    if typing.is_typeddict(spec) or dataclasses.is_dataclass(spec):
        _validate_record(data, spec, path)
        if spec is Op:
            validate(data["attrs"], OP_ATTRS[data["op"]], f"{path}.attrs")
    elif origin in (Union, types.UnionType):
        options = typing.get_args(spec)
        if data is None and type(None) in options:
            return
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return validate(data, option, path)
            except SchemaError as e:
                errors.append(e)
        raise errors[0] if len(errors) == 1 else SchemaError(path, f"expected {_name(spec)}, got {_what(data)}")
    elif origin is Literal:
        if data not in typing.get_args(spec):
            raise SchemaError(path, f"{data!r} is not one of {sorted(map(str, typing.get_args(spec)))}")
    elif origin is list:
        if not isinstance(data, list):
            raise SchemaError(path, f"expected a list, got {_what(data)}")
        (item,) = typing.get_args(spec)
        for i, x in enumerate(data):
            validate(x, item, f"{path}[{i}]")
    elif origin is dict:
        if not isinstance(data, dict):
            raise SchemaError(path, f"expected an object, got {_what(data)}")
        key, value = typing.get_args(spec)
        for k, v in data.items():
            if not isinstance(k, str):
                raise SchemaError(path, f"key {k!r} is not a string")
            validate(v, value, f"{path}[{k!r}]")
    else:
        _validate_scalar(data, spec, path)


def _validate_record(data: Any, spec: Any, path: str) -> None:
    if not isinstance(data, dict):
        raise SchemaError(path, f"expected an object, got {_what(data)}")
    fields, required = _fields(spec)
    for k in data:
        if k not in fields:
            raise SchemaError(f"{path}.{k}", f"unknown field (this runtime reads {', '.join(fields)})")
    for k, t in fields.items():
        if k not in data:
            if k in required:
                raise SchemaError(f"{path}.{k}", "missing")
            continue
        validate(data[k], t, f"{path}.{k}")


@functools.lru_cache(maxsize=None)
def _fields(spec: Any) -> tuple[dict[str, Any], frozenset[str]]:
    """A record type's fields with their types (NotRequired unwrapped) and the required ones
    (a dataclass: every field); resolved once per type, not once per record (a plan has tens
    of thousands). The dict is shared: read it, never change it."""
    hints = typing.get_type_hints(spec)
    fields = {k: _unwrap_not_required(t) for k, t in hints.items()}
    return fields, frozenset(getattr(spec, "__required_keys__", hints.keys()))


def _unwrap_not_required(t: Any) -> Any:
    return typing.get_args(t)[0] if typing.get_origin(t) is NotRequired else t


def _validate_scalar(data: Any, spec: Any, path: str) -> None:
    ok = {int: isinstance(data, int) and not isinstance(data, bool),
          float: isinstance(data, (int, float)) and not isinstance(data, bool),
          str: isinstance(data, str), bool: isinstance(data, bool),
          torch.Tensor: isinstance(data, torch.Tensor), type(None): data is None}.get(spec)
    if ok is None:  # pragma: no cover - a type this validator does not know is a schema bug
        raise TypeError(f"plan schema: cannot validate {spec!r} at {path}")
    if not ok:
        raise SchemaError(path, f"expected {_name(spec)}, got {_what(data)}")


def _name(spec: Any) -> str:
    return getattr(spec, "__name__", None) or str(spec).replace("typing.", "")


def _what(data: Any) -> str:
    return f"{type(data).__name__} {data!r}" if isinstance(data, (int, float, str, bool)) else type(data).__name__
