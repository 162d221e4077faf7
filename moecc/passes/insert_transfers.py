"""insert_transfers: make data movement explicit.

Requires: host_buffers.
Does: at the start of every module, one `fetch_weights` node per weighted compute node
(host->device copy of its dense weights) and one `fetch_experts` node for the experts node
(copies only experts some token chose, one after another); around each attention node a
`kv_load` (the micro-batch's KV to the device) and a `kv_store` (new K/V back to host).
Each compute node gains its fetch (and kv_load) as an input, so order is data dependence.
Guarantees: transfers (every weighted compute node depends on its fetch; every attention
node on a kv_load).
Options: none.
"""

from __future__ import annotations

from moecc.ir import Graph, Node
from moecc.ir.pass_infra import Pass, PassContext, PassResult


class InsertTransfers(Pass):
    name = "insert_transfers"
    requires = frozenset({"host_buffers"})
    ensures = frozenset({"transfers"})

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        g = graph.copy()
        info = g.info
        kv_row = info.kv_row_bytes
        out: list[Node] = []
        i = 0
        nodes = g.nodes
        while i < len(nodes):
            module = nodes[i].module
            if module is None:
                out.append(nodes[i])
                i += 1
                continue
            j = i
            while j < len(nodes) and nodes[j].module == module:
                j += 1
            body = nodes[i:j]
            fetches: list[Node] = []
            for n in body:
                if not n.weights:
                    continue
                if n.op == "experts":
                    per_expert = n.weight_bytes // n.attrs["num_experts"]
                    f = Node(f"fetch.{n.name}", "fetch_experts", [], role="transfer", module=module,
                             layer=n.layer, shape=(n.attrs["num_experts"],),
                             attrs={"direction": "h2d", "bytes_per_expert": per_expert,
                                    "num_experts": n.attrs["num_experts"]})
                else:
                    f = Node(f"fetch.{n.name}", "fetch_weights", [], role="transfer", module=module,
                             layer=n.layer, shape=(len(n.weights),),
                             attrs={"direction": "h2d", "bytes": n.weight_bytes})
                fetches.append(f)
                n.inputs = n.inputs + [f.name]
            new_body: list[Node] = []
            for n in body:
                if n.op == "attention":
                    load = Node(f"kv_load.{n.name}", "kv_load", [], role="transfer", module=module,
                                layer=n.layer, shape=("B", "ctx", kv_row),
                                attrs={"direction": "h2d", "bytes_per_ctx_token": kv_row})
                    new_body.append(load)
                    n.inputs = n.inputs + [load.name]
                    new_body.append(n)
                    new_body.append(Node(f"kv_store.{n.name}", "kv_store", [n.name], role="transfer",
                                         module=module, layer=n.layer, shape=("T", kv_row),
                                         attrs={"direction": "d2h", "bytes_per_token": kv_row}))
                else:
                    new_body.append(n)
            out.extend(fetches + new_body)
            i = j
        g.nodes = out
        return PassResult(g, modified=True)
