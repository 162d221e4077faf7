"""Prompts from anywhere a shell can point (issue 32, item 1): `-` (stdin), /dev/stdin, a pipe
and a FIFO are read once, as a stream; --resume on a stream is refused up front, saying why,
and never hangs; progress without a known total shows counts and rates, not an ETA; the ETA
counts what the requests in flight have left (item 6)."""

from __future__ import annotations

import io
import json
import os
import sys
import threading
from pathlib import Path

import pytest

from tests.demo_jobs import demo_plan
from moecc_runtime.job.exec import run_job
from moecc_runtime.job.progress import Progress
from moecc_runtime.job.source import StreamInputError, prompt_source

N = 6
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def lines(n: int = N) -> bytes:
    return b"".join(json.dumps({"custom_id": f"p{i}", "prompt": f"A class {i}", "max_tokens": 2}).encode() + b"\n"
                    for i in range(n))


def ids(path: Path) -> list[str]:
    return sorted(json.loads(x)["custom_id"] for x in path.read_text().splitlines())


@pytest.fixture(scope="module")
def plan() -> Path:
    return demo_plan()


def _feed(path: Path, data: bytes) -> threading.Thread:
    """A writer thread: opens the FIFO (waits for its reader), writes, closes."""
    def write() -> None:
        with open(path, "wb") as f:
            f.write(data)

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


def test_a_fifo_is_read_once_as_a_stream(plan, tmp_path):
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    writer = _feed(fifo, lines())
    s = run_job(plan, fifo, tmp_path / "out.jsonl", log=None, device="cpu")
    writer.join(5)
    assert (s.requests, s.succeeded, s.failed, s.status) == (N, N, 0, "done")
    assert ids(tmp_path / "out.jsonl") == [f"p{i}" for i in range(N)]


def test_dash_reads_stdin_and_names_it_in_errors(plan, tmp_path, monkeypatch):
    data = lines(3) + b'{"custom_id": "bad", "prompt": ""}\n'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    s = run_job(plan, "-", tmp_path / "out.jsonl", errors_path=tmp_path / "err.jsonl", log=None, device="cpu")
    assert (s.requests, s.succeeded, s.failed) == (4, 3, 1)
    err = json.loads((tmp_path / "err.jsonl").read_text())
    assert (err["custom_id"], err["error"]["line"], err["error"]["field"]) == ("bad", 4, "prompt")
    assert prompt_source("-").name == "<stdin>" and prompt_source("-").stream


def test_resume_on_a_stream_is_refused_before_anything_opens(plan, tmp_path):
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)  # nobody writes it: opening it would hang; the refusal comes first
    out = tmp_path / "out.jsonl"
    with pytest.raises(StreamInputError) as e:
        run_job(plan, fifo, out, resume=True, log=None, device="cpu")
    assert str(e.value) == (
        f"--resume cannot read the prompts from {fifo}: it is a stream (stdin, a pipe or a FIFO), which can be "
        f"read only once, and resume must read the input once to check what the earlier run wrote and again to "
        f"run what is left; write the prompts to a file and pass its path")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.fifo"]


@pytest.mark.slow
def test_a_pipe_through_the_command_line_runs_every_request(plan, tmp_path):
    """`cat p.jsonl | moecc exec plan /dev/stdin`: /dev/stdin is /proc/self/fd/0, a pipe; here
    the pipe is another descriptor of this process, named the same way."""
    from typer.testing import CliRunner

    from moecc.cli import app

    r, w = os.pipe()
    writer = threading.Thread(target=lambda: (os.write(w, lines()), os.close(w)), daemon=True)
    writer.start()
    out = tmp_path / "out.jsonl"
    try:
        res = CliRunner().invoke(app, ["exec", str(plan), f"/proc/self/fd/{r}", "-o", str(out), "-q"])
    finally:
        os.close(r)
    writer.join(5)
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"moecc: {N} ok, 0 failed of {N} requests; ")
    assert ids(out) == [f"p{i}" for i in range(N)]


@pytest.mark.slow
def test_resume_on_stdin_is_one_error_line(plan, tmp_path):
    from typer.testing import CliRunner

    from moecc.cli import app

    out = tmp_path / "out.jsonl"
    res = CliRunner().invoke(app, ["exec", str(plan), "-", "-o", str(out), "--resume"], input=lines())
    err = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(err) == 1, res.output
    assert err[0].startswith("error: --resume cannot read the prompts from <stdin>: it is a stream")
    assert "rerun with --resume" not in err[0] and not out.exists()


def test_progress_without_a_total_shows_counts_and_rates():
    p = Progress(None, 16.0, 100.0, mode="quiet")
    p.expect(16)
    p.step(10, 1)
    p.request(True, 10, cap=16)
    assert p.eta() is None
    line = p.line()
    assert line.startswith("1 requests done (0 failed), ") and " req/s, 10 tokens, " in line
    assert "ETA" not in line and line.endswith("total unknown until the input ends")


def test_the_eta_counts_what_a_long_request_in_flight_has_left():
    p = Progress(2, 256.0, 100.0, mode="quiet")
    p.expect(1000)  # the long one
    p.expect(5)
    p.step(5, 2)
    p.request(True, 5, cap=5)  # the short one finished with all its 5 tokens
    p.step(300, 1)  # the long one is 300 tokens in
    assert p.tokens_left(1) == 700.0  # (1000 - 300) x the 100% of max_tokens finished requests used
    assert p.eta() is not None and p.eta() > 5.0  # the old figure: 1 left x 5 tokens -> 0:00:00
