"""The module-level graph as a picture (SVG): one shape per node, coloured and shaped by role
(attention, router, expert group, shared expert, host buffer, transfer, ...), edges for data
dependencies.

The graph is a networkx DiGraph of the IR's nodes and inputs. With graphviz's `dot` on the
PATH the picture is dot's layout of `graph_to_dot` (one cluster per layer); otherwise a plain
layered layout drawn here: one column per layer (stem first, head last), rows by longest
path inside the column, weight and KV transfers just above the node that consumes them.
Every node is an SVG group whose <title> is the node's name.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

import networkx as nx

from moecc.views import svg
from moecc.ir import Graph, Node


@dataclass(frozen=True)
class Style:
    shape: str  # box | rounded | diamond | hexagon | cylinder | ellipse
    fill: str
    dot_shape: str
    dashed: bool = False


#: role -> how it is drawn (the legend lists them in this order)
STYLES: dict[str, Style] = {
    "attention": Style("rounded", "#4e79a7", "box"),
    "router": Style("diamond", "#f28e2b", "diamond"),
    "experts": Style("hexagon", "#59a14f", "hexagon"),
    "shared_expert": Style("hexagon", "#8cd17d", "hexagon"),
    "dense_mlp": Style("box", "#8cd17d", "box"),
    "buffer": Style("cylinder", "#bab0ac", "cylinder"),
    "transfer": Style("ellipse", "#d4a6c8", "ellipse", dashed=True),
    "norm": Style("box", "#f1ce63", "box"),
    "embedding": Style("box", "#76b7b2", "box"),
    "lm_head": Style("box", "#76b7b2", "box"),
    "rotary": Style("box", "#e9d8a6", "box"),
    "gate": Style("box", "#b6992d", "box"),
    "residual": Style("box", "#e0e0e0", "box"),
    "glue": Style("box", "#e0e0e0", "box"),
    "io": Style("ellipse", "#ffffff", "ellipse"),
}
DEFAULT_STYLE = Style("box", "#e0e0e0", "box")
DARK = {"#4e79a7", "#59a14f"}  # fills that take white text

NODE_W, NODE_H, GAP_X, GAP_Y, COL_GAP, TOP = 168, 38, 14, 22, 46, 78


def style_of(n: Node) -> Style:
    return STYLES.get(n.role, DEFAULT_STYLE)


def to_networkx(graph: Graph) -> nx.DiGraph:
    """The graph's nodes (with their IR node as attribute `node`) and data edges."""
    g = nx.DiGraph()
    for n in graph.nodes:
        g.add_node(n.name, node=n)
    for n in graph.nodes:
        for i in n.inputs:
            if i in g:
                g.add_edge(i, n.name)
    return g


def _label(n: Node) -> tuple[str, str]:
    """Two lines: the node's name and what it is (op, experts, bytes moved)."""
    name = n.name if len(n.name) <= 24 else n.name[:23] + "…"
    what = n.op
    if n.op == "experts":
        what = f"experts x{n.attrs.get('num_experts', '?')} top-{n.attrs.get('top_k', '?')}"
    elif n.op in ("fetch_weights", "fetch_experts", "kv_load", "kv_store"):
        what = f"{n.op} {n.attrs.get('direction', '')}".strip()
    elif n.op == "host_buffer":
        what = "host buffer"
    if n.module:
        what += f" · {n.module}"
    return name, what


def _column(n: Node, layers: int) -> int:
    """0: the stem and inputs, i + 1: layer i, layers + 1: the head and output."""
    if n.layer is not None:
        return n.layer + 1
    if n.module == "head" or n.op in ("output", "lm_head") or n.role == "lm_head":
        return layers + 1
    return 0


def plain_layout(graph: Graph) -> dict[str, tuple[float, float]]:
    """Top-left corner of each node's box: columns by layer, rows by longest path within the
    column; a node with no producer in its column (a transfer) sits a row above its first
    consumer there."""
    g = to_networkx(graph)
    layers = max((n.layer for n in graph.nodes if n.layer is not None), default=-1) + 1
    col = {n.name: _column(n, layers) for n in graph.nodes}
    rank: dict[str, int] = {}
    order = list(nx.topological_sort(g))
    for name in order:  # longest path from the column's first nodes
        preds = [p for p in g.predecessors(name) if col[p] == col[name]]
        if preds:
            rank[name] = 1 + max(rank[p] for p in preds)
        else:
            rank[name] = 1
    for name in order:  # sources that feed a node in their column: just above it
        users = [u for u in g.successors(name) if col[u] == col[name]]
        if g.in_degree(name) == 0 and users:
            rank[name] = max(0, min(rank[u] for u in users) - 1)
    cells: dict[tuple[int, int], list[str]] = {}
    for n in graph.nodes:
        cells.setdefault((col[n.name], rank[n.name]), []).append(n.name)
    width = {c: 0 for c in set(col.values())}
    for (c, _), names in cells.items():
        width[c] = max(width[c], len(names))
    x0, left = {}, 12.0
    for c in sorted(width):
        x0[c] = left
        left += width[c] * (NODE_W + GAP_X) + COL_GAP
    pos: dict[str, tuple[float, float]] = {}
    for (c, r), names in cells.items():
        pad = (width[c] - len(names)) * (NODE_W + GAP_X) / 2
        for k, name in enumerate(names):
            pos[name] = (x0[c] + pad + k * (NODE_W + GAP_X), TOP + r * (NODE_H + GAP_Y))
    return pos


def _shape(st: Style, x: float, y: float, w: float, h: float) -> str:
    dash = "4,3" if st.dashed else None
    if st.shape == "diamond":
        return svg.polygon([(x + w / 2, y), (x + w, y + h / 2), (x + w / 2, y + h), (x, y + h / 2)], st.fill,
                           stroke_dasharray=dash)
    if st.shape == "hexagon":
        d = h / 2.5
        return svg.polygon([(x + d, y), (x + w - d, y), (x + w, y + h / 2), (x + w - d, y + h), (x + d, y + h),
                            (x, y + h / 2)], st.fill, stroke_dasharray=dash)
    if st.shape == "ellipse":
        return svg.ellipse(x + w / 2, y + h / 2, w / 2, h / 2, st.fill, stroke_dasharray=dash)
    if st.shape == "cylinder":
        return (svg.rect(x, y + 4, w, h - 8, st.fill, stroke="none")
                + svg.line(x, y + 4, x, y + h - 4, stroke="#333") + svg.line(x + w, y + 4, x + w, y + h - 4, stroke="#333")
                + svg.ellipse(x + w / 2, y + h - 4, w / 2, 4, st.fill) + svg.ellipse(x + w / 2, y + 4, w / 2, 4, st.fill))
    return svg.rect(x, y, w, h, st.fill, rx=8 if st.shape == "rounded" else 2, stroke_dasharray=dash)


def _safe_id(name: str) -> str:
    return "n-" + re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _legend(roles: list[str]) -> list[str]:
    out, x = [], 12.0
    for role in roles:
        st = STYLES.get(role, DEFAULT_STYLE)
        out.append(f"<g class='legend'>{_shape(st, x, 32, 26, 18)}{svg.text(x + 31, 45, role, size=11)}</g>")
        x += 44 + 7 * len(role)
    return out


def plain_svg(graph: Graph, heading: str = "") -> str:
    """The picture drawn here (no graphviz): see plain_layout."""
    pos = plain_layout(graph)
    body: list[str] = []
    g = to_networkx(graph)
    for u, v in g.edges:
        (x1, y1), (x2, y2) = pos[u], pos[v]
        sx, sy, tx, ty = x1 + NODE_W / 2, y1 + NODE_H, x2 + NODE_W / 2, y2
        if ty <= sy:  # into another column, or upward: a curve from the side
            sx, sy, tx, ty = x1 + NODE_W, y1 + NODE_H / 2, x2, y2 + NODE_H / 2
        mid = (sy + ty) / 2 if abs(sx - tx) < 1 else None
        d = (f"M {sx:.1f} {sy:.1f} C {sx:.1f} {mid:.1f} {tx:.1f} {mid:.1f} {tx:.1f} {ty:.1f}" if mid is not None else
             f"M {sx:.1f} {sy:.1f} C {(sx + tx) / 2:.1f} {sy:.1f} {(sx + tx) / 2:.1f} {ty:.1f} {tx:.1f} {ty:.1f}")
        dash = "4,3" if style_of(g.nodes[u]["node"]).dashed else None
        body.append(f"<path {svg.attr(d=d, fill='none', stroke='#999', stroke_dasharray=dash)} marker-end='url(#arrow)'/>")
    for n in graph.nodes:
        x, y = pos[n.name]
        st = style_of(n)
        name, what = _label(n)
        ink = "white" if st.fill in DARK else "#222"
        body.append(f"<g {svg.attr(id=_safe_id(n.name), class_=f'node role-{n.role}')}>{svg.title(n.name)}"
                    f"{_shape(st, x, y, NODE_W, NODE_H)}"
                    f"{svg.text(x + NODE_W / 2, y + 16, name, size=11, anchor='middle', fill=ink)}"
                    f"{svg.text(x + NODE_W / 2, y + 29, what, size=9, anchor='middle', fill=ink)}</g>")
    roles = [r for r in STYLES if any(n.role == r for n in graph.nodes)]
    w = max((x for x, _ in pos.values()), default=0) + NODE_W + 24
    h = max((y for _, y in pos.values()), default=0) + NODE_H + 24
    w = max(w, sum(44 + 7 * len(r) for r in roles) + 24)
    return svg.document(w, h, _legend(roles) + body, heading)


def graph_to_dot(graph: Graph, heading: str = "") -> str:
    """Graphviz DOT text of the graph: one cluster per layer, node shape and colour by role."""
    def q(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = ["digraph moecc {", "  rankdir=TB; nodesep=0.15; ranksep=0.3;",
             '  node [fontname="Helvetica", fontsize=10, style=filled];', '  edge [color="#999999"];']
    if heading:
        lines.append(f"  label={q(heading)}; labelloc=t;")
    groups: dict[str, list[Node]] = {}
    for n in graph.nodes:
        groups.setdefault("stem" if n.layer is None else f"L{n.layer}", []).append(n)
    for key, nodes in groups.items():
        inner = key != "stem"
        if inner:
            lines.append(f"  subgraph cluster_{key} {{ label={q('layer ' + key[1:])}; color=\"#cccccc\";")
        for n in nodes:
            st = style_of(n)
            name, what = _label(n)
            style = "filled,dashed" if st.dashed else ("filled,rounded" if st.shape == "rounded" else "filled")
            font = "white" if st.fill in DARK else "black"
            lines.append(f"    {q(n.name)} [label={q(name + chr(10) + what)}, shape={st.dot_shape}, "
                         f"fillcolor={q(st.fill)}, fontcolor={font}, style={q(style)}, tooltip={q(n.role)}];")
        if inner:
            lines.append("  }")
    for n in graph.nodes:
        for i in n.inputs:
            lines.append(f"  {q(i)} -> {q(n.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def graph_to_svg(graph: Graph, heading: str = "", layout: str = "auto") -> str:
    """SVG text of the graph. layout: "dot" (graphviz, must be installed), "plain" (drawn
    here), or "auto" (dot when on the PATH, else plain)."""
    if layout not in ("auto", "dot", "plain"):
        raise ValueError(f"graph layout must be auto, dot or plain, not {layout!r}")
    exe = shutil.which("dot") if layout != "plain" else None
    if layout == "dot" and exe is None:
        raise RuntimeError("graph layout dot: graphviz's `dot` is not on the PATH; install graphviz or use plain")
    if exe is not None:
        done = subprocess.run([exe, "-Tsvg"], input=graph_to_dot(graph, heading), capture_output=True, text=True,
                              timeout=120)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout
        if layout == "dot":
            raise RuntimeError(f"graphviz dot failed: {done.stderr.strip()[:500]}")
    return plain_svg(graph, heading)
