"""Sampling is numerically safe for every temperature the parser accepts, and a row that
cannot be sampled fails that request alone (issue 20, item 2)."""

from __future__ import annotations

import json

import torch

from moecc.compiler import compile_model
from moecc_runtime.job.exec import run_job
from moecc_runtime.plan import save_plan
from moecc_runtime.sampling import SamplingError, SamplingParams, choose, next_token, request_generator


def P(temperature: float) -> SamplingParams:
    return SamplingParams(temperature=temperature)


def test_tiny_temperature_samples_the_argmax():
    logits = torch.randn(50) * 30
    for t in (1e-40, 1e-300, 5e-324):
        assert next_token(logits, t, 1.0, 0, request_generator(1, "a")) == int(logits.argmax())
        assert next_token(logits, t, 0.5, 5, request_generator(1, "a")) == int(logits.argmax())


def test_huge_logits_and_temperatures_sample():
    logits = torch.tensor([3e38, -3e38, 1e38, 0.0])
    for t in (1e-30, 1.0, 1e30):
        tok = next_token(logits, t, 0.9, 0, request_generator(3, "b"))
        assert 0 <= tok < 4


def test_a_non_finite_row_fails_alone():
    logits = torch.randn(3, 10)
    logits[1, 4] = float("nan")
    out = choose(logits, [P(0.0), P(0.7), P(0.7)], [None, request_generator(1, "x"), request_generator(2, "y")])
    assert isinstance(out[1], SamplingError) and isinstance(out[0], int) and isinstance(out[2], int)


def test_a_job_with_a_tiny_temperature_finishes(checkpoints, tmp_path):
    plan, _ = compile_model(checkpoints("mixtral"), prompt_tokens=8, output_tokens=4, max_batch=4)
    save_plan(plan, tmp_path / "plan.pt")
    lines = [{"custom_id": "tiny", "prompt": "The kettle", "max_tokens": 4, "temperature": 1e-40, "seed": 3},
             {"custom_id": "greedy", "prompt": "The kettle", "max_tokens": 4}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = run_job(tmp_path / "plan.pt", tmp_path / "in.jsonl", tmp_path / "out.jsonl", log=None)
    assert (summary.succeeded, summary.failed) == (2, 0)
    got = {r["custom_id"]: r["token_ids"] for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert got["tiny"] == got["greedy"]


def test_a_huge_line_fails_fast_and_small_before_tokenizing(checkpoints, tmp_path):
    """A 20 MB prompt fails alone from its length (issue 20, item 10): the tokenizer never
    sees it, and the other request runs."""
    import resource
    import time

    plan, _ = compile_model(checkpoints("mixtral"), prompt_tokens=8, output_tokens=4, max_batch=4)
    save_plan(plan, tmp_path / "plan.pt")
    lines = [{"custom_id": "huge", "prompt": "kettle " * 3_000_000, "max_tokens": 4},
             {"custom_id": "ok", "prompt": "The kettle", "max_tokens": 4}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    summary = run_job(tmp_path / "plan.pt", tmp_path / "in.jsonl", tmp_path / "out.jsonl", log=None)
    assert time.perf_counter() - t0 < 30
    assert (summary.succeeded, summary.failed) == (1, 1)
    err = summary.errors[0]
    assert err["custom_id"] == "huge" and "judged from its length" in err["error"]["message"]
    assert err["error"]["line"] == 1 and err["error"]["field"] == "prompt"
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert grown_mib < 1024, f"peak RSS grew by {grown_mib:.0f} MiB"
