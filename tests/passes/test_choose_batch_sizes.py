import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moecc.errors import BudgetError
from moecc.passes.choose_batch_sizes import ChooseBatchSizes
from moecc.printer import format_graph

from tests.passes.util import check_golden, graph_before, run_pass


def test_choose_batch_sizes_golden():
    _, result = run_pass("choose_batch_sizes", gpu_mem=2_000_000, host_mem=64_000_000,
                         prompt_tokens=32, output_tokens=32)
    check_golden("choose_batch_sizes", format_graph(result.graph))


def test_unbounded_budgets_take_the_caps():
    _, result = run_pass("choose_batch_sizes", max_batch=512)
    assert result.graph.attrs["batch"]["decode"] == {"B": 512, "b_a": 512, "b_e": 4096}


def test_too_small_gpu_budget_names_the_minimum():
    graph, ctx = graph_before("choose_batch_sizes", gpu_mem=10_000)
    with pytest.raises(BudgetError, match=r"minimum working set.*use --gpu-mem"):
        ChooseBatchSizes().run(graph, ctx)


def test_too_small_host_budget_names_the_minimum():
    graph, ctx = graph_before("choose_batch_sizes", host_mem=10_000)
    with pytest.raises(BudgetError, match=r"--host-mem .* cannot hold the model"):
        ChooseBatchSizes().run(graph, ctx)


_GRAPH = None


def _graph():
    global _GRAPH
    if _GRAPH is None:
        _GRAPH = graph_before("choose_batch_sizes")
    return _GRAPH


@settings(max_examples=60, deadline=None)
@given(gpu=st.integers(50_000, 10**11), host=st.integers(200_000, 10**12),
       prompt=st.integers(1, 64), output=st.integers(1, 64), max_batch=st.integers(1, 4096))
def test_sizes_respect_budgets(gpu, host, prompt, output, max_batch):
    graph, ctx = _graph()
    ctx.options.update(gpu_mem=gpu, host_mem=host, prompt_tokens=prompt, output_tokens=output,
                       max_batch=max_batch)
    try:
        result = ChooseBatchSizes().run(graph, ctx)
    except BudgetError:
        return
    mem = result.graph.attrs["memory"]
    batch = result.graph.attrs["batch"]["decode"]
    dev = mem["device"]
    used = dev["dense_slots"] + dev["expert_slots"] + dev["expert_activations"] + dev["attention_kv"]
    assert used <= dev["budget"] <= gpu
    assert mem["host"]["weights"] + mem["host"]["kv_cache"] <= 0.8 * host
    assert 1 <= batch["b_a"] <= batch["B"] <= max_batch
    assert batch["b_e"] & (batch["b_e"] - 1) == 0  # a power of two
