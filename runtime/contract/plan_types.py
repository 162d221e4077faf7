"""The plan as typed objects: what the runtime's engine, worker, streaming and KV code read,
built once from a validated plan (`PlanView.of`). Frozen: nothing downstream changes the
plan. Fields and meanings are the schema's (moecc_runtime/plan_schema.py); what is not
typed here yet (the weight manifest, the rope table, predicted figures) stays in `raw`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moecc_runtime.contract.kv_geometry import KVGeometry
from moecc_runtime.contract.model_info import ModelInfo


@dataclass(frozen=True)
class Placement:
    """Where a phase's attention runs (plan_schema.AttentionPlacement)."""

    where: str  # host, device, split
    host_fraction: float


@dataclass(frozen=True)
class PhaseSizes:
    """A phase's solved sizes: sequences in flight, per attention micro-batch, rows per expert chunk."""

    B: int
    b_a: int
    b_e: int
    tokens_per_step: int | None  # prefill: prompt tokens per step
    attention: Placement | None  # None (older plans): the runtime's default

    @classmethod
    def from_record(cls, p: Mapping[str, Any]) -> "PhaseSizes":
        a = p.get("attention")
        return cls(int(p["B"]), int(p["b_a"]), int(p["b_e"]),
                   None if p.get("tokens_per_step") is None else int(p["tokens_per_step"]),
                   None if a is None else Placement(str(a["where"]), float(a["host_fraction"])))


@dataclass(frozen=True)
class ArenaLayout:
    """The device arena the planner sized (plan_schema.Arena): its bytes and how they are carved."""

    bytes: int
    resident: tuple[str, ...]  # residency groups kept on the device
    dense_slot_bytes: int
    expert_slots: int
    expert_slot_bytes: int
    kv_buffer_tokens: int  # 0: attention on the host only (no device KV buffers)
    stage_bytes: int

    @classmethod
    def from_record(cls, a: Mapping[str, Any]) -> "ArenaLayout":
        return cls(int(a["bytes"]), tuple(a["resident"]), int(a["dense_slot_bytes"]), int(a["expert_slots"]),
                   int(a["expert_slot_bytes"]), int(a["kv_buffer_tokens"]), int(a["stage_bytes"]))


@dataclass(frozen=True)
class Workload:
    """What the plan was sized for: mean prompt and output tokens, a sequence's length, the prefix share."""

    prompt_tokens: float
    output_tokens: float
    seq_len: int
    shared_prefix: float  # share of prompt tokens computed once (0: none)


@dataclass(frozen=True)
class Op:
    """One op of the schedule; `attrs` follow its kind's record (plan_ops.OP_ATTRS)."""

    op: str
    name: str
    inputs: tuple[str, ...]
    weights: Mapping[str, str]  # local name -> weight manifest key
    attrs: Mapping[str, Any]


@dataclass(frozen=True)
class Module:
    """One module of the schedule, its ops in order."""

    module: str
    kind: str  # stem, attn, moe, mlp, head
    layer: int | None
    residency_group: str | None  # None: the stem (host only)
    ops: tuple[Op, ...]

    def dense_keys(self) -> list[str]:
        """Manifest keys of the module's weights but its routed experts' (streamed as one unit)."""
        return [k for op in self.ops if op.op != "experts" for k in op.weights.values()]


@dataclass(frozen=True)
class PlanView:
    """A validated plan, typed: the model, KV pool, phases, workload, arena and schedule."""

    info: ModelInfo
    kv: KVGeometry
    prefill: PhaseSizes
    decode: PhaseSizes
    workload: Workload
    arena: ArenaLayout | None  # None: weights read in place (no device budget)
    host_other_bytes: int  # host bytes the plan holds beside the KV pool (weights, buffers)
    schedule: tuple[Module, ...]
    raw: Mapping[str, Any] = field(repr=False, compare=False)  # the plan as loaded

    @classmethod
    def of(cls, plan: Mapping[str, Any]) -> "PlanView":
        """The typed view of `plan` (a plan `load_plan` validated, or one the compiler just made)."""
        b, wl = plan["batch"], plan["batch"]["workload"]
        host = (plan.get("memory") or {}).get("host") or {}
        return cls(ModelInfo.from_record(plan["model"]["info"]), KVGeometry.from_record(b["kv"]),
                   PhaseSizes.from_record(b["prefill"]), PhaseSizes.from_record(b["decode"]),
                   Workload(float(wl["prompt_tokens"]), float(wl["output_tokens"]), int(wl["seq_len"]),
                            float((wl.get("shared_prefix") or {}).get("share", 0.0))),
                   None if plan.get("arena") is None else ArenaLayout.from_record(plan["arena"]),
                   int(host.get("weights", 0) or 0) + int(host.get("buffers", 0) or 0),
                   tuple(_module(m) for m in plan["schedule"]), plan)

    def phase(self, name: str) -> PhaseSizes:
        """The sizes of phase `name` ("prefill" or "decode")."""
        return self.prefill if name == "prefill" else self.decode


def _module(m: Mapping[str, Any]) -> Module:
    ops = tuple(Op(o["op"], o["name"], tuple(o["inputs"]), dict(o["weights"]), dict(o["attrs"])) for o in m["ops"])
    return Module(m["module"], m["kind"], m["layer"], m["residency_group"], ops)
