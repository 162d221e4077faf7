"""emit_plan: lower the graph to the plan (the schema: moecc_runtime/plan_schema.py).

Requires: batch_sizes, transfers.
Does: one schedule entry per module, in order, with its ops (compute ops, host buffers
and transfers) naming inputs by value name and weights by manifest key; the weight
manifest maps each key (<node>.<local>) to file, absolute byte offset, dtype and shape of
the exact slice (one expert of a fused tensor is an offset, not a copy); weights quantized
at compile (quantize_weights) name tensors of the plan's sidecar (`root: "plan"`), whose size
and header hash join the fingerprint of the checkpoint; the solved sizes, each phase's with its
attention placement (`batch.<phase>.attention`, always written); predicted figures.
Guarantees: plan (graph.attrs["plan"], plain data only, loadable with weights_only=True,
valid against the runtime's schema: each module's residency group, the KV geometry).
Options: none (reads ctx.options.checkpoint, the frontend's Checkpoint; records
ctx.options' attention, hardware, dtype and budgets as `compiled_with`, for a recompile).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from moecc_runtime.memory.safetensors_header import TensorLocation, read_header, slice_of
from moecc_runtime.plan_schema import OPS, SCHEMA, SCHEMA_VERSION, SchemaError, residency_group, validate

from moecc.errors import PassError
from moecc.ir import DTYPE_BYTES, Graph, WeightRef
from moecc.ir.pass_infra import Pass, PassContext, PassResult

class EmitPlan(Pass):
    name = "emit_plan"
    requires = frozenset({"batch_sizes", "transfers"})
    ensures = frozenset({"plan"})

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        g = graph.copy()
        ckpt = ctx.options.checkpoint
        if ckpt is None:
            raise PassError(self.name, "ctx.options.checkpoint is not set (the frontend's Checkpoint)")
        schedule, manifest = self._schedule(g, ckpt)
        plan = _plan(g, ckpt, schedule, manifest)
        plan["compiled_with"] = _compiled_with(ctx.options)
        try:
            validate(plan)  # the runtime's schema: what it will refuse is never written
        except SchemaError as e:
            raise PassError(self.name, f"the plan does not follow the runtime's schema: {e}") from e
        g.attrs["plan"] = plan
        g.attrs["plan_summary"] = {
            "modules": len(schedule),
            "ops": sum(len(m["ops"]) for m in schedule),
            "weight_slices": len(manifest),
            "weights_present": ckpt.has_weights,
            "flops_per_token": plan["predicted"]["flops_per_token"],
        }
        return PassResult(g, modified=True)

    def _schedule(self, g: Graph, ckpt: Any) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
        """(schedule, weight manifest): one entry per module in order, with its ops; every
        weight an op reads as a manifest key."""
        manifest: dict[str, dict[str, Any]] = {}
        schedule: list[dict[str, Any]] = []
        sidecar = _sidecar_tensors(g)
        for n in g.nodes:
            if n.op in ("input", "output"):
                continue
            if n.op not in OPS:
                raise PassError(self.name, f"node %{n.name}: op {n.op!r} has no runtime lowering")
            if not schedule or schedule[-1]["module"] != n.module:
                kind = n.module.split(".")[-1] if n.module and "." in n.module else n.module
                schedule.append({"module": n.module, "kind": kind, "layer": n.layer,
                                 "residency_group": residency_group(kind, n.layer), "ops": []})
            wkeys = {}
            for local, ref in n.weights.items():
                key = f"{n.name}.{local}"
                manifest[key] = _locate(ckpt, ref, sidecar)
                wkeys[local] = key
            attrs = {k: v for k, v in n.attrs.items() if k != "inv_freq"}
            if n.op == "fetch_weights" or n.op == "fetch_experts":
                attrs["for"] = n.name.removeprefix("fetch.")
            schedule[-1]["ops"].append({"op": n.op, "name": n.name, "inputs": list(n.inputs),
                                        "weights": wkeys, "attrs": attrs})
        return schedule, manifest


def _plan(g: Graph, ckpt: Any, schedule: list[dict[str, Any]], manifest: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The plan as plain data (moecc_runtime.plan_schema.Plan)."""
    rope = g.node("rope")
    heads, key_dim, value_dim = g.info.kv_geometry
    batch = g.attrs["batch"]
    for phase in ("decode", "prefill"):
        if "attention" not in batch[phase]:
            raise PassError("emit_plan", f"batch.{phase}.attention is missing: solve_batch_sizes places attention")
    kv = {**batch["kv"], "layers": g.info.num_layers, "heads": heads, "key_dim": key_dim, "value_dim": value_dim}
    return {
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "model": {
            "dir": str(ckpt.directory),
            "architecture": g.info.architecture,
            "model_type": g.info.model_type,
            "fingerprint": _fingerprint(g, ckpt),
            "info": dataclasses.asdict(g.info),
        },
        "batch": {**batch, "kv": kv},
        "memory": g.attrs.get("memory", {}),
        "arena": g.attrs.get("arena"),
        "weights": manifest,
        "rope": {"inv_freq": torch.tensor(rope.attrs["inv_freq"], dtype=torch.float32),
                 "attention_scaling": float(rope.attrs["attention_scaling"])},
        "schedule": schedule,
        "timeline": g.attrs.get("timeline"),  # predicted step DAGs (moecc explain --timeline)
        "predicted": {
            "flops_per_token": sum(n.flops_per_token for n in g.nodes),
            "weight_bytes": g.weight_bytes,
            "kv_bytes_per_token": g.info.kv_bytes_per_token,
            **g.attrs.get("predicted", {}),
        },
    }


def _compiled_with(o: Any) -> dict[str, Any]:
    """What a recompile for another device must keep (moecc/replan.py; the schema's CompiledWith)."""
    return {"attention": o.attention, "hardware": o.hardware, "dtype": o.dtype, "gpu_mem": o.gpu_mem,
            "host_mem": o.host_mem, "host_reserve": o.host_reserve, "device_reserve": o.device_reserve,
            "max_batch": int(o.max_batch)}


def _sidecar_tensors(g: Graph) -> dict[str, TensorLocation] | None:
    """The tensors of the sidecar quantize_weights wrote (read back from its partial file),
    named as the plan names the file; None without one."""
    q = g.attrs.get("quantized")
    if not q or "partial" not in q:
        return None
    header = read_header(Path(q["partial"]))
    return {name: dataclasses.replace(loc, file=q["file"]) for name, loc in header.tensors.items()}


def _fingerprint(g: Graph, ckpt: Any) -> dict[str, Any]:
    """The checkpoint's fingerprint and, with weights quantized at compile, the sidecar's."""
    fp = ckpt.fingerprint()
    q = g.attrs.get("quantized")
    if q and "partial" in q:
        fp["sidecar"] = {"file": q["file"], "size": q["size"], "header_sha256": q["header_sha256"],
                         "quantize": {k: q[k] for k in ("scheme", "group_size", "scope", "symmetric")}}
    return fp


def _locate(ckpt: Any, ref: WeightRef, sidecar: dict[str, TensorLocation] | None = None) -> dict[str, Any]:
    """The manifest entry of `ref`: file and absolute byte offset of each stored tensor slice
    it names (no copy is ever made; the runtime checks each against the file's header with
    the same `slice_of`), and for a quantized format its logical shape and facts."""
    stored = ref.stored()
    entry = _locate_stored(ckpt, stored.pop("data"), sidecar)
    if ref.format != "dense":
        entry.update(format=ref.format, logical_shape=list(ref.shape),
                     parts={name: _locate_stored(ckpt, p, sidecar) for name, p in stored.items()},
                     format_attrs=dict(ref.attrs))
    return entry


def _locate_stored(ckpt: Any, ref: WeightRef, sidecar: dict[str, TensorLocation] | None = None) -> dict[str, Any]:
    """One stored tensor slice: in the checkpoint, or (a tensor quantize_weights wrote) in the
    plan's sidecar, `root: "plan"`; file None in a config-only plan."""
    in_sidecar = sidecar is not None and ref.tensor in sidecar
    loc = sidecar[ref.tensor] if in_sidecar else ckpt.tensors.get(ref.tensor)  # type: ignore[index]
    entry = {"tensor": ref.tensor, "dtype": ref.dtype, "shape": list(ref.shape),
             "index": ref.index, "rows": list(ref.rows) if ref.rows else None}
    if loc is None:
        entry.update(file=None, offset=None, nbytes=ref.nbytes)
        return entry
    offset, _ = slice_of(loc, ref.index, ref.rows, DTYPE_BYTES[loc.dtype])
    entry.update(file=loc.file, offset=offset, nbytes=ref.nbytes)
    if in_sidecar:
        entry["root"] = "plan"
    return entry
