"""A job owns its output (issue 20, items 3 and 4): a second run on the same output file is
refused naming the holder while the first finishes with every result exactly once, and the
prompts file can never be the output."""

from __future__ import annotations

import json
from pathlib import Path

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
