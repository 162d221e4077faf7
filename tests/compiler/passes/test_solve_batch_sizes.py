import pytest

from moecc.errors import BudgetError
from moecc.passes.solve_batch_sizes import SolveBatchSizes
from moecc.ir.printer import format_graph

from tests.compiler.passes.util import check_golden, graph_before, run_pass


def test_solve_batch_sizes_golden():
    _, result = run_pass("solve_batch_sizes", gpu_mem=2_000_000, host_mem=64_000_000, host_reserve=48_000_000,
                         prompt_tokens=32, output_tokens=32, hardware="a5000", device_reserve=0)
    check_golden("solve_batch_sizes", format_graph(result.graph))


def test_unbounded_budgets_on_cpu_read_weights_in_place():
    _, result = run_pass("solve_batch_sizes", max_batch=512, prompt_tokens=32, output_tokens=32)
    a = result.graph.attrs
    assert a["batch"]["decode"]["B"] <= 512
    assert a["batch"]["overlap"]["resident"] == ["all"]
    assert a["predicted"]["hardware"] == "cpu"
    assert a["predicted"]["decode_tokens_per_s"] > 0 and a["predicted"]["prefill_tokens_per_s"] > 0


def test_too_small_gpu_budget_names_the_minimum():
    graph, ctx = graph_before("solve_batch_sizes", gpu_mem=10_000, hardware="a5000")
    with pytest.raises(BudgetError, match=r"minimum working set.*use --gpu-mem"):
        SolveBatchSizes().run(graph, ctx)


def test_too_small_host_budget_names_the_minimum():
    graph, ctx = graph_before("solve_batch_sizes", host_mem=10_000)
    with pytest.raises(BudgetError, match=r"--host-mem .* cannot hold the model"):
        SolveBatchSizes().run(graph, ctx)


def test_unknown_hardware_lists_the_presets():
    graph, ctx = graph_before("solve_batch_sizes", hardware="tpu-v9")
    with pytest.raises(Exception, match="a5000"):
        SolveBatchSizes().run(graph, ctx)
