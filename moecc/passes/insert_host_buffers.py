"""insert_host_buffers: route every value that crosses a module boundary through a host
buffer, where the hidden states of the whole batch are gathered between modules.

Requires: modules_split.
Does: for each value produced in one module and read in another, adds one `host_buffer`
node ("buf.<value>") at the end of the producing module and rewires every reader to it.
Guarantees: host_buffers (no compute node reads another module's value directly); every
  buffer carries `bytes_per_token` and a `slot`: buffers whose lives (from the module that
  writes one to the last module that reads it, both included) never overlap and whose rows
  are the same size share a slot, so a layer-by-layer schedule needs two ping-pong slots for
  the residual stream, plus one for each value read all step long (the rope table). The
  planner sizes host buffers by slots (moecc/planner/costs.py); a runtime that keys its
  host buffers by slot holds no more.
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
        assign_slots(g)
        return PassResult(g, modified=True)


def buffer_lives(g: Graph) -> dict[str, tuple[int, int]]:
    """Each host buffer's life in module order: (index of the module that writes it, index of
    the last module that reads it; the writer's when nothing reads it)."""
    order: dict[str, int] = {}
    for n in g.nodes:
        if n.module is not None:
            order.setdefault(n.module, len(order))
    lives = {n.name: (order[n.module], order[n.module]) for n in g.nodes
             if n.op == "host_buffer" and n.module is not None}
    for n in g.nodes:
        for i in n.inputs:
            if i in lives and n.module is not None:
                p, last = lives[i]
                lives[i] = (p, max(last, order[n.module]))
    return lives


def assign_slots(g: Graph) -> int:
    """Give every host buffer a `slot` attr (interval partitioning in production order: a
    buffer takes a slot of its row size whose last buffer's life ended before it is
    written, else a new one); returns the slots used."""
    lives = buffer_lives(g)
    nodes = g.by_name()
    free_at: list[tuple[int, int]] = []  # per slot: (row bytes, last module index of its latest buffer)
    for name in sorted(lives, key=lambda v: lives[v][0]):
        p, last = lives[name]
        rb = int(nodes[name].attrs.get("bytes_per_token", 0))
        slot = next((s for s, (b, end) in enumerate(free_at) if b == rb and end < p), None)
        if slot is None:
            slot = len(free_at)
            free_at.append((rb, last))
        else:
            free_at[slot] = (rb, last)
        nodes[name].attrs["slot"] = slot
    return len(free_at)



def _row_bytes(shape: tuple, itemsize: int) -> int:
    n = 1
    for d in shape[1:]:
        n *= int(d)
    return n * itemsize
