"""insert_host_buffers: route every value that crosses a module boundary through a host
buffer, where the hidden states of the whole batch are gathered between modules.

Requires: modules_split.
Does: for each value produced in one module and read in another, adds one `host_buffer`
node ("buf.<value>") at the end of the producing module and rewires every reader to it.
Guarantees: host_buffers (no compute node reads another module's value directly).
Options: none.
"""

from __future__ import annotations

from moecc.ir import DTYPE_BYTES, TRANSFER_OPS, Graph, Node
from moecc.ir.pass_infra import Pass, PassContext, PassResult


class InsertHostBuffers(Pass):
    name = "insert_host_buffers"
    requires = frozenset({"modules_split"})
    ensures = frozenset({"host_buffers"})

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        g = graph.copy()
        nodes = g.by_name()
        crossing: set[str] = set()
        for n in g.nodes:
            if n.module is None or n.op in TRANSFER_OPS:
                continue
            for i in n.inputs:
                src = nodes[i]
                if src.module is not None and src.module != n.module and src.op != "host_buffer":
                    crossing.add(i)
        if not crossing:
            return PassResult(g, modified=False)
        itemsize = DTYPE_BYTES[g.info.dtype]
        buffers = {
            v: Node(f"buf.{v}", "host_buffer", [v], role="buffer", module=nodes[v].module, layer=nodes[v].layer,
                    shape=nodes[v].shape, attrs={"bytes_per_token": _row_bytes(nodes[v].shape, itemsize)})
            for v in crossing
        }
        pos = {n.name: i for i, n in enumerate(g.nodes)}
        by_module: dict[str, list[Node]] = {}
        for v in sorted(buffers, key=pos.__getitem__):
            by_module.setdefault(nodes[v].module, []).append(buffers[v])  # type: ignore[arg-type]
        out: list[Node] = []
        for idx, n in enumerate(g.nodes):
            if n.module is not None and n.op not in TRANSFER_OPS:
                n.inputs = [
                    buffers[i].name if i in buffers and nodes[i].module != n.module else i for i in n.inputs
                ]
            out.append(n)
            nxt = g.nodes[idx + 1] if idx + 1 < len(g.nodes) else None
            if n.module is not None and (nxt is None or nxt.module != n.module):
                # end of module n.module: its outgoing buffers, in production order
                out.extend(by_module.get(n.module, []))
        g.nodes = out
        return PassResult(g, modified=True)


def _row_bytes(shape: tuple, itemsize: int) -> int:
    n = 1
    for d in shape[1:]:
        n *= int(d)
    return n * itemsize
