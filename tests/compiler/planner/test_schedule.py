"""The step DAG: its critical path bounds every lane, overlap (prefetch) never makes a step
slower, resident weights are never fetched, a plan without an arena has no copy lane, and
on a CPU the copies of an arena steal their non-overlapping share from compute."""

from __future__ import annotations

import networkx as nx

from moecc.planner.hardware import resolve_hardware
from moecc.planner.schedule import Knobs, StepShape, build_schedule

from tests.compiler.planner.test_solve import cost

SHAPE = StepShape(S=64, T=64, context=40.0, head_rows=64)


def test_critical_path_is_a_path_and_bounds_each_lane():
    s = build_schedule(cost(), resolve_hardware("a5000"), SHAPE, Knobs(b_a=16, b_e=64, prefetch=1))
    assert nx.is_directed_acyclic_graph(s.dag)
    assert all(s.dag.has_edge(a, b) for a, b in zip(s.critical_path, s.critical_path[1:]))
    assert s.seconds >= max(s.totals.values()) - 1e-12
    assert s.seconds <= sum(s.totals.values()) + 1e-12
    assert abs(sum(s.jobs[j].seconds for j in s.critical_path) - s.seconds) < 1e-9  # no gaps on the path
    for a, b in s.dag.edges:
        assert s.jobs[b].start >= s.jobs[a].end - 1e-12


def test_prefetch_overlaps_fetch_and_compute():
    hw = resolve_hardware("a5000")
    serial = build_schedule(cost(), hw, SHAPE, Knobs(16, 64, prefetch=0))
    overlapped = build_schedule(cost(), hw, SHAPE, Knobs(16, 64, prefetch=2))
    assert overlapped.seconds <= serial.seconds
    assert overlapped.totals == serial.totals  # same work, better overlap


def test_resident_weights_are_not_fetched():
    hw = resolve_hardware("a5000")
    s = build_schedule(cost(), hw, SHAPE, Knobs(16, 64, 1, frozenset({"all"})))
    assert not [j for j in s.jobs.values() if j.kind == "fetch"]
    streamed = build_schedule(cost(), hw, SHAPE, Knobs(16, 64, 1))
    fetched = {j.name for j in streamed.jobs.values() if j.kind == "fetch"}
    assert "L0.fetch.attn" in fetched and "head.fetch" in fetched
    assert any(n.startswith("L0.fetch.e") for n in fetched)


def test_no_arena_no_copy_lane_and_names_its_bottleneck():
    for hw in ("cpu", "a5000"):
        s = build_schedule(cost(), resolve_hardware(hw), SHAPE, Knobs(16, 64, 1, frozenset({"all"})))
        assert set(s.totals) == {"compute"}
        assert s.bottleneck() in ("device compute", "attention")


def test_cpu_copies_steal_compute_by_their_non_overlapping_share():
    """Streaming on a CPU: every copy-lane second costs (1 - copy_overlap) compute seconds;
    the in-place KV gather moves off the compute thread onto the copy lane."""
    hw = resolve_hardware("cpu")
    knobs = Knobs(16, 64, 1)
    full = build_schedule(cost(), hw, SHAPE, knobs)
    hw.copy_overlap = 1.0
    free = build_schedule(cost(), hw, SHAPE, knobs)
    assert free.totals["copy"] == full.totals["copy"] > 0
    stolen = full.totals["compute"] - free.totals["compute"]
    assert abs(stolen - 0.5 * full.totals["copy"]) < 1e-9  # the cpu preset's overlap is 0.5
    assert full.seconds > free.seconds


def test_bigger_micro_batches_mean_fewer_attention_jobs():
    hw = resolve_hardware("a5000")
    small = build_schedule(cost(), hw, SHAPE, Knobs(b_a=8, b_e=64))
    big = build_schedule(cost(), hw, SHAPE, Knobs(b_a=64, b_e=64))
    count = lambda s: sum(1 for j in s.jobs.values() if j.kind == "attention")  # noqa: E731
    assert count(small) == 8 and count(big) == 1


def test_copies_that_cost_more_than_their_length_and_prefetch_zero():
    """copy_overlap < 0 (measured on 2-core VMs: a copy-second costs 1.2-1.8 compute-seconds)
    charges compute more than the copy's own length; with prefetch 0 an expert's fetch runs
    while compute waits for it (one slot) and steals nothing, so only KV loads and dense
    fetches are charged; but an expert fetched before routing (a step of 64 rows: the runtime
    speculates on the first expert slot) runs beside attention and is charged too."""
    hw = resolve_hardware("cpu")
    few = StepShape(S=6, T=6, context=40.0, head_rows=6)  # 6 rows x top-2 < 4 x 4 experts: no speculation
    for shape, speculated in ((few, set()), (SHAPE, {"L0.fetch.e0"})):
        hw.copy_overlap = -0.4
        ahead = build_schedule(cost(), hw, shape, Knobs(16, 64, 1))
        hw.copy_overlap = 1.0
        free = build_schedule(cost(), hw, shape, Knobs(16, 64, 1))
        assert abs((ahead.totals["compute"] - free.totals["compute"]) - 1.4 * ahead.totals["copy"]) < 1e-9
        hw.copy_overlap = -0.4
        serial = build_schedule(cost(), hw, shape, Knobs(16, 64, 0))
        expert_fetch = sum(j.seconds for j in serial.jobs.values()
                           if j.kind == "fetch" and ".fetch.e" in j.name and j.name not in speculated)
        assert expert_fetch > 0
        assert abs((serial.totals["compute"] - free.totals["compute"])
                   - 1.4 * (serial.totals["copy"] - expert_fetch)) < 1e-9
