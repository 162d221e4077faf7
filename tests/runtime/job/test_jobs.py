"""Batch jobs people can trust (`moecc exec`): OpenAI Batch API lines in and out, stop
strings, bad input that fails alone with its line and field, resume after SIGKILL (a
real subprocess killed mid-run, and a torn last line repaired), Ctrl-C that stops admitting
work and exits resumable, existing results never clobbered, and plans that cannot run code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moecc.compiler import compile_model
from moecc.testing.checkpoints import write_checkpoint
from moecc_runtime.job.exec import run_job
from moecc_runtime.job.results import repair_torn_tail
from moecc_runtime.plan import PlanError, load_plan, save_plan

WORDS = "the kettle clicked off and a pulley is a wheel on an axle that turns with rope".split()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def cli(*args: object, **kw) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.Popen([sys.executable, "-m", "moecc.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A tiny Mixtral, its plan, and a 120-request prompts file (greedy, 12 tokens each)."""
    root = tmp_path_factory.mktemp("jobs")
    ckpt = write_checkpoint(root / "mixtral", "mixtral", seed=3)
    plan, _ = compile_model(ckpt)
    save_plan(plan, root / "plan.pt")
    rows = [{"custom_id": f"r{i:03d}", "prompt": " ".join(WORDS[i % 7:i % 7 + 3 + i % 9]), "max_tokens": 12}
            for i in range(120)]
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    ref = root / "ref.jsonl"
    run_job(root / "plan.pt", prompts, ref, device="cpu", log=None, max_batch=4)
    return root, root / "plan.pt", prompts, {r["custom_id"]: r for r in read_jsonl(ref)}


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if path.is_file() and path.read_bytes().count(b"\n") >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited early ({proc.returncode}): {proc.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError(f"no {n} result lines in {timeout}s")


def assert_complete(out: Path, ref: dict[str, dict]) -> None:
    rows = read_jsonl(out)
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a request was written twice"
    assert set(ids) == set(ref), f"missing {sorted(set(ref) - set(ids))[:5]}"
    for r in rows:
        assert (r["token_ids"], r["text"], r["finish_reason"]) == (
            ref[r["custom_id"]]["token_ids"], ref[r["custom_id"]]["text"], ref[r["custom_id"]]["finish_reason"])


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_gives_every_request_once(job, tmp_path):
    root, plan, prompts, ref = job
    out = tmp_path / "out.jsonl"
    proc = cli("exec", plan, prompts, "-o", out, "--device", "cpu", "--max-batch", "4", "--quiet")
    wait_for_lines(out, 10, proc)
    proc.kill()  # SIGKILL: no handler runs
    proc.wait(timeout=30)
    first = out.read_bytes().count(b"\n")
    assert 10 <= first < len(ref), f"the kill came too late to test anything ({first} lines)"
    with open(out, "ab") as f:  # as if killed in the middle of writing a line
        f.write(b'{"custom_id": "r119", "text": "torn')
    res = cli("exec", plan, prompts, "-o", out, "--device", "cpu", "--max-batch", "4", "--resume", "--quiet")
    _, err = res.communicate(timeout=300)
    assert res.returncode == 0, err
    assert "cut a torn last line" not in err  # --quiet
    assert f"{first} already done" in err or "already done" in err
    assert_complete(out, ref)


@pytest.mark.slow
def test_sigint_stops_admitting_and_exits_resumable(job, tmp_path):
    root, plan, prompts, ref = job
    out = tmp_path / "out.jsonl"
    proc = cli("exec", plan, prompts, "-o", out, "--device", "cpu", "--max-batch", "4")
    wait_for_lines(out, 6, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "admitting no more requests" in err and "--resume" in err and "Traceback" not in err
    done = read_jsonl(out)  # every line whole
    assert 6 <= len(done) < len(ref)
    res = cli("exec", plan, prompts, "-o", out, "--device", "cpu", "--max-batch", "4", "--resume", "-q")
    _, err = res.communicate(timeout=300)
    assert res.returncode == 0, err
    assert_complete(out, ref)


@pytest.mark.slow
def test_sigterm_stops_after_the_step(job, tmp_path):
    root, plan, prompts, ref = job
    out = tmp_path / "out.jsonl"
    proc = cli("exec", plan, prompts, "-o", out, "--device", "cpu", "--max-batch", "4")
    wait_for_lines(out, 4, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted; rerun with --resume" in err
    rows = read_jsonl(out)
    assert len({r["custom_id"] for r in rows}) == len(rows) < len(ref)


@pytest.mark.slow
def test_existing_results_are_not_clobbered(job, tmp_path):
    _, plan, prompts, _ = job
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "x"}\n')
    proc = cli("exec", plan, prompts, "-o", out, "--device", "cpu")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "already holds results" in err and "--resume" in err
    assert out.read_text() == '{"custom_id": "x"}\n'


def test_repair_torn_tail(tmp_path):
    p = tmp_path / "f.jsonl"
    p.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c"')
    assert repair_torn_tail(p) and p.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    assert not repair_torn_tail(p)
    p.write_bytes(b"no newline at all")
    assert repair_torn_tail(p) and p.read_bytes() == b""


BATCH = [
    {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "tiny", "messages": [{"role": "user", "content": "a pulley is"}], "max_completion_tokens": 6}},
    {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
     "body": {"model": "tiny", "prompt": "the kettle clicked", "max_tokens": 5, "temperature": 0}},
    {"custom_id": "simple-1", "prompt": "on an axle", "max_tokens": 4},
    {"custom_id": "bad-n", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 0}},
    {"custom_id": "bad-param", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "x"}], "tools": []}},
]


@pytest.mark.slow
def test_openai_batch_round_trip_field_by_field(job, tmp_path):
    root, plan, _, _ = job
    prompts = tmp_path / "batch.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in BATCH), encoding="utf-8")
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    plain = tmp_path / "plain.jsonl"
    summary = run_job(plan, prompts, out, errors_path=errors, device="cpu", log=None, fmt="openai")
    assert (summary.succeeded, summary.failed) == (3, 2)
    run_job(plan, prompts, plain, errors_path=tmp_path / "e2.jsonl", device="cpu", log=None)
    plain_rows = {r["custom_id"]: r for r in read_jsonl(plain)}
    rows = {r["custom_id"]: r for r in read_jsonl(out)}
    assert set(rows) == {"chat-1", "cmpl-1", "simple-1"}
    for cid, r in rows.items():
        assert set(r) == {"id", "custom_id", "response", "error", "moecc"} and r["error"] is None
        assert set(r["moecc"]) == {"plan", "request"}  # the job's identity (resume checks it)
        assert r["id"].startswith("batch_req_")
        resp = r["response"]
        assert resp["status_code"] == 200 and resp["request_id"]
        body = resp["body"]
        want = plain_rows[cid]
        assert body["usage"] == {"prompt_tokens": want["usage"]["prompt_tokens"],
                                 "completion_tokens": want["usage"]["completion_tokens"],
                                 "total_tokens": want["usage"]["prompt_tokens"] + want["usage"]["completion_tokens"]}
        (choice,) = body["choices"]
        assert choice["index"] == 0 and choice["finish_reason"] == want["finish_reason"]
        assert choice["logprobs"] is None
        if cid == "cmpl-1":
            assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
            assert choice["text"] == want["text"] and body["model"] == "tiny"
        else:
            assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
            assert choice["message"] == {"role": "assistant", "content": want["text"]}
            assert body["model"] == ("tiny" if cid == "chat-1" else "mixtral")
        assert isinstance(body["created"], int)
    assert rows["chat-1"]["response"]["body"]["usage"]["completion_tokens"] <= 6
    errs = {r["custom_id"]: r for r in read_jsonl(errors)}
    assert set(errs) == {"bad-n", "bad-param"}
    for cid, line, param in (("bad-n", 4, "body.n"), ("bad-param", 5, "body.tools")):
        e = errs[cid]
        assert e["error"] is None and e["response"]["status_code"] == 400
        err = e["response"]["body"]["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and err["line"] == line
        assert err["message"]


@pytest.mark.slow
def test_stop_strings_end_generation_and_are_cut_from_the_text(job, tmp_path):
    root, plan, prompts, ref = job
    r = ref["r005"]
    text = r["text"]
    assert len(r["token_ids"]) == 12 and len(text) > 6, text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    first = text.find(stop)
    p = tmp_path / "stop.jsonl"
    line = json.loads(prompts.read_text().splitlines()[5])
    p.write_text(json.dumps({**line, "stop": [stop, "\u0394never"]}) + "\n")
    out = tmp_path / "out.jsonl"
    run_job(plan, p, out, device="cpu", log=None)
    (got,) = read_jsonl(out)
    assert got["finish_reason"] == "stop" and got["text"] == text[:first]
    assert len(got["token_ids"]) < 12 and got["token_ids"] == r["token_ids"][:len(got["token_ids"])]


@pytest.mark.slow
def test_every_kind_of_bad_line_fails_alone_with_line_and_field(job, tmp_path):
    root, plan, _, _ = job
    long_prompt = " ".join(WORDS * 60)  # longer than the tiny model's 512-token context
    lines = [
        json.dumps({"custom_id": "ok-1", "prompt": "a wheel", "max_tokens": 3}).encode(),
        b'{"custom_id": "broken", "prompt": "x"',  # malformed JSON
        json.dumps({"custom_id": "no-prompt", "max_tokens": 3}).encode(),  # missing field
        json.dumps({"custom_id": "typed", "prompt": "x", "max_tokens": "3"}).encode(),  # wrong type
        json.dumps({"custom_id": "unknown", "prompt": "x", "best_of": 2}).encode(),  # unknown parameter
        json.dumps({"custom_id": "empty", "prompt": ""}).encode(),  # empty prompt
        json.dumps({"custom_id": "long", "prompt": long_prompt}).encode(),  # longer than the context
        json.dumps({"custom_id": "ok-1", "prompt": "again"}).encode(),  # duplicate custom_id
        b'{"custom_id": "utf", "prompt": "\xff\xfe"}',  # invalid UTF-8
        json.dumps({"custom_id": "ok-2", "prompt": "the rope", "max_tokens": 3}).encode(),
    ]
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    proc = cli("exec", plan, p, "-o", out, "--errors", errors, "--device", "cpu")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    assert "2 ok, 8 failed of 10 requests" in err
    assert {r["custom_id"] for r in read_jsonl(out)} == {"ok-1", "ok-2"}
    got = {(e["error"]["line"], e["error"]["field"]) for e in read_jsonl(errors)}
    assert got == {(2, None), (3, None), (4, "max_tokens"), (5, "best_of"), (6, "prompt"),
                   (7, "prompt"), (8, "custom_id"), (9, None)}
    for e in read_jsonl(errors):
        assert e["error"]["message"]
    assert f"{p}:7:" in err and "context" in err and f"{p}:9:" in err and "UTF-8" in err


@pytest.mark.slow
def test_a_plan_that_would_run_code_is_refused(job, tmp_path):
    root, _, prompts, _ = job
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pt"
    torch.save({"schema": "moecc.plan", "version": 2, "payload": Evil()}, str(evil))
    with pytest.raises(PlanError, match="refused to load.*could run code"):
        load_plan(evil)
    proc = cli("exec", evil, prompts, "-o", tmp_path / "o.jsonl", "--device", "cpu")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "refused to load" in err and "Traceback" not in err
    assert not marker.exists(), "loading the plan ran its code"


@pytest.mark.slow
def test_plan_from_another_version_or_checkpoint_is_refused(job, tmp_path):
    root, plan_path, _, _ = job
    plan = load_plan(plan_path)
    old = tmp_path / "old.pt"
    save_plan({**plan, "version": 1}, old)
    with pytest.raises(PlanError, match="version 1.*recompile"):
        load_plan(old)
    from moecc_runtime.plan import check_checkpoint

    other = write_checkpoint(tmp_path / "other", "mixtral", seed=4, hidden_size=32, intermediate_size=48)
    with pytest.raises(PlanError, match="another checkpoint.*recompile"):
        check_checkpoint(plan, other)


def test_progress_eta_starts_from_the_prediction_and_follows_measurement(monkeypatch):
    import io

    from moecc_runtime.job import progress as P

    now = [100.0]
    monkeypatch.setattr(P.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    p = P.Progress(10, expected_tokens=50, predicted_rate=100.0, mode="plain", stream=out, interval=5.0)
    assert p.eta() == pytest.approx(10 * 50 / 100.0)  # nothing measured yet: the plan's figure
    now[0] += 10.0
    p.step(200, 4)  # measured 20 tok/s after 10 s
    assert p.rate() == pytest.approx((100 * P.PRIOR_S + 20 * 10) / (P.PRIOR_S + 10))
    p.request(True, 40)
    now[0] += 990.0
    p.step(19800, 4)  # 20 tok/s for 1000 s: measurement dominates
    assert p.rate() == pytest.approx((100 * P.PRIOR_S + 20 * 1000) / (P.PRIOR_S + 1000))
    assert p.rate() < 23
    assert p.eta() == pytest.approx(9 * 40 / p.rate())  # remaining requests x tokens per finished one
    now[0] += 5.0  # a plain line at most every `interval` seconds
    p.request(False)
    assert "2/10 requests (1 failed)" in out.getvalue().splitlines()[-1]
    q = P.Progress(3, 10, None, mode="quiet", stream=out)
    q.step(5, 1)
    assert out.getvalue().count("\n") == len(out.getvalue().splitlines())


@pytest.mark.slow
def test_resume_skips_failures_already_recorded_and_never_duplicates_them(job, tmp_path):
    """Bad lines (one a duplicate custom_id of a valid request) fail once; resuming a job
    whose output lost its results re-runs only those requests, errors are not repeated."""
    _, plan, _, _ = job
    rows = [json.dumps({"custom_id": "a", "prompt": "a wheel", "max_tokens": 3}), '{"custom_id": "b", ',
            json.dumps({"custom_id": "a", "prompt": "again"}),
            json.dumps({"custom_id": "c", "prompt": "the rope", "max_tokens": 3})]
    p = tmp_path / "in.jsonl"
    p.write_text("\n".join(rows) + "\n")
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    first = run_job(plan, p, out, errors_path=errors, device="cpu", log=None, fmt="openai")
    assert (first.succeeded, first.failed) == (2, 2)
    full, errs = out.read_text(), errors.read_text()
    again = run_job(plan, p, out, errors_path=errors, device="cpu", log=None, fmt="openai", resume=True)
    assert (again.succeeded, again.failed, again.skipped) == (0, 0, 4)
    assert out.read_text() == full and errors.read_text() == errs
    out.write_text(full.splitlines(keepends=True)[0])  # as if killed after the first result
    lost = {json.loads(line)["custom_id"] for line in full.splitlines()[1:]}
    third = run_job(plan, p, out, errors_path=errors, device="cpu", log=None, fmt="openai", resume=True)
    assert (third.succeeded, third.skipped) == (1, 3) and errors.read_text() == errs
    assert sorted(json.loads(line)["custom_id"] for line in out.read_text().splitlines()) == ["a", "c"]
    assert lost <= {"a", "c"}
