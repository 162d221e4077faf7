"""A job owns its output (issue 20, items 3, 4 and 12): a second run on the same output file is
refused naming the holder while the first finishes with every result exactly once (also
after a resume replaced the file), the errors file has a lock of its own, a lock left by a
killed run is taken over, and the prompts file can never be the output."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.test_jobs import assert_complete, cli, job, read_jsonl, wait_for_lines  # noqa: F401  (fixture)


def test_second_run_on_one_output_is_refused(job, tmp_path):
    _, plan, prompts, ref = job
    out = tmp_path / "out.jsonl"
    first = cli("exec", plan, prompts, "-o", out, "--device", "cpu", "--max-batch", "4", "--quiet")
    wait_for_lines(out, 2, first)
    second = cli("exec", plan, prompts, "-o", out, "--device", "cpu", "--max-batch", "4", "--quiet", "--resume")
    _, err = second.communicate(timeout=120)
    assert second.returncode == 1
    assert "being written by another moecc exec" in err and f"pid {first.pid}" in err
    first.communicate(timeout=300)
    assert first.returncode == 0
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


def test_a_resume_that_replaced_its_output_still_holds_it(job, tmp_path):
    _, plan, prompts, ref = job
    out = tmp_path / "out.jsonl"
    done = sorted(ref)[:10]
    lines = [json.dumps(ref[k]) + "\n" for k in done]
    out.write_text("".join(lines[:5]) + "not json\n" + "".join(lines[5:]))  # a corrupt middle line: replaced
    first = cli("exec", plan, prompts, "-o", out, "--device", "cpu", "--max-batch", "4", "--resume")
    wait_for_lines(out, len(done) + 2, first)  # writing into the file that replaced the old one
    second = cli("exec", plan, prompts, "-o", out, "--device", "cpu", "--quiet", "--resume")
    _, err = second.communicate(timeout=120)
    assert second.returncode == 1 and "being written by another moecc exec" in err and f"pid {first.pid}" in err
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert f"{out}:6: corrupt line (not valid JSON)" in err
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
