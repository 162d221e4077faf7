"""emit_plan: lower the graph to the plan (see moecc_runtime.plan for the schema).

Requires: batch_sizes, transfers.
Does: one schedule entry per module, in order, with its ops (compute ops, host buffers
and transfers) naming inputs by value name and weights by manifest key; the weight
manifest maps each key (<node>.<local>) to file, absolute byte offset, dtype and shape of
the exact slice (one expert of a fused tensor is an offset, not a copy); the fingerprint
of the checkpoint; the solved sizes; predicted figures.
Guarantees: plan (graph.attrs["plan"], plain data only, loadable with weights_only=True).
Options: none (reads ctx.options.checkpoint, the frontend's Checkpoint).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moecc_runtime.plan import SCHEMA, SCHEMA_VERSION

from moecc.errors import PassError
from moecc.ir import DTYPE_BYTES, Graph, WeightRef
from moecc.ir.pass_infra import Pass, PassContext, PassResult

PLAN_OPS = frozenset({"embed", "rope", "rmsnorm", "attention", "router", "experts", "mlp", "linear", "add",
                      "mul", "sigmoid", "lm_head", "host_buffer", "fetch_weights", "fetch_experts",
                      "kv_load", "kv_store"})


class EmitPlan(Pass):
    name = "emit_plan"
    requires = frozenset({"batch_sizes", "transfers"})
    ensures = frozenset({"plan"})

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        g = graph.copy()
        ckpt = ctx.options.checkpoint
        if ckpt is None:
            raise PassError(self.name, "ctx.options.checkpoint is not set (the frontend's Checkpoint)")
        manifest: dict[str, dict[str, Any]] = {}
        schedule: list[dict[str, Any]] = []
        for n in g.nodes:
            if n.op in ("input", "output"):
                continue
            if n.op not in PLAN_OPS:
                raise PassError(self.name, f"node %{n.name}: op {n.op!r} has no runtime lowering")
            if not schedule or schedule[-1]["module"] != n.module:
                kind = n.module.split(".")[-1] if n.module and "." in n.module else n.module
                schedule.append({"module": n.module, "kind": kind, "layer": n.layer, "ops": []})
            wkeys = {}
            for local, ref in n.weights.items():
                key = f"{n.name}.{local}"
                manifest[key] = _locate(ckpt, ref)
                wkeys[local] = key
            attrs = {k: v for k, v in n.attrs.items() if k != "inv_freq"}
            if n.op == "fetch_weights" or n.op == "fetch_experts":
                target = n.name.removeprefix("fetch.")
                attrs["for"] = target
            schedule[-1]["ops"].append({"op": n.op, "name": n.name, "inputs": list(n.inputs),
                                        "weights": wkeys, "attrs": attrs})
        rope = g.node("rope")
        info = dataclasses.asdict(g.info)
        flops = sum(n.flops_per_token for n in g.nodes)
        plan = {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "model": {
                "dir": str(ckpt.directory),
                "architecture": g.info.architecture,
                "model_type": g.info.model_type,
                "fingerprint": ckpt.fingerprint(),
                "info": info,
            },
            "batch": g.attrs["batch"],
            "memory": g.attrs.get("memory", {}),
            "arena": g.attrs.get("arena"),
            "weights": manifest,
            "rope": {"inv_freq": torch.tensor(rope.attrs["inv_freq"], dtype=torch.float32),
                     "attention_scaling": float(rope.attrs["attention_scaling"])},
            "schedule": schedule,
            "output": "lm_head",
            "timeline": g.attrs.get("timeline"),  # predicted step DAGs (moecc explain --timeline)
            "predicted": {
                "flops_per_token": flops,
                "weight_bytes": g.weight_bytes,
                "kv_bytes_per_token": g.info.kv_bytes_per_token,
                **g.attrs.get("predicted", {}),
            },
        }
        g.attrs["plan"] = plan
        g.attrs["plan_summary"] = {
            "modules": len(schedule),
            "ops": sum(len(m["ops"]) for m in schedule),
            "weight_slices": len(manifest),
            "weights_present": ckpt.has_weights,
            "flops_per_token": flops,
        }
        return PassResult(g, modified=True)


def _locate(ckpt, ref: WeightRef) -> dict[str, Any]:
    """File and absolute byte offset of the exact slice `ref` names (no copy is ever made)."""
    loc = ckpt.tensors.get(ref.tensor)
    entry = {"tensor": ref.tensor, "dtype": ref.dtype, "shape": list(ref.shape),
             "index": ref.index, "rows": list(ref.rows) if ref.rows else None}
    if loc is None:
        entry.update(file=None, offset=None, nbytes=ref.nbytes)
        return entry
    dims = list(loc.shape)
    elem = 0
    inner = dims
    if ref.index is not None:
        elem += ref.index * _prod(dims[1:])
        inner = dims[1:]
    if ref.rows is not None:
        elem += ref.rows[0] * _prod(inner[1:])
    entry.update(file=loc.file, offset=loc.offset + elem * DTYPE_BYTES[loc.dtype], nbytes=ref.nbytes)
    return entry


def _prod(xs: list[int]) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p
