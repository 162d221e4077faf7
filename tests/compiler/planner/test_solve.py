"""The planner's integer program: CP-SAT's optimum equals brute-force enumeration of the same
model, pruning dominated options changes no optimum, and every solution fits its budgets."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moecc.planner.hardware import resolve_hardware
from moecc.planner import solve as S
from moecc.planner.costs import model_cost

from tests.compiler.passes.util import graph_before

_COST = None


def cost():
    global _COST
    if _COST is None:
        g, _ = graph_before("solve_batch_sizes")  # 1-layer tiny Mixtral, config only
        _COST = model_cost(g)
    return _COST


def problem(**kw) -> S.Problem:
    base = dict(cost=cost(), rates=resolve_hardware("a5000"), prompt_tokens=24.0, output_tokens=16.0,
                gpu_mem=2_000_000, host_mem=None, max_batch=64, b_e_options=(8, 64, 512),
                tps_options=(128, 1024), b_a_options_max=3, split_options=(0.5,), device_reserve_given=0)
    base.update(kw)
    return S.Problem(**base)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 2e-4 * max(abs(a), abs(b))  # CP-SAT weighs steps with integer weights (1e-4)


#: a calibration (moecc/measure/calibrate.py) with slow KV loads: on a CPU their waits do not steal compute
CALIBRATION = {"streamed": {"factor": {"kv_load": 3.0, "fetch": 1.2, "attention": 1.3, "gemm": 1.1, "router": 2.0},
                            "job_s": {"kv_load": 4e-4, "attention": 1e-4, "gemm": 3e-5},
                            "overhead_layer_s": 2e-4, "overhead_row_s": 1e-6}}


def rates_for(name: str):
    if name == "a5000":
        return resolve_hardware("a5000")
    base = resolve_hardware("a5000" if name == "a5000+calibration" else "cpu")  # cpu: copy_overlap 0.5
    return dataclasses.replace(base, calibration=CALIBRATION)


@settings(max_examples=25, deadline=None)
@given(gpu=st.integers(150_000, 3_000_000), B=st.sampled_from([1, 4, 16, 64]),
       prompt=st.integers(4, 64), output=st.integers(1, 64),
       hw=st.sampled_from(["a5000", "a5000+calibration", "cpu+calibration"]))
@pytest.mark.slow
def test_cp_sat_optimum_equals_enumeration(gpu, B, prompt, output, hw):
    pr = problem(gpu_mem=gpu, prompt_tokens=float(prompt), output_tokens=float(output), rates=rates_for(hw))
    got = S.solve_for_batch(pr, B)
    want = S.enumerate_best(pr, B)
    assert (got is None) == (want is None)
    if got is not None:
        # CP-SAT's per-layer times are whole µs (a copy's stolen share rounds up): allow that
        steps = output / B + prompt / got.choice.prefill[0]
        slack = steps * (len(pr.cost.layers) + 1) * 1e-6
        assert close(got.seconds_per_request, want.seconds_per_request) or \
            abs(got.seconds_per_request - want.seconds_per_request) <= slack, (got.choice, want.choice)


@settings(max_examples=10, deadline=None)
@given(gpu=st.integers(200_000, 3_000_000), B=st.sampled_from([2, 16, 64]))
@pytest.mark.slow
def test_pruning_dominated_options_keeps_the_optimum(gpu, B):
    pr = problem(gpu_mem=gpu)
    a = S.enumerate_best(pr, B)
    b = S.enumerate_best(dataclasses.replace(pr, pareto=False), B)
    assert (a is None) == (b is None)
    if a is not None:
        assert a.seconds_per_request == b.seconds_per_request


@settings(max_examples=20, deadline=None)
@given(gpu=st.integers(150_000, 10**8), host=st.integers(10**5, 10**9), prompt=st.integers(1, 64),
       output=st.integers(1, 64), max_batch=st.integers(1, 512))
def test_solutions_fit_their_budgets(gpu, host, prompt, output, max_batch):
    pr = problem(gpu_mem=gpu, host_mem=host, prompt_tokens=float(prompt), output_tokens=float(output),
                 max_batch=max_batch)
    sol = S.solve(pr, time_limit_s=5)
    if sol is None:
        return
    dev = sol.device_bytes
    assert max(dev["decode_total"], dev["prefill_total"]) <= gpu * S.DEVICE_DERATE
    assert sum(sol.host_bytes.values()) + pr.reserve.total <= host
    ch = sol.choice
    assert 1 <= ch.b_a <= ch.B <= max_batch and ch.prefill[1] <= ch.B


def test_below_the_minimum_nothing_fits_and_at_it_something_does():
    pr = problem()
    minimum = S.minimum_device_bytes(pr)
    assert S.solve(dataclasses.replace(pr, gpu_mem=int(minimum / S.DEVICE_DERATE) - 1000)) is None
    assert S.solve(dataclasses.replace(pr, gpu_mem=int(minimum / S.DEVICE_DERATE) + 10)) is not None


def test_more_device_memory_never_predicts_slower():
    times = [S.solve(problem(gpu_mem=g)).seconds_per_request for g in (400_000, 1_000_000, 4_000_000, 10**9)]
    assert times == sorted(times, reverse=True)


def test_a_roomy_budget_keeps_weights_resident_and_a_tight_one_streams_them():
    roomy = S.solve(problem(gpu_mem=10**9))
    assert "L0.experts" in roomy.choice.resident
    assert all(b.endswith(": compute") for b in roomy.binding if b.startswith("L"))  # no copy binds
    tight = S.solve(problem(gpu_mem=int(S.minimum_device_bytes(problem()) / S.DEVICE_DERATE) + 2000))
    assert "L0.experts" not in tight.choice.resident
    assert tight.seconds_per_request > roomy.seconds_per_request


def test_no_device_budget_reads_weights_in_place():
    sol = S.solve(problem(gpu_mem=None))
    assert sol.choice.resident == frozenset() and sol.status.startswith("optimal")
    assert sol.device_bytes["resident_weights"] == 0


def test_copies_that_cannot_hide_get_no_prefetch():
    """A profile whose copies hide less than NO_OVERLAP behind compute (a small CPU VM)
    gets prefetch depth 0: one expert slot, each fetch while compute waits."""
    cpu = dataclasses.replace(resolve_hardware("cpu"), copy_overlap=-0.35)
    tight = int(S.minimum_device_bytes(problem()) / S.DEVICE_DERATE) + 150_000  # room for one expert slot more
    sol = S.solve(problem(rates=cpu, gpu_mem=tight))
    assert "L0.experts" not in sol.choice.resident and sol.choice.prefetch == 0
    gpu = S.solve(problem(gpu_mem=tight))
    assert "L0.experts" not in gpu.choice.resident and gpu.choice.prefetch >= 1  # a DMA engine: fetch ahead
