"""split_modules: split every decoder layer into an attention module and an expert module.

Requires: traced.
Does: the attention module of layer i ("L{i}.attn") is the attention node, its in-layer
ancestors and the residual add that first consumes it; the rest of the layer is the expert
module ("L{i}.moe") or, for a dense layer, "L{i}.mlp". Embedding and rotary form "stem",
final norm and lm_head "head". Nodes are stably reordered so every module is contiguous.
Guarantees: modules_split (every compute node has a module; modules are contiguous and in
execution order).
Options: none.
"""

from __future__ import annotations

from moecc.errors import PassError
from moecc.ir import Graph, Node
from moecc.ir.pass_infra import Pass, PassContext, PassResult


class SplitModules(Pass):
    name = "split_modules"
    requires = frozenset({"traced"})
    ensures = frozenset({"modules_split"})

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        g = graph.copy()
        out: list[Node] = []
        layer_nodes: list[Node] = []
        current: int | None = None

        def flush() -> None:
            if layer_nodes:
                out.extend(_split_layer(g, current, layer_nodes))  # type: ignore[arg-type]
                layer_nodes.clear()

        for n in g.nodes:
            if n.layer is None:
                flush()
                current = None
                if n.op not in ("input", "output"):
                    n.module = "stem" if n.op in ("embed", "rope") else "head"
                out.append(n)
            else:
                if n.layer != current:
                    flush()
                    current = n.layer
                layer_nodes.append(n)
        flush()
        g.nodes = out
        return PassResult(g, modified=True)


def _split_layer(g: Graph, layer: int, nodes: list[Node]) -> list[Node]:
    attn = [n for n in nodes if n.op == "attention"]
    if len(attn) != 1:
        raise PassError("split_modules", f"layer {layer}: expected one attention node, found {len(attn)}")
    names = {n.name for n in nodes}
    by_name = {n.name: n for n in nodes}
    # in-layer ancestors of the attention node
    keep = {attn[0].name}
    stack = [attn[0].name]
    while stack:
        for i in by_name[stack.pop()].inputs:
            if i in names and i not in keep:
                keep.add(i)
                stack.append(i)
    residual = next((n for n in nodes if n.op == "add" and attn[0].name in n.inputs), None)
    if residual is None:
        raise PassError("split_modules", f"layer {layer}: no residual add consumes %{attn[0].name}")
    keep.add(residual.name)
    ffn_kind = "moe" if any(n.op == "experts" for n in nodes) else "mlp"
    first = [n for n in nodes if n.name in keep]
    rest = [n for n in nodes if n.name not in keep]
    for n in first:
        n.module = f"L{layer}.attn"
    for n in rest:
        n.module = f"L{layer}.{ffn_kind}"
        if n.op == "mlp":
            n.role = "shared_expert" if ffn_kind == "moe" else "dense_mlp"
    return first + rest
