"""Render a Graph as readable fx-like text, one node per line.

    %l0.attn = attention(%l0.input_norm, %rope)  # attention L0.attn [T,64] w=64.0KiB 16.4K flop/tok

Legend (first lines of every dump): T = tokens in flight, k = experts per token,
w = weight bytes the node reads, flop/tok = FLOPs per token (attention: projections only;
its context-dependent part is attrs.flops_per_ctx_token).
"""

from __future__ import annotations

from typing import Any

from moecc.ir.graph import Graph, Node
from moecc.sizes import format_bytes, format_count

LEGEND = (
    "# legend: T = tokens in flight, B = sequences, k = experts per token; "
    "w = weight bytes read; flop/tok = FLOPs per token"
)


def _shape(shape: tuple[Any, ...]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]" if shape else ""


def _attrs(attrs: dict[str, Any]) -> str:
    parts = []
    for k in sorted(attrs):
        v = attrs[k]
        if isinstance(v, float):
            v = f"{v:g}"
        elif isinstance(v, (list, tuple)) and len(v) > 8:
            v = f"[{len(v)} items]"
        parts.append(f"{k}={v}")
    return " ".join(parts)


def format_node(n: Node) -> str:
    args = ", ".join(f"%{i}" for i in n.inputs)
    line = f"%{n.name} = {n.op}({args})"
    info = [n.role]
    if n.module:
        info.append(n.module)
    if n.shape:
        info.append(_shape(n.shape))
    if n.weights:
        info.append(f"w={format_bytes(n.weight_bytes)}")
    if n.flops_per_token:
        info.append(f"{format_count(n.flops_per_token)} flop/tok")
    attrs = _attrs(n.attrs)
    if attrs:
        info.append("{" + attrs + "}")
    return f"{line:<60}  # " + " ".join(info)


def format_graph(g: Graph, *, weights: bool = False) -> str:
    """The whole graph as text; `weights=True` also lists every checkpoint tensor read."""
    i = g.info
    lines = [
        f"# model: {i.architecture} ({i.model_type}) layers={i.num_layers} H={i.hidden_size} "
        f"heads={i.num_heads}/{i.num_kv_heads}x{i.head_dim} E={i.num_experts} k={i.top_k} "
        f"V={i.vocab_size} dtype={i.dtype}",
        f"# weights: {format_bytes(g.weight_bytes)}  KV/token: {format_bytes(i.kv_bytes_per_token)}  "
        f"properties: {', '.join(sorted(g.properties)) or '-'}",
        LEGEND,
    ]
    layer = None
    for n in g.nodes:
        if n.layer != layer:
            layer = n.layer
            lines.append("" if layer is None else f"\n# --- layer {layer} ---")
        lines.append(format_node(n))
        if weights:
            for key, w in n.weights.items():
                lines.append(f"#     {key}: {w.describe()} {list(w.shape)} {w.dtype}")
    for key in sorted(g.attrs):
        if key == "plan":
            continue
        lines.append(f"\n# {key}:")
        value = g.attrs[key]
        if key == "timeline":  # job lists: summarised (moecc explain --timeline draws them)
            value = {ph: {"step_s": round(t["step_s"], 6), "jobs": len(t["jobs"]), "edges": len(t["edges"]),
                          "critical_jobs": len(t["critical"])} for ph, t in value.items()}
        lines.extend(_format_attr(value, "#   "))
    return "\n".join(lines) + "\n"


def _format_attr(value: Any, indent: str) -> list[str]:
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v and not _is_flat(v):
                out.append(f"{indent}{k}:")
                out.extend(_format_attr(v, indent + "  "))
            else:
                out.append(f"{indent}{k}: {v}")
        return out
    if isinstance(value, list):
        return [f"{indent}- {v}" for v in value]
    return [f"{indent}{value}"]


def _is_flat(v: Any) -> bool:
    if isinstance(v, dict):
        return all(not isinstance(x, (dict, list)) for x in v.values()) and len(v) <= 4
    return all(not isinstance(x, (dict, list)) for x in v)
