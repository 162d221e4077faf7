"""Speculative expert prefetch: where a step's rows make every expert almost surely chosen
(rows x top_k >= 4 x experts, the runtime's rule), the runtime fetches a layer's first
`expert_slots` experts as soon as its attention module has submitted its last KV load (host
attention: when the module starts), not after the router. The step DAG and the solver's
program model it; below the threshold nothing changes; `moecc explain` says it per phase;
and it lets host attention hide part of the expert stream in the Mixtral-8x7B what-if."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from moecc.frontend.build import build_graph
from moecc.ir.pass_infra import PassContext, PassManager
from moecc.options import CompileOptions
from moecc.passes import default_pipeline
from moecc.passes.solve_batch_sizes import _problem
from moecc.planner import schedule
from moecc.planner import solve as S
from moecc.planner.hardware import resolve_hardware
from moecc.planner.schedule import Knobs, StepShape, build_schedule, speculated_experts, speculates
from moecc.sizes import parse_size
from moecc.views.explain import expert_prefetch_lines, explain, format_explain

from tests.compiler.planner.test_solve import close, cost, problem

MIXTRAL = Path(__file__).parents[3] / "examples" / "configs" / "mixtral-8x7b"


def shape(rows: int) -> StepShape:
    return StepShape(S=rows, T=rows, context=40.0, head_rows=rows)


def router_gated(monkeypatch, f):
    """f() with the planner as it was before speculation: every expert fetch waits for the router."""
    monkeypatch.setattr(schedule, "speculates", lambda rows, top_k, num_experts: False)
    try:
        return f()
    finally:
        monkeypatch.undo()


# -- the rule ----------------------------------------------------------------------------------

def test_the_rule_is_rows_times_top_k_against_four_times_the_experts():
    assert not speculates(15, 2, 8) and speculates(16, 2, 8)  # Mixtral: 16 rows x top-2 = 4 x 8
    assert not speculates(511, 8, 1024) and speculates(512, 8, 1024)
    assert not speculates(0, 2, 8)
    lc = cost().layers[0]  # the tiny Mixtral: 4 experts, top-2: from 8 rows on
    assert (lc.num_experts, lc.top_k) == (4, 2)
    assert speculated_experts(lc, 7, 2) == 0.0
    assert speculated_experts(lc, 8, 2) == 2.0 and speculated_experts(lc, 8, 9) == pytest.approx(3.984375)


def test_the_planner_mirrors_the_runtime_rule():
    from moecc_runtime.memory import streaming

    for rows, top_k, E in itertools.product((1, 3, 4, 8, 15, 16, 17, 64, 1024), (1, 2, 4, 8), (4, 8, 64, 256)):
        assert speculates(rows, top_k, E) == streaming.speculates(rows, top_k, E), (rows, top_k, E)


# -- the step DAG ------------------------------------------------------------------------------

@pytest.mark.parametrize("host_fraction", [1.0, 0.0])
def test_below_the_threshold_fetches_follow_the_router_above_it_attention(host_fraction):
    hw = resolve_hardware("a5000")
    knobs = Knobs(b_a=4, b_e=64, prefetch=1, host_fraction=host_fraction)  # two expert slots
    below = build_schedule(cost(), hw, shape(7), knobs)
    assert below.dag.has_edge("L0.router", "L0.fetch.e0") and below.dag.has_edge("L0.router", "L0.fetch.e1")
    assert below.jobs["L0.fetch.e0"].start >= below.jobs["L0.router"].end

    above = build_schedule(cost(), hw, shape(8), knobs)
    g, jobs = above.dag, above.jobs
    assert not nx_ancestor(g, "L0.router", "L0.fetch.e0") and not nx_ancestor(g, "L0.router", "L0.fetch.e1")
    assert jobs["L0.fetch.e0"].start < jobs["L0.router"].start  # beside attention
    # the rest of the chain as it was: expert 2 waits for expert 0 to free its slot, after the router
    assert g.has_edge("L0.expert.0", "L0.fetch.e2") and nx_ancestor(g, "L0.router", "L0.fetch.e2")
    attn = [n for n in jobs if n.startswith("L0.") and jobs[n].kind == "attention"]
    if host_fraction == 1.0:  # host attention: from the module's start, while attention runs
        assert all(jobs["L0.fetch.e0"].start < jobs[a].end for a in attn)
    else:  # device attention: after the layer's last KV load on the copy lane
        last_load = max((n for n in jobs if n.startswith("L0.kv_load.")), key=lambda n: jobs[n].end)
        assert nx_ancestor(g, last_load, "L0.fetch.e0")


def nx_ancestor(g, a: str, b: str) -> bool:
    import networkx as nx

    return nx.has_path(g, a, b)


def test_host_attention_hides_the_speculated_fetches(monkeypatch):
    hw = resolve_hardware("a5000")
    knobs = Knobs(b_a=64, b_e=64, prefetch=3, host_fraction=1.0)
    spec = build_schedule(cost(), hw, shape(64), knobs)
    gated = router_gated(monkeypatch, lambda: build_schedule(cost(), hw, shape(64), knobs))
    assert spec.seconds < gated.seconds
    assert spec.totals == pytest.approx(gated.totals)  # the same jobs, only earlier


def test_resident_experts_are_not_fetched_at_all():
    hw = resolve_hardware("a5000")
    s = build_schedule(cost(), hw, shape(64), Knobs(16, 64, 1, resident=frozenset({"L0.experts"})))
    assert not [n for n in s.jobs if ".fetch.e" in n]


# -- the program ------------------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [1.0, 0.5, 0.0])  # 0.0: below NO_OVERLAP, prefetch 0 only
@pytest.mark.parametrize("B", [4, 16, 64])  # 4: no speculation in decode
def test_cp_sat_equals_enumeration_with_speculation(B, overlap):
    """A slow link and a budget that streams experts: the speculated fetches weigh."""
    rates = dataclasses.replace(resolve_hardware("a5000"), copy_overlap=overlap, h2d_bandwidth=2e7)
    head = cost().logits_bytes(B) + cost().sampler_bytes(B)  # the step's logits beside the 50 kB the test streams in
    pr = problem(rates=rates, gpu_mem=50_000 + int(head / S.DEVICE_DERATE), prompt_tokens=8.0, output_tokens=8.0,
                 tps_options=(16, 64))
    got, want = S.solve_for_batch(pr, B), S.enumerate_best(pr, B)
    assert (got is None) == (want is None) and got is not None
    steps = pr.output_tokens / B + pr.prompt_tokens / got.choice.prefill[0]
    slack = steps * (len(pr.cost.layers) + 1) * 1e-6  # whole µs per layer in CP-SAT
    assert close(got.seconds_per_request, want.seconds_per_request) or \
        abs(got.seconds_per_request - want.seconds_per_request) <= slack, (got.choice, want.choice)


@pytest.mark.parametrize("gpu_mem", [40_000, 2_000_000])  # experts streamed; at B = 2 resident
def test_below_the_threshold_nothing_changes(monkeypatch, gpu_mem):
    """B <= 2 and prefill steps of 4 tokens: 4 rows x top-2 < 4 x 4 experts in both phases."""
    pr = problem(prompt_tokens=2.0, output_tokens=4.0, tps_options=(4,), gpu_mem=gpu_mem)
    for B in (1, 2):
        spec = S.solve_for_batch(pr, B)
        gated = router_gated(monkeypatch, lambda: S.solve_for_batch(pr, B))
        assert spec.choice == gated.choice and spec.seconds_per_request == gated.seconds_per_request
        a = pr.cost_model().predict(pr.workload, spec.choice)
        b = router_gated(monkeypatch, lambda: pr.cost_model().predict(pr.workload, gated.choice))
        assert a.rates() == b.rates()


# -- explain ----------------------------------------------------------------------------------

def test_explain_says_per_phase_whether_experts_are_fetched_before_routing():
    from moecc.compiler import compile_model

    plan = compile_model(Path(__file__).resolve().parents[1] / "passes" / "data" / "tiny-mixtral", prompt_tokens=2,
                         output_tokens=4, max_batch=2, hardware="a5000", gpu_mem=400_000,
                         device_reserve=0)[0]
    ep = plan["predicted"]["expert_prefetch"]
    assert ep["decode"]["rows"] == plan["batch"]["decode"]["B"] == 2 and not ep["decode"]["before_routing"]
    line = next(x for x in format_explain(explain(plan)).splitlines() if "experts fetched before routing" in x)
    assert "decode no, once the router has chosen them (2 rows x top-2 = 4 < 4 x 4 experts = 16; " \
           "P(an expert unused) = 0.25)" in line
    fake = {"factor": 4, "streamed_layers": 26,
            "decode": {"rows": 1024, "top_k": 2, "num_experts": 8, "before_routing": True,
                       "p_expert_unused": 0.75 ** 1024, "experts_in_use": 8.0, "experts_ahead": 3.0},
            "prefill": {"rows": 12, "top_k": 2, "num_experts": 8, "before_routing": False,
                        "p_expert_unused": 0.75 ** 12, "experts_in_use": 7.7, "experts_ahead": 0.0}}
    assert expert_prefetch_lines(fake) == [
        "  experts fetched before routing: decode yes, each layer's first 3 experts during its attention "
        "(1024 rows x top-2 = 2048 >= 4 x 8 experts = 32; P(an expert unused) < 1e-6); prefill no, once the "
        "router has chosen them (12 rows x top-2 = 24 < 4 x 8 experts = 32; P(an expert unused) = 0.032)"]
    assert expert_prefetch_lines(None) == []


# -- the what-if: Mixtral-8x7B on MoE-Gen's machine ----------------------------------------------

@pytest.fixture(scope="module")
def mixtral_problem() -> S.Problem:
    """Config-only Mixtral-8x7B, a5000 preset, 24GB / 512GB, 512 / 256 tokens, attention on the host."""
    g, ckpt = build_graph(MIXTRAL)
    o = CompileOptions(checkpoint=ckpt, gpu_mem=parse_size("24GB"), host_mem=parse_size("512GB"), hardware="a5000",
                       prompt_tokens=512, output_tokens=256, max_batch=1024, attention="host")
    g = PassManager(default_pipeline())(g, PassContext(options=o), stop_after="insert_transfers")
    return _problem(g, o)


def test_the_what_if_host_decode_improves_over_the_router_gated_one(mixtral_problem, monkeypatch):
    pr = mixtral_problem
    spec = S.solve_for_batch(pr, 1024)
    rate = pr.cost_model().predict(pr.workload, spec.choice).decode_tokens_per_s
    gated = router_gated(monkeypatch, lambda: S.solve_for_batch(pr, 1024))
    gated_rate = router_gated(monkeypatch, lambda: pr.cost_model().predict(pr.workload, gated.choice)
                              ).decode_tokens_per_s
    # router-gated: about 241 tok/s (each layer's expert stream after its host attention); with
    # the first slots' experts streamed during it: about 314
    assert rate > 1.15 * gated_rate
    assert spec.decode_step_s < 0.9 * gated.decode_step_s  # the program sees it too
    linear = spec.choice.B / spec.decode_step_s  # the program and the DAG agree on the chosen plan
    assert abs(linear - rate) <= 0.03 * rate
