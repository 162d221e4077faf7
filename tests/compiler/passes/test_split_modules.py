from moecc.ir.printer import format_graph

from tests.compiler.passes.util import check_golden, run_pass


def test_split_modules_golden():
    _, result = run_pass("split_modules")
    assert result.modified
    check_golden("split_modules", format_graph(result.graph))


def test_every_layer_has_attention_then_expert_module():
    _, result = run_pass("split_modules", "tiny-qwen3")
    g = result.graph
    assert g.modules() == ["stem", "L0.attn", "L0.moe", "L1.attn", "L1.mlp", "head"]
    attn = [n for n in g.nodes if n.module == "L0.attn"]
    assert [n.op for n in attn] == ["rmsnorm", "attention", "add"]
    moe = {n.op for n in g.nodes if n.module == "L0.moe"}
    assert {"rmsnorm", "router", "experts", "add"} == moe
    dense = next(n for n in g.nodes if n.module == "L1.mlp" and n.op == "mlp")
    assert dense.role == "dense_mlp"
