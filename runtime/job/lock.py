"""A job owns its output: an exclusive lock on the results file for the run's life, so two
runs on one output file cannot interleave, duplicate or tear its lines.

The lock is `flock` on the output file itself (released by the OS when the process dies, so
a kill -9 never leaves a stale lock); who holds it is written beside it, `<output>.lock`, so
a refused second run can name the holder.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO


class JobLockError(RuntimeError):
    """Another run holds the output file, or the job's files collide."""


def check_distinct(prompts: Path, output: Path, errors: Path | None) -> None:
    """Refuse a job whose input, output and errors files are one file."""
    named = [("prompts", prompts), ("output", output)] + ([("errors", errors)] if errors is not None else [])
    for i, (a, pa) in enumerate(named):
        for b, pb in named[i + 1:]:
            if _same(pa, pb):
                raise JobLockError(f"the {a} file and the {b} file are the same file ({pa}); "
                                   f"write results to another path")


def _same(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def open_locked(output: Path, resume: bool) -> IO[str]:
    """The output file opened for appending and locked for this run (emptied first unless
    `resume`); JobLockError naming the holder when another run has it."""
    f = open(output, "a", encoding="utf-8")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise JobLockError(f"{output} is being written by another moecc exec ({_holder(output)}); "
                           f"wait for it to finish, or write to another file") from None
    if not resume:
        f.truncate(0)
    _holder_path(output).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    return f


def release(output: Path, f: IO[str]) -> None:
    """Drop the holder note and the lock (closing the file releases it too)."""
    try:
        _holder_path(output).unlink(missing_ok=True)
    finally:
        f.close()


def _holder_path(output: Path) -> Path:
    return output.with_name(output.name + ".lock")


def _holder(output: Path) -> str:
    try:
        h = json.loads(_holder_path(output).read_text())
        return f"pid {h['pid']} on {h['host']}, since {h['since']}"
    except (OSError, ValueError, KeyError):
        return "holder unknown"
