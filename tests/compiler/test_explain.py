"""`moecc explain`: the plan's predictions, bottlenecks, memory and a job's ETA, as text and
as JSON with the documented keys."""

from __future__ import annotations

import json

import pytest

from typer.testing import CliRunner

from moecc.cli import app
from moecc.compiler import compile_model
from moecc_runtime.plan import save_plan

KEYS = {"prefill_tokens_per_s", "decode_tokens_per_s", "bottleneck", "device_bytes", "host_bytes", "batch"}


def _plan(checkpoints, tmp_path, **kw):
    ckpt = checkpoints("mixtral", "per_expert")
    plan, _ = compile_model(ckpt, prompt_tokens=16, output_tokens=16, **kw)
    path = tmp_path / "plan.pt"
    save_plan(plan, path)
    return ckpt, path


def test_explain_json_has_the_documented_keys(checkpoints, tmp_path):
    _, path = _plan(checkpoints, tmp_path, gpu_mem=4_000_000, hardware="a5000", device_reserve=0)
    res = CliRunner().invoke(app, ["explain", str(path), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert KEYS <= set(rep)
    assert rep["prefill_tokens_per_s"] > 0 and rep["decode_tokens_per_s"] > 0
    assert set(rep["bottleneck"]) == {"prefill", "decode"}
    assert set(rep["batch"]) == {"prefill", "decode"} and set(rep["batch"]["decode"]) == {"B", "b_a", "b_e"}
    assert rep["batch"]["prefill"]["tokens_per_step"] >= 1
    assert rep["device_bytes"]["budget"] == 3_600_000
    assert max(rep["device_bytes"]["decode_total"], rep["device_bytes"]["prefill_total"]) <= 3_600_000
    assert rep["hardware"] == "a5000"


def test_explain_text_and_eta_for_a_prompts_file(checkpoints, tmp_path):
    _, path = _plan(checkpoints, tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "hello there", "max_tokens": 10},
        {"prompt": [1, 5, 9], "max_tokens": 20},
        "not json",
    ]) + "\n")
    res = CliRunner().invoke(app, ["explain", str(path), "--prompts", str(prompts), "--json"])
    assert res.exit_code == 0, res.output
    eta = json.loads(res.output)["eta"]
    assert eta["requests"] == 2 and eta["invalid"] == 1 and eta["max_output_tokens"] == 30
    rep = json.loads(res.output)
    want = eta["prompt_tokens"] / rep["prefill_tokens_per_s"] + 30 / rep["decode_tokens_per_s"]
    assert abs(eta["seconds"] - want) < 1e-9
    text = CliRunner().invoke(app, ["explain", str(path)])
    assert text.exit_code == 0
    assert "bottleneck" in text.output and "tok/s" in text.output and "decode" in text.output


def test_explain_of_a_non_plan_fails_cleanly(tmp_path):
    bad = tmp_path / "x.pt"
    bad.write_bytes(b"garbage")
    res = CliRunner().invoke(app, ["explain", str(bad)])
    assert res.exit_code == 1 and "error:" in res.output


def test_compile_takes_the_workload_shape_from_a_prompts_file(checkpoints, tmp_path):
    ckpt = checkpoints("mixtral", "per_expert")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": [1, 2, 3, 4], "max_tokens": 10},
        {"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 30},
        {"prompt": ""},  # invalid: ignored
    ]) + "\n")
    out = tmp_path / "plan.pt"
    res = CliRunner().invoke(app, ["compile", str(ckpt), "-o", str(out), "--prompts", str(prompts)])
    assert res.exit_code == 0, res.output
    from moecc_runtime.plan import load_plan

    wl = load_plan(out)["batch"]["workload"]
    assert (wl["prompt_tokens"], wl["output_tokens"]) == (6, 20)


def test_compare_timelines_sums_only_the_layers_a_cut_timeline_kept():
    """A deep model's stored timeline keeps a few layers: the measured jobs of the other
    layers are left out, the stem and head always count, and no idle row is made up."""
    from moecc.views.explain import compare_timelines

    pred = {"decode": {"step_s": 1.0, "layers": 3, "layers_kept": [0, 2],
                       "jobs": [["stem", "compute", "stem", None, 0, 0.01], ["L0.e", "compute", "gemm", 0, 0, 0.2],
                                ["L2.e", "compute", "gemm", 2, 0, 0.2], ["head", "compute", "head", None, 0, 0.05]]}}
    meas = {"decode": {"step_s": 1.5, "tokens": 8, "prefill_tokens": 0,
                       "jobs": [["stem", "compute", "stem", None, 0, 0.02], ["L0.e", "compute", "gemm", 0, 0, 0.3],
                                ["L1.e", "compute", "gemm", 1, 0, 0.3], ["L2.e", "compute", "gemm", 2, 0, 0.3],
                                ["L2.f", "copy", "fetch", 2, 0, 0.1], ["head", "compute", "head", None, 0, 0.06]]}}
    c = compare_timelines(pred, meas)["decode"]
    assert c["kinds"]["compute/gemm"] == {"predicted_s": pytest.approx(0.4), "measured_s": pytest.approx(0.6)}
    assert c["kinds"]["copy/fetch"] == {"predicted_s": 0.0, "measured_s": pytest.approx(0.1)}
    assert c["kinds"]["compute/head"]["measured_s"] == pytest.approx(0.06)
    assert "compute/idle" not in c["kinds"] and c["layers_compared"] == 2
    assert compare_timelines(pred, {}) == {}


def test_explain_names_the_path_streamed_weights_take(checkpoints):
    """A budgeted plan on a CUDA preset: explain says how its streamed weights reach the device,
    by the runtime's own rule (memory/weight_path.py); a CPU plan streams by host memcpy."""
    from moecc.views.explain import explain, format_explain

    kw = dict(gpu_mem=900_000, device_reserve=0, prompt_tokens=8, output_tokens=4, max_batch=8)
    cuda, _ = compile_model(checkpoints("mixtral"), hardware="h200", **kw)
    rep = explain(cuda)
    assert rep["weight_path"]["path"] == "registered-mmap" and rep["weight_path"]["streamed_bytes"] > 0
    assert "streamed weights" in format_explain(rep) and "by registered-mmap" in format_explain(rep)
    cpu, _ = compile_model(checkpoints("mixtral"), hardware="cpu", **kw)
    assert explain(cpu)["weight_path"]["path"] == "host-memcpy"
