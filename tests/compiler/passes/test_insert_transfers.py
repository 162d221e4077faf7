from moecc.ir.printer import format_graph

from tests.compiler.passes.util import check_golden, run_pass


def test_insert_transfers_golden():
    _, result = run_pass("insert_transfers")
    check_golden("insert_transfers", format_graph(result.graph))


def test_every_weighted_node_depends_on_its_fetch():
    _, result = run_pass("insert_transfers")
    g = result.graph
    nodes = g.by_name()
    for n in g.nodes:
        if n.weights:
            fetch = nodes[f"fetch.{n.name}"]
            assert fetch.name in n.inputs and fetch.module == n.module
            assert g.nodes.index(fetch) < g.nodes.index(n)
    experts = g.node("l0.mlp_experts")
    f = nodes["fetch.l0.mlp_experts"]
    assert f.op == "fetch_experts"
    assert f.attrs["bytes_per_expert"] * f.attrs["num_experts"] == experts.weight_bytes
    attn = g.node("l0.self_attn")
    assert "kv_load.l0.self_attn" in attn.inputs
    store = nodes["kv_store.l0.self_attn"]
    assert store.inputs == ["l0.self_attn"]
    # K and V of one token: 2 x kv_heads(1) x head_dim(8) x 4 bytes
    assert store.attrs["bytes_per_token"] == 64
