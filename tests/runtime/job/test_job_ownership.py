"""A job owns its output (issue 20, items 3, 4 and 12): a second run on the same output file is
refused naming the holder while the first finishes with every result exactly once (also
after a resume replaced the file), the errors file has a lock of its own, a lock left by a
killed run is taken over, and the prompts file can never be the output.

No test here depends on timing: a first run that must still hold its output runs in this
process and is held inside its next result line until the second run has been refused."""

from __future__ import annotations

import io
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from moecc.compiler import compile_model
from moecc.testing.checkpoints import write_checkpoint
from moecc_runtime.job.results import ResultWriter
from moecc_runtime.plan import save_plan
from tests.runtime.job.test_jobs import WORDS, assert_complete, cli, read_jsonl

HANG_GUARD_S = 600  # only a hung run waits this long; no outcome depends on it


pytestmark = pytest.mark.slow  # the whole file


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, Path, Path, dict[str, dict]]:
    """test_jobs' job made smaller (no run here needs to be long: the first is held): a tiny
    Mixtral, its plan, a 24-request prompts file (greedy, 12 tokens each) and its results."""
    from moecc_runtime.job.exec import run_job

    root = tmp_path_factory.mktemp("ownership")
    ckpt = write_checkpoint(root / "mixtral", "mixtral", seed=3)
    plan, _ = compile_model(ckpt)
    save_plan(plan, root / "plan.pt")
    rows = [{"custom_id": f"r{i:03d}", "prompt": " ".join(WORDS[i % 7:i % 7 + 3 + i % 9]), "max_tokens": 12}
            for i in range(24)]
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    ref = root / "ref.jsonl"
    run_job(root / "plan.pt", prompts, ref, device="cpu", log=None, max_batch=4)
    return root, root / "plan.pt", prompts, {r["custom_id"]: r for r in read_jsonl(ref)}


class HeldRun:
    """A run_job in a thread of this process (the lock names os.getpid()); `summary` once it ended."""

    def __init__(self) -> None:
        self.written, self.go = threading.Event(), threading.Event()
        self.summary: Any = None
        self.error: BaseException | None = None


@contextmanager
def held_after(monkeypatch: pytest.MonkeyPatch, lines: int, **run_kw: Any) -> Iterator[HeldRun]:
    """needs: run_job's keyword arguments. does: starts it in a thread and, once it has written
    `lines` result lines, holds it inside the next one until the block exits. guarantees: in
    the block the run holds its output's lock and has written exactly `lines` results; after
    it, the run has ended (its error re-raised)."""
    from moecc_runtime.job.exec import run_job

    run, real, calls = HeldRun(), ResultWriter.result, [0]

    def result(self: ResultWriter, *a: Any, **kw: Any) -> None:
        calls[0] += 1
        if calls[0] == lines + 1:
            run.written.set()
            run.go.wait()
        real(self, *a, **kw)

    def main() -> None:
        try:
            run.summary = run_job(**run_kw)
        except BaseException as e:  # noqa: BLE001  (re-raised in the test's thread)
            run.error = e
        finally:
            run.written.set()

    monkeypatch.setattr(ResultWriter, "result", result)
    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    try:
        assert run.written.wait(HANG_GUARD_S), "the first run wrote no results"
        if run.error is not None:
            raise run.error
        assert run.summary is None, f"the first run ended before its result line {lines + 1}"
        yield run
    finally:
        run.go.set()
        thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "the first run did not end"
    if run.error is not None:
        raise run.error


def test_second_run_on_one_output_is_refused(job, tmp_path, monkeypatch):
    _, plan, prompts, ref = job
    out = tmp_path / "out.jsonl"
    with held_after(monkeypatch, 2, plan_path=plan, prompts_path=prompts, output=out, device="cpu",
                    max_batch=4, log=None) as first:
        assert out.read_bytes().count(b"\n") == 2
        second = cli("exec", plan, prompts, "-o", out, "--device", "cpu", "--max-batch", "4", "--quiet", "--resume")
        _, err = second.communicate(timeout=HANG_GUARD_S)
        assert second.returncode == 1
        assert "being written by another moecc exec" in err and f"pid {os.getpid()}" in err
    assert first.summary.status == "done" and first.summary.failed == 0
    assert_complete(out, ref)
    assert not (tmp_path / "out.jsonl.lock").exists()


def test_prompts_file_as_output_is_refused(job, tmp_path):
    _, plan, prompts, _ = job
    copy = tmp_path / "prompts.jsonl"
    copy.write_bytes(prompts.read_bytes())
    before = copy.read_bytes()
    for flag in ("--overwrite", "--resume"):
        proc = cli("exec", plan, copy, "-o", copy, "--device", "cpu", "--quiet", flag)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1 and "the prompts file and the output file are the same file" in err, err
        assert copy.read_bytes() == before
    errors = tmp_path / "e.jsonl"
    proc = cli("exec", plan, copy, "-o", tmp_path / "o.jsonl", "--errors", copy, "--quiet")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "the prompts file and the errors file are the same file" in err
    assert copy.read_bytes() == before and not errors.exists()
    assert read_jsonl(copy)[0]["custom_id"] == json.loads(before.splitlines()[0])["custom_id"]


def test_missing_prompts_file_creates_no_output(job, tmp_path):
    _, plan, _, _ = job
    out = tmp_path / "out.jsonl"
    proc = cli("exec", plan, tmp_path / "nope.jsonl", "-o", out, "--quiet")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "nope.jsonl" in err
    assert not out.exists() and not (tmp_path / "out.errors.jsonl").exists()


def test_a_resume_that_replaced_its_output_still_holds_it(job, tmp_path, monkeypatch):
    _, plan, prompts, ref = job
    out = tmp_path / "out.jsonl"
    done = sorted(ref)[:10]
    lines = [json.dumps(ref[k]) + "\n" for k in done]
    out.write_text("".join(lines[:5]) + "not json\n" + "".join(lines[5:]))  # a corrupt middle line: replaced
    log = io.StringIO()
    with held_after(monkeypatch, 2, plan_path=plan, prompts_path=prompts, output=out, device="cpu",
                    max_batch=4, resume=True, log=log) as first:
        assert out.read_bytes().count(b"\n") == len(done) + 2  # writing into the file that replaced the old one
        second = cli("exec", plan, prompts, "-o", out, "--device", "cpu", "--quiet", "--resume")
        _, err = second.communicate(timeout=HANG_GUARD_S)
        assert second.returncode == 1 and "being written by another moecc exec" in err and f"pid {os.getpid()}" in err
    assert first.summary.status == "done" and first.summary.failed == 0, log.getvalue()
    assert f"{out}:6: corrupt line (not valid JSON)" in log.getvalue()
    assert_complete(out, ref)
    assert (tmp_path / "out.jsonl.replaced.jsonl").read_text() == "not json\n"
    assert not (tmp_path / "out.jsonl.lock").exists()


def test_the_errors_file_has_its_own_lock(job, tmp_path):
    from moecc_runtime.job.exec import run_job
    from moecc_runtime.job.lock import JobLockError, acquire, release

    _, plan, prompts, _ = job
    errors = tmp_path / "shared.errors.jsonl"
    held = acquire(errors, "errors")  # as another job, with another output, writing the same errors file
    try:
        with pytest.raises(JobLockError, match=f"^{errors} is being written by another moecc exec "
                                               f"\\(pid {os.getpid()} on "):
            run_job(plan, prompts, tmp_path / "mine.jsonl", errors_path=errors, device="cpu", log=None)
        assert not (tmp_path / "mine.jsonl").exists() and not (tmp_path / "mine.jsonl.lock").exists()
    finally:
        release(held)
    assert not (tmp_path / "shared.errors.jsonl.lock").exists()


def test_a_lock_left_by_a_killed_run_is_taken_over(job, tmp_path):
    from moecc_runtime.job.exec import run_job

    _, plan, prompts, ref = job
    out = tmp_path / "out.jsonl"
    small = tmp_path / "small.jsonl"
    small.write_text("".join(prompts.read_text().splitlines(keepends=True)[:3]))
    (tmp_path / "out.jsonl.lock").write_text('{"pid": 999999999, "host": "gone", "since": "then"}\n')  # kill -9
    s = run_job(plan, small, out, device="cpu", log=None)
    assert s.succeeded == 3 and not (tmp_path / "out.jsonl.lock").exists()
    assert sorted(r["custom_id"] for r in read_jsonl(out)) == sorted(ref)[:3]
