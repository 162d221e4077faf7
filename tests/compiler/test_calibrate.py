"""Calibrating the planner on the runtime: the fit recovers the job costs it is shown, the
calibration is validated field by field, the schedule and the ILP apply it alike, and
`moecc profile --model` calibrates on a real job of a real checkpoint."""

from __future__ import annotations

import dataclasses
import json

import pytest

from moecc.measure.calibrate import affine, fit_mode, kind_seconds, schedule_kinds, split_overhead
from moecc.errors import HardwareError
from moecc.planner.hardware import HardwareProfile, resolve_hardware
from moecc.planner.schedule import Knobs, StepShape, build_schedule

from tests.compiler.planner.test_solve import cost

DECODE = StepShape(S=64, T=64, context=40.0, head_rows=64)
PREFILL = StepShape(S=16, T=512, context=16.0, head_rows=16)
#: what a runtime might cost against the model: copies slower, KV loads with a cost per
#: transfer, attention and experts with a fixed cost per job, glue heavier (whole-weight
#: fetches are the same size in both steps, so only their factor can be told apart)
TRUE = {"factor": {"fetch": 1.3, "kv_load": 2.5, "attention": 1.2, "gemm": 0.9, "router": 1.8, "head": 1.1},
        "job_s": {"fetch": 0.0, "kv_load": 3e-4, "attention": 1e-4, "gemm": 5e-5, "router": 2e-4, "head": 0.0}}


def cpu(calibration: dict | None = None) -> HardwareProfile:
    return dataclasses.replace(resolve_hardware("cpu"), copy_overlap=-0.35, calibration=calibration or {})


def measured(shape: StepShape, knobs: Knobs, truth: dict, extra_layer_s: float = 0.0) -> dict:
    """A step timeline as `moecc exec --stats` records it, made by the schedule under `truth`,
    with `extra_layer_s` of idle per layer that no job accounts for."""
    mode = "streamed" if knobs.streams else "resident"
    s = build_schedule(cost(), cpu({mode: truth}), shape, knobs)
    jobs = [[j.name, j.lane, j.kind, j.layer, j.start, j.seconds] for j in s.jobs.values()]
    return {"step": 5, "step_s": s.seconds + extra_layer_s * len(cost().layers), "sequences": shape.S,
            "tokens": shape.T, "prefill_tokens": shape.T if shape.T > shape.S else 0, "context": shape.context,
            "head_rows": shape.head_rows, "jobs": jobs}


def test_fit_recovers_factors_and_per_job_costs_of_a_streamed_runtime():
    knobs = Knobs(b_a=16, b_e=64, prefetch=1)
    steps = [(knobs, measured(DECODE, knobs, TRUE)), (knobs, measured(PREFILL, knobs, TRUE))]
    fit = fit_mode(cost(), cpu(), steps)
    for part in ("factor", "job_s"):
        for kind, want in TRUE[part].items():
            assert fit[part][kind] == pytest.approx(want, rel=1e-3, abs=1e-8), (part, kind)
    calibrated = cpu({"streamed": fit})
    for shape, (_, step) in zip((DECODE, PREFILL), steps):
        s = build_schedule(cost(), calibrated, shape, knobs)
        assert s.seconds == pytest.approx(step["step_s"], rel=1e-3)
        for kind, sec in kind_seconds(step["jobs"]).items():
            assert schedule_kinds(s)[kind] == pytest.approx(sec, rel=1e-3), kind


def test_fit_puts_unaccounted_time_in_a_fixed_and_a_per_row_overhead():
    knobs = Knobs(b_a=64, b_e=512, prefetch=1, resident=frozenset({"all"}))
    fixed, per_row = 3e-4, 2e-6
    steps = [(knobs, measured(sh, knobs, {}, fixed + per_row * sh.T)) for sh in (DECODE, PREFILL)]
    fit = fit_mode(cost(), cpu(), steps)
    assert fit["overhead_layer_s"] == pytest.approx(fixed, rel=1e-3)
    assert fit["overhead_row_s"] == pytest.approx(per_row, rel=1e-3)
    assert all(f == pytest.approx(1.0, abs=1e-6) for f in fit["factor"].values())
    for sh, (_, step) in zip((DECODE, PREFILL), steps):
        assert build_schedule(cost(), cpu({"resident": fit}), sh, knobs).seconds == pytest.approx(step["step_s"],
                                                                                                 rel=1e-3)


def test_affine_and_overhead_fits_stay_in_range():
    assert affine([(1.0, 1.0, 0.0)]) is None  # nothing measured
    assert affine([(2.0, 1.0, 4.0)]) == (2.0, 0.0)  # one point: the factor alone
    f, c = affine([(1.0, 1.0, 3.0), (2.0, 1.0, 5.0)])  # exact: 2x + 1 s per job
    assert (f, c) == pytest.approx((2.0, 1.0))
    f, c = affine([(1.0, 1.0, 1.0), (2.0, 1.0, 3.0)])  # the line needs a negative per-job part
    assert c >= 0 and 0.05 <= f <= 50
    assert split_overhead([(10.0, 1.0), (100.0, 0.5)]) == (0.75, 0.0)  # falling: the mean, fixed
    assert split_overhead([(10.0, 0.0), (100.0, 2.0)])[0] == 0.0  # rising through below zero: per row only
    assert split_overhead([]) == (0.0, 0.0)


def test_calibration_round_trips_and_bad_fields_are_named():
    cal = {"model": "m", "streamed": {**TRUE, "overhead_layer_s": 1e-3, "overhead_row_s": 1e-6}}
    p = cpu(cal)
    q = HardwareProfile.from_json(json.loads(json.dumps(p.to_json())))
    assert q.calibration == cal
    assert q.calibrated("streamed", "gemm", 2.0, 3) == pytest.approx(0.9 * 2.0 + 3 * 5e-5)
    assert q.calibrated("resident", "gemm", 2.0, 3) == 2.0  # an uncalibrated mode is unchanged
    assert q.overhead_s("streamed", 100) == pytest.approx(1e-3 + 1e-4)
    base = p.to_json()
    for bad, field in [({"streamed": {"factor": {"gemm": 0.0}}}, "calibration.streamed.factor.gemm"),
                       ({"streamed": {"factor": {"softmax": 1.0}}}, "calibration.streamed.factor.softmax"),
                       ({"streamed": {"job_s": {"gemm": -1.0}}}, "calibration.streamed.job_s.gemm"),
                       ({"streamed": {"overhead_row_s": float("nan")}}, "calibration.streamed.overhead_row_s"),
                       ({"offloaded": {}}, "calibration.offloaded"),
                       ({"streamed": {"speed": 1}}, "calibration.streamed.speed"),
                       ([], "calibration")]:
        with pytest.raises(HardwareError, match=field.replace(".", r"\.")):
            HardwareProfile.from_json({**base, "calibration": bad}, origin="hw.json")


def test_schedule_scales_jobs_but_copies_steal_by_the_bytes_they_move():
    knobs = Knobs(b_a=16, b_e=64, prefetch=1)
    raw = build_schedule(cost(), cpu(), DECODE, knobs)
    slow_copies = build_schedule(cost(), cpu({"streamed": {"factor": {"kv_load": 10.0, "fetch": 10.0}}}), DECODE,
                                 knobs)
    for name, j in raw.jobs.items():
        if j.lane == "copy":
            assert slow_copies.jobs[name].seconds == pytest.approx(10 * j.seconds)
        else:  # the compute a copy steals is unchanged: it waits longer, it moves no more bytes
            assert slow_copies.jobs[name].seconds == pytest.approx(j.seconds)
    assert slow_copies.seconds >= raw.seconds


@pytest.mark.slow
def test_profile_calibrates_on_a_real_job_and_compile_uses_it(tmp_path, checkpoints):
    from typer.testing import CliRunner

    from moecc.cli import app
    from moecc.compiler import compile_model

    model = checkpoints("mixtral")
    out = tmp_path / "hw.json"
    r = CliRunner().invoke(app, ["profile", "--quick", "--device", "cpu", "--model", str(model), "-o", str(out)])
    assert r.exit_code == 0, r.output
    p = HardwareProfile.load(out)
    assert p.calibration["model"] == model.name
    assert set(p.calibration) - {"model"} == {"resident", "streamed"}
    for mode in ("resident", "streamed"):
        cal = p.calibration[mode]
        assert {"attention", "gemm", "router", "head"} <= set(cal["factor"])
        assert cal["overhead_layer_s"] >= 0 and cal["overhead_row_s"] >= 0
    # the CPU's plans attend on the host, over the KV pool in place: no KV load to calibrate
    assert "fetch" in p.calibration["streamed"]["factor"]
    assert "calibrated on" in r.output
    plans = {name: compile_model(model, hardware=hw, prompt_tokens=16, output_tokens=8)[0]
             for name, hw in (("calibrated", out), ("raw", _saved(dataclasses.replace(p, calibration={}), tmp_path)))}
    assert plans["calibrated"]["predicted"]["decode_step_s"] != plans["raw"]["predicted"]["decode_step_s"]
    assert plans["calibrated"]["predicted"]["calibrated_on"] == model.name
    assert plans["raw"]["predicted"]["calibrated_on"] is None
    from moecc.views.explain import explain, format_explain

    assert f"calibrated on a job of {model.name}" in format_explain(explain(plans["calibrated"]))


def _saved(p: HardwareProfile, tmp_path) -> str:
    path = tmp_path / "raw.json"
    p.save(path)
    return str(path)
