"""Calibrate the planner's performance model on the runtime itself.

The rate curves of `moecc profile` time kernels one at a time; a real step also pays what
they leave out (prefill attention over a prompt, the KV store and gather path, the copy
thread's contention, the row gathers around each expert, Python between ops). `calibrate`
runs a short job of the model with `moecc exec --stats` in each execution mode (weights
read in place: "resident"; weights and KV through a device arena: "streamed"). The job has
a decode step (few rows) and a prefill step (many rows); for each, the planner's schedule
of that same step (`CostModel.step` at its sequences, rows, context and the plan's knobs) is
compared with the measured timeline, and per mode `fit_mode` fits:

  1. copy kinds (fetch, kv_load), then compute kinds (attention, gemm, router, head; a CPU
     copy steals compute by the bytes it moves, its modelled length, whatever its calibration):
     measured = factor x modelled + seconds per job x jobs, through the two steps' points
     (`affine`); the runtime's other glue ops count as router (the MoE module's glue is
     modelled there) and the embedding as overhead;
  2. overhead: seconds per layer that make each modelled step equal its measured one
     (bisection: with copies on the critical path compute can hide behind them), as a fixed
     part plus a part per row through the two steps (`split_overhead`).

The calibration plans are not what a user runs (a small batch, a short job): the fit says
what the runtime's jobs cost as a function of their size, not one plan's step time.
`fit_mode` is pure; `calibrate` compiles and runs.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from moecc_runtime.plan_schema import COMPUTE_JOB_KINDS, COPY_JOB_KINDS

from moecc.planner.hardware import CALIBRATION_FACTOR_RANGE, HardwareProfile
from moecc.planner.cost_model import CostModel, choice_of, streams_of
from moecc.planner.costs import ModelCost
from moecc.planner.schedule import Knobs, Schedule, StepShape, mode_of

COPY_KINDS = COPY_JOB_KINDS
COMPUTE_KINDS = COMPUTE_JOB_KINDS
#: measured compute kinds folded into a modelled one (the rest, e.g. stem, is overhead)
FOLD = {"glue": "router"}
MIN_SPREAD = 0.2  # the two steps' seconds per job must differ by this share to fit both parts
PROBE_S = 1e-3  # seconds per job added to count a kind's jobs as the schedule weighs them


def kind_seconds(jobs: list[list[Any]]) -> dict[str, float]:
    """Seconds per job kind of a timeline's jobs ([name, lane, kind, layer, start, seconds])."""
    out: dict[str, float] = {}
    for _name, _lane, kind, _layer, _start, sec in (j[:6] for j in jobs):
        k = FOLD.get(kind, kind)
        out[k] = out.get(k, 0.0) + float(sec)
    return out


def schedule_kinds(s: Schedule) -> dict[str, float]:
    return kind_seconds([[j.name, j.lane, j.kind, j.layer, j.start, j.seconds] for j in s.jobs.values()])


def step_shape(step: dict[str, Any]) -> StepShape:
    """The shape of a measured step (`moecc exec --stats` engine.timeline entry)."""
    S, T = int(step["sequences"]), int(step["tokens"])
    return StepShape(S=S, T=T, context=float(step.get("context") or 0.0),
                     head_rows=int(step.get("head_rows") or S))


def affine(points: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """(factor, seconds per job) from (modelled seconds, jobs, measured seconds) points:
    exact through two points when their modelled seconds per job differ by MIN_SPREAD and
    both parts come out in range; otherwise the factor alone
    (least squares through the origin, clamped to CALIBRATION_FACTOR_RANGE) and what it
    leaves, if positive, per job. None without a point both sides saw."""
    lo, hi = CALIBRATION_FACTOR_RANGE
    pts = [(p, u, m) for p, u, m in points if p > 0 and m > 0]
    if not pts:
        return None
    if len(pts) >= 2:
        (p1, u1, m1), (p2, u2, m2) = pts[0], pts[-1]
        det = p1 * u2 - p2 * u1
        # jobs of the same size in both steps (e.g. whole-expert fetches) cannot tell a
        # factor from a per-job cost: then the factor alone
        if abs(det) > MIN_SPREAD * max(abs(p1 * u2), abs(p2 * u1)):
            f, c = (m1 * u2 - m2 * u1) / det, (p1 * m2 - p2 * m1) / det
            if lo <= f <= hi and c >= 0:
                return f, c
    f = min(hi, max(lo, sum(m * p for p, _, m in pts) / sum(p * p for p, _, _ in pts)))
    units = sum(u * u for _, u, _ in pts)
    c = max(0.0, sum((m - f * p) * u for p, u, m in pts) / units) if units > 0 else 0.0
    return f, c


def split_overhead(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed seconds, seconds per row) of a layer's overhead from (rows, seconds) points of
    one mode's steps: the line through them, both parts >= 0 (least squares through the
    origin, or the mean, when the line would make one negative)."""
    if not points:
        return 0.0, 0.0
    if len(points) == 1 or len({r for r, _ in points}) == 1:
        return sum(x for _, x in points) / len(points), 0.0
    (r1, x1), (r2, x2) = sorted(points)[0], sorted(points)[-1]
    row = (x2 - x1) / (r2 - r1)
    fixed = x1 - row * r1
    if row < 0:
        return sum(x for _, x in points) / len(points), 0.0
    if fixed < 0:
        return 0.0, sum(r * x for r, x in points) / sum(r * r for r, _ in points)
    return fixed, row


def fit_mode(cost: ModelCost, rates: HardwareProfile, steps: list[tuple[Knobs, dict[str, Any]]]) -> dict[str, Any]:
    """The calibration of one execution mode (all `steps` are of plans in that mode) that makes
    the planner's schedules of the measured steps match their timelines; see the module
    docstring. `rates` is uncalibrated for this mode (other modes are kept)."""
    mode = mode_of(steps[0][0].streams)
    shapes = [step_shape(st) for _, st in steps]
    meas = [kind_seconds(st["jobs"]) for _, st in steps]

    def sched(i: int, cal: dict[str, Any]) -> Schedule:
        r = dataclasses.replace(rates, calibration={**rates.calibration, mode: cal})
        return CostModel(cost, r, steps[i][0].streams).step(shapes[i], steps[i][0])

    cal: dict[str, Any] = {"factor": {}, "job_s": {}}
    for kinds in (COPY_KINDS, COMPUTE_KINDS):
        pred = [schedule_kinds(sched(i, cal)) for i in range(len(steps))]
        probe = {**cal, "job_s": {**cal["job_s"], **{k: PROBE_S for k in kinds}}}
        probed = [schedule_kinds(sched(i, probe)) for i in range(len(steps))]
        for k in kinds:
            fit = affine([(pred[i].get(k, 0.0), (probed[i].get(k, 0.0) - pred[i].get(k, 0.0)) / PROBE_S,
                           meas[i].get(k, 0.0)) for i in range(len(steps))])
            if fit is not None:
                cal["factor"][k], cal["job_s"][k] = round(fit[0], 6), fit[1]
    points = []
    for i, (_, st) in enumerate(steps):
        target = float(st["step_s"])
        lo, hi = 0.0, max(0.0, target) / max(1, len(cost.layers))
        if sched(i, cal).seconds < target:
            for _ in range(30):  # the step time is non-decreasing in the overhead
                mid = (lo + hi) / 2
                if sched(i, {**cal, "overhead_layer_s": mid}).seconds < target:
                    lo = mid
                else:
                    hi = mid
        points.append((float(shapes[i].T), (lo + hi) / 2 if lo > 0 else 0.0))
    cal["overhead_layer_s"], cal["overhead_row_s"] = split_overhead(points)
    return cal


def _prompts(path: Path, n: int, lo: int, hi: int, max_tokens: int, vocab: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            ids = [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]
            f.write(json.dumps({"custom_id": f"cal{i}", "prompt": ids, "max_tokens": max_tokens}) + "\n")


@dataclasses.dataclass(frozen=True)
class Workload:
    """The calibration job: `sequences` prompts of `prompt` tokens (+-25%), `output` new
    tokens each, in plans bounded to that many sequences; the streamed plan's device budget
    is `streamed_share` of the weights."""

    sequences: int = 128
    prompt: int = 64
    output: int = 8
    streamed_share: float = 0.3


QUICK = Workload(sequences=16, prompt=24, output=4)


def calibrate(model: Path, rates: HardwareProfile, work: Path | None = None, workload: Workload = Workload(),
              device: str = "cpu", log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Run the calibration job of `model` in both modes; return the profile's `calibration`
    field ({"model": name, mode: fit_mode's fit}). A mode with no recorded step past the
    job's first is left out (uncorrected); with one step only, factors carry no per-job part
    and the overhead no per-row part. Raises HardwareError when a run fails."""
    from moecc.compiler import compile_model
    from moecc.errors import BudgetError, HardwareError, PassError
    from moecc.planner.costs import model_cost
    from moecc_runtime.plan import save_plan

    model = Path(model)
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    if not weights:
        raise HardwareError(f"--model {model}: no *.safetensors weights to calibrate on (a config-only "
                            f"directory); pass --no-calibrate to measure its expert MLP shape only")
    vocab = int(json.loads((model / "config.json").read_text()).get("vocab_size") or 0)
    if vocab < 4:
        raise HardwareError(f"--model {model}: config.json has no usable vocab_size for the calibration prompts")
    out: dict[str, Any] = {"model": model.name}
    with tempfile.TemporaryDirectory(prefix="moecc-calibrate-") as tmp:
        work = Path(work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        base = dataclasses.replace(rates, calibration={})
        hw = work / "hw-uncalibrated.json"
        base.save(hw)
        prompts = work / "calibrate-prompts.jsonl"
        w = workload
        _prompts(prompts, w.sequences, max(1, w.prompt * 3 // 4), w.prompt * 5 // 4, w.output, vocab)
        for mode, shares in (("resident", (None,)), ("streamed", (w.streamed_share, 0.5, 0.8))):
            compiled = None
            for share in shares:  # a small model's minimum working set may be a large share of it
                try:
                    compiled = compile_model(model, gpu_mem=None if share is None else int(share * weights),
                                             prompt_tokens=w.prompt, output_tokens=w.output, max_batch=w.sequences,
                                             hardware=hw)
                    break
                except PassError as e:
                    if not isinstance(e.__cause__, BudgetError):
                        raise
                    continue
            if compiled is None:
                log(f"calibration: no --gpu-mem up to {shares[-1]:.0%} of the weights fits {model}; "
                    f"{mode} weights left uncalibrated")
                continue
            plan, graph = compiled
            path, stats = work / f"calibrate-{mode}.pt", work / f"calibrate-{mode}-stats.json"
            save_plan(plan, path)
            log(f"calibrating {mode} weights: {w.sequences} prompts of ~{w.prompt} tokens, {w.output} new each")
            r = subprocess.run([sys.executable, "-m", "moecc.cli", "exec", str(path), str(prompts), "-o",
                                str(work / f"calibrate-{mode}.jsonl"), "--stats", str(stats), "--device", device,
                                "--overwrite", "--quiet"], capture_output=True, text=True)
            if r.returncode != 0:
                raise HardwareError(f"calibration run of {model} ({mode} weights) failed (exit {r.returncode}):\n"
                                    f"{r.stderr.strip()[-2000:]}")
            timeline = json.loads(stats.read_text())["engine"].get("timeline") or {}
            choice, streams = choice_of(plan), streams_of(plan)
            steps = [(choice.knobs(phase, streams), step) for phase, step in sorted(timeline.items())
                     if step.get("step", 2) > 1]  # a job's first step pays page faults: not a rate
            steps = [(k, st) for k, st in steps if mode_of(k.streams) == mode]  # no arena: the model fit the budget
            if steps:
                out[mode] = fit_mode(model_cost(graph), base, steps)
    return out
