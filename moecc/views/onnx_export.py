"""The module-level graph as an ONNX model, to open in Netron.

One ONNX node per IR node: elementwise ops ONNX has (Add, Mul, Sigmoid) in the default
domain, everything else (attention, router, experts, norms, host buffers, transfers) in
moecc's own domain `ai.moecc`. Each node's attributes carry its role, module, layer, shape,
FLOPs per token, weight bytes and weight references, where it runs (host, copy engine,
device with its weights resident or streamed), the solved batch sizes that apply to it (B,
b_a on attention, b_e on experts, per phase, once solve_batch_sizes has run), and every
attribute of the IR node; the graph's own attributes (the solution, memory) are metadata. The model
passes `onnx.checker.check_model`; `onnx_roles` reads the roles back.
"""

from __future__ import annotations

import json
from typing import Any

from moecc_runtime.plan_schema import expert_group, residency_group

from moecc.ir import Graph, Node

DOMAIN = "ai.moecc"
_STANDARD = {"add": "Add", "mul": "Mul", "sigmoid": "Sigmoid"}
_OP_TYPES = {"rmsnorm": "RMSNorm", "attention": "Attention", "router": "Router", "experts": "Experts",
             "mlp": "GatedMLP", "linear": "Linear", "embed": "Embedding", "rope": "Rotary", "lm_head": "LMHead",
             "host_buffer": "HostBuffer", "fetch_weights": "FetchWeights", "fetch_experts": "FetchExperts",
             "kv_load": "KVLoad", "kv_store": "KVStore"}


def _attr_value(v: Any) -> Any:
    """An ONNX-representable value: ints, floats, strings and lists of one of those; other
    values (dicts, mixed lists, None) as JSON text."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float, str)):
        return v
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return [int(x) for x in v]
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, float) for x in v):
        return [float(x) for x in v]
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, str) for x in v):
        return list(v)
    return json.dumps(v, default=str)


def placement(n: Node, graph: Graph) -> str:
    """Where the runtime runs the node: "host" (the stem, host buffers), "copy engine"
    (transfers), "device, resident" (weights kept in the arena) or "device"."""
    if n.role == "transfer":
        return f"copy engine ({n.attrs.get('direction', 'h2d')})"
    if n.module == "stem" or n.op == "host_buffer":
        return "host"
    arena = graph.attrs.get("arena")
    if arena is None:
        return "device"
    groups = set(arena.get("resident") or [])
    kind = n.module.split(".")[-1] if n.module else ""
    group = expert_group(n.layer) if n.op == "experts" and n.layer is not None else residency_group(kind, n.layer)
    return "device, resident" if group in groups or "all" in groups else "device, streamed"


def _batch_attrs(n: Node, graph: Graph) -> dict[str, int]:
    """The solved sizes that apply to the node: B for every module; b_a on attention, b_e
    on experts and dense MLPs; per phase."""
    batch = graph.attrs.get("batch")
    if not batch or n.module is None or n.op in ("input", "output"):
        return {}
    out = {}
    for phase in ("decode", "prefill"):
        b = batch.get(phase, {})
        out[f"batch.{phase}.B"] = int(b.get("B", 0))
        if n.op == "attention":
            out[f"batch.{phase}.b_a"] = int(b.get("b_a", 0))
        if n.op in ("experts", "mlp"):
            out[f"batch.{phase}.b_e"] = int(b.get("b_e", 0))
    return out


def _node_attrs(n: Node, graph: Graph) -> dict[str, Any]:
    out: dict[str, Any] = {"role": n.role, "shape": json.dumps(list(n.shape), default=str),
                           "flops_per_token": int(n.flops_per_token), "weight_bytes": int(n.weight_bytes),
                           "device": placement(n, graph), **_batch_attrs(n, graph)}
    if n.module is not None:
        out["module"] = n.module
    if n.layer is not None:
        out["layer"] = int(n.layer)
    if n.weights:
        out["weights"] = sorted(f"{k}={w.describe()}" for k, w in n.weights.items())[:64]
        if len(n.weights) > 64:
            out["weights_omitted"] = len(n.weights) - 64
    if n.source:
        out["source"] = n.source
    for k, v in n.attrs.items():
        if k == "inv_freq":
            continue
        out[f"attr.{k}"] = _attr_value(v)
    return out


def graph_to_onnx(graph: Graph, name: str = "moecc") -> Any:
    """The ONNX ModelProto of `graph` (see the module docstring)."""
    import onnx
    from onnx import TensorProto, helper

    nodes = []
    inputs, outputs = [], []
    for n in graph.nodes:
        if n.op == "input":
            elem = TensorProto.INT64 if n.name in ("input_ids", "positions") else TensorProto.FLOAT
            inputs.append(helper.make_tensor_value_info(n.name, elem, [str(d) for d in n.shape] or None))
            continue
        if n.op == "output":
            src = n.inputs[0]
            outputs.append(helper.make_tensor_value_info(src, TensorProto.FLOAT, ["T", graph.info.vocab_size]))
            continue
        standard = _STANDARD.get(n.op)
        op_type = standard or _OP_TYPES.get(n.op, n.op.title().replace("_", ""))
        attrs = _node_attrs(n, graph) if standard is None else {}
        node = helper.make_node(op_type, list(n.inputs), [n.name], name=n.name,
                                domain="" if standard else DOMAIN, **attrs)
        if standard is not None:  # standard ops take no foreign attributes: describe them in doc_string
            node.doc_string = json.dumps(_node_attrs(n, graph), default=str)
        nodes.append(node)
    g = helper.make_graph(nodes, name, inputs, outputs)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                              producer_name="moecc")
    meta = {"architecture": graph.info.architecture, "properties": ",".join(sorted(graph.properties))}
    for k, v in graph.attrs.items():  # e.g. the solved batch sizes after solve_batch_sizes
        if k not in ("plan", "timeline"):  # the emitted plan itself and its job lists: the .pt holds them
            meta[f"graph.{k}"] = json.dumps(v, default=str)
    onnx.helper.set_model_props(model, meta)
    return model


def onnx_roles(model: Any) -> dict[str, dict[str, Any]]:
    """node name -> {"op_type", "role", "layer", ...} read back from an exported model."""
    from onnx import helper

    out: dict[str, dict[str, Any]] = {}
    for node in model.graph.node:
        if node.domain == DOMAIN:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        else:
            attrs = json.loads(node.doc_string)
        attrs = {k: (v.decode() if isinstance(v, bytes) else
                     [x.decode() if isinstance(x, bytes) else x for x in v] if isinstance(v, list) else v)
                 for k, v in attrs.items()}
        out[node.name] = {"op_type": node.op_type, **attrs}
    return out
