"""`moecc exec` reads its prompts file as a stream: the first result is written before the
reader has reached the end of the file, bad lines in the middle still fail alone (their
error record, naming file, line and field, written as they are reached), the bookkeeping
holds only what is in flight, the summary counts are those of a run that read everything
first, and resume (after a drained run as after a lost tail) still ends with each request
once. Also the byte scan that gives the progress total."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from moecc.compiler import compile_model
from moecc_runtime.job import exec as X
from moecc_runtime.job import reader
from moecc_runtime.job.progress import Progress
from moecc_runtime.job.requests import iter_identified
from moecc_runtime.plan import save_plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = "the kettle clicked off and a pulley is a wheel on an axle that turns with rope".split()
N = 24
BAD = {8: "prompt", 15: "custom_id"}  # 1-based line -> the field its error names


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tiny(checkpoints, tmp_path_factory):
    """A tiny Mixtral's plan and a prompts file of N lines, two of them bad (line 8: a prompt
    that is a number; line 15: a repeated custom_id)."""
    root = tmp_path_factory.mktemp("streaming")
    plan, _ = compile_model(checkpoints("mixtral", "per_expert"))
    save_plan(plan, root / "plan.pt")
    rows = []
    for i in range(1, N + 1):
        if i == 8:
            rows.append(json.dumps({"custom_id": "bad-prompt", "prompt": 5}))
        elif i == 15:
            rows.append(json.dumps({"custom_id": "r001", "prompt": "again"}))
        else:
            rows.append(json.dumps({"custom_id": f"r{i:03d}", "prompt": " ".join(WORDS[i % 5:i % 5 + 2 + i % 4]),
                                    "max_tokens": 2}))
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return root / "plan.pt", prompts


class Watch:
    """Counts the input lines the job has read (iter_identified items) and what it saw when
    each request finished."""

    def __init__(self, monkeypatch, errors: Path | None = None):
        self.read = 0
        self.at_first_result: int | None = None
        self.errors_seen: dict[int, list[dict]] = {}  # lines read -> the errors file then
        self.most_held = 0
        self.errors = errors
        real_iter, real_finish = reader.iter_identified, X.Job.on_finish
        watch = self

        def counting(path, default_max_tokens):
            for item in real_iter(path, default_max_tokens):
                watch.read += 1
                if watch.errors is not None and watch.errors.is_file():
                    watch.errors_seen[watch.read] = read_jsonl(watch.errors)
                yield item

        def finishing(job, r):
            if watch.at_first_result is None:
                watch.at_first_result = watch.read
            watch.most_held = max(watch.most_held, len(job.reader.pending))
            real_finish(job, r)
            watch.job = job

        monkeypatch.setattr(reader, "iter_identified", counting)
        monkeypatch.setattr(X.Job, "on_finish", finishing)


def test_first_result_before_the_file_is_read_and_bad_lines_fail_alone(tiny, tmp_path, monkeypatch):
    plan, prompts = tiny
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    watch = Watch(monkeypatch, errors)
    s = X.run_job(plan, prompts, out, errors_path=errors, device="cpu", log=None, max_batch=2)
    assert watch.at_first_result is not None and watch.at_first_result < N // 2, watch.at_first_result
    assert watch.read == N
    # bookkeeping: only what is in flight (2) and the scheduler's one lookahead, never the file
    assert watch.most_held <= 4, watch.most_held
    assert watch.job.reader.pending == {}
    assert (s.requests, s.succeeded, s.failed, s.skipped, s.status) == (N, N - 2, 2, 0, "done")
    recs = read_jsonl(errors)
    assert [(r["error"]["line"], r["error"]["field"]) for r in recs] == sorted(BAD.items())
    assert "duplicate custom_id 'r001' (first seen on line 1)" in recs[1]["error"]["message"]
    # each error record was in the file as soon as its line was read, long before the end
    assert any(read <= 9 and [r["error"]["line"] for r in seen] == [8] for read, seen in watch.errors_seen.items())
    assert sorted(r["custom_id"] for r in read_jsonl(out)) == sorted(
        f"r{i:03d}" for i in range(1, N + 1) if i not in BAD)


def test_error_text_names_file_line_and_field(tiny, tmp_path):
    plan, prompts = tiny
    log = io.StringIO()
    X.run_job(plan, prompts, tmp_path / "out.jsonl", errors_path=tmp_path / "e.jsonl", device="cpu", log=log,
              max_batch=4, progress="plain")
    text = log.getvalue()
    assert f"error: {prompts}:8: field 'prompt': expected a string or a list of token ids, got int 5" in text
    assert f"error: {prompts}:15: field 'custom_id': duplicate custom_id 'r001'" in text


def test_drained_run_counts_every_line_and_resume_completes(tiny, tmp_path, monkeypatch):
    """A run drained after its first result (as a first Ctrl-C does) has not read most of the
    file, yet its summary counts every request line; resuming it (and resuming again after a
    lost tail) ends with the results of an uninterrupted run, each once."""
    plan, prompts = tiny
    ref = tmp_path / "ref.jsonl"
    X.run_job(plan, prompts, ref, errors_path=tmp_path / "ref.errors.jsonl", device="cpu", log=None, max_batch=2)
    want = {r["custom_id"]: r for r in read_jsonl(ref)}

    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    watch = Watch(monkeypatch)
    monkeypatch.setattr(X.Job, "control", lambda job, signals: "drain" if job.summary.succeeded else "run")
    s = X.run_job(plan, prompts, out, errors_path=errors, device="cpu", log=None, max_batch=2)
    assert s.status == "interrupted" and watch.read < N
    assert s.requests == N and s.skipped == 0 and 1 <= s.succeeded < N - 2 and s.unfinished > 0
    monkeypatch.undo()

    again = X.run_job(plan, prompts, out, errors_path=errors, device="cpu", log=None, max_batch=2, resume=True)
    assert again.status == "done" and again.requests == N
    assert again.skipped == s.succeeded + s.failed and again.succeeded + again.failed + again.skipped == N
    rows = read_jsonl(out)
    assert len(rows) == len({r["custom_id"] for r in rows}) == N - 2
    assert {r["custom_id"]: r["token_ids"] for r in rows} == {k: r["token_ids"] for k, r in want.items()}
    assert sorted(r["error"]["line"] for r in read_jsonl(errors)) == sorted(BAD)

    lines = out.read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text("".join(lines[:5]), encoding="utf-8")  # as if killed after five results
    third = X.run_job(plan, prompts, out, errors_path=errors, device="cpu", log=None, max_batch=2, resume=True)
    assert (third.requests, third.succeeded, third.failed, third.skipped) == (N, N - 2 - 5, 0, 5 + 2)
    assert sorted(r["custom_id"] for r in read_jsonl(out)) == sorted(want)


def test_drained_resumed_run_counts_the_skips_it_did_not_reach(tiny, tmp_path, monkeypatch):
    """An interrupted resumed run counts as skipped the done lines it never read (as a run
    that read everything first did), from what resume already read."""
    plan, prompts = tiny
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    X.run_job(plan, prompts, out, errors_path=errors, device="cpu", log=None, max_batch=2)
    rows = out.read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text("".join(rows[:3] + rows[10:]), encoding="utf-8")  # 7 results lost from the front
    monkeypatch.setattr(X.Job, "control", lambda job, signals: "drain" if job.summary.succeeded else "run")
    s = X.run_job(plan, prompts, out, errors_path=errors, device="cpu", log=None, max_batch=2, resume=True)
    assert s.status == "interrupted"
    assert s.requests == N and s.skipped == N - 7 and 1 <= s.succeeded < 7


def test_count_request_lines_matches_the_reader(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_bytes(b"\xef\xbb\xbf  \r\n" + b'{"prompt": "a"}\r\n' + b"\n \t\x0c\n" + b"not json\n" + b"\r\r\n"
                  + b'{"prompt": "b"}')  # a BOM-only line 1, blank lines of all sorts, no newline at the end
    assert reader.count_request_lines(p) == sum(1 for _ in iter_identified(p, 16)) == 3
    p.write_bytes(b"")
    assert reader.count_request_lines(p) == 0
    p.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n' * 3)
    assert reader.count_request_lines(p, chunk=4) == sum(1 for _ in iter_identified(p, 16)) == 3


def test_progress_expected_tokens_follow_the_running_mean():
    out = io.StringIO()
    p = Progress(4, 256, 100.0, mode="quiet", stream=out)
    assert p.eta() == pytest.approx(4 * 256 / 100.0)  # before any request is read: the default
    p.expect(10)
    p.expect(30)
    assert p.expected == 20 and p.eta() == pytest.approx(4 * 20 / 100.0)
    p.set_total(3)
    assert p.eta() == pytest.approx(3 * 20 / 100.0)
