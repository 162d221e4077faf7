"""The worker process of `moecc serve`: prepares the plans and runs batch parts through
`moecc exec`'s runtime, so the server's own process never imports torch or the compiler.

Needs: to be started by the runner (`python -m moecc.serve.worker --parent PID`), one
request a line on stdin: {"op": "prepare", "name", "path", "data_dir", "budgets"} (the
model's plan from the cache, compiled first if missing: plans.prepare) or {"op": "run",
"plan", "prompts", "output", "errors", "max_tokens", "device"}. Does: a run is
`run_job(..., fmt="openai", resume=True)` (the resume machinery: a part killed at any point
continues where its files stop, each request once). Answers one line on stdout per
request: {"ok": true, ...} or {"ok": false, "error", "kind"}. SIGTERM during a run stops it
after the current step (run_job's own handling), with every finished result on disk;
between runs SIGTERM is ignored. Guarantees: it dies with its parent (PR_SET_PDEATHSIG,
and a check of the parent's pid), so a killed server leaves no job running that would
hold the files' locks.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit now if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the runner's stdin closing still ends this process between jobs
    if os.getppid() != parent:
        os._exit(1)


def prepare_one(req: dict[str, Any]) -> dict[str, Any]:
    """A model's plan (plans.prepare), with what the status page shows of it."""
    from pathlib import Path

    from moecc.serve.config import ModelSpec, ServeConfig
    from moecc.serve.plans import prepare

    cfg = ServeConfig([], Path(req["data_dir"]), **req["budgets"])
    try:
        m = prepare(ModelSpec(req["name"], Path(req["path"])), cfg, cfg.data_dir / "plans",
                    lambda line: print(line, file=sys.stderr, flush=True))
    except Exception as e:
        return {"ok": False, "error": str(e), "kind": type(e).__name__}
    return {"ok": True, "plan_path": str(m.plan_path), "fingerprint": m.fingerprint, "explain": m.explain,
            "timeline_svg": m.timeline_svg}


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """One part through the runtime; the answer line."""
    from moecc_runtime.job.exec import run_job

    if job.get("op") == "prepare":
        return prepare_one(job)
    try:
        s = run_job(job["plan"], job["prompts"], job["output"], errors_path=job["errors"],
                    max_tokens=int(job["max_tokens"]), device=job.get("device") or "auto", log=None,
                    fmt="openai", resume=True, progress="quiet", handle_signals=True)
    except Exception as e:  # a plan, checkpoint or file problem: the batch fails, naming it
        return {"ok": False, "error": str(e), "kind": type(e).__name__}
    return {"ok": True, "status": s.status, "succeeded": s.succeeded, "failed": s.failed, "skipped": s.skipped,
            "seconds": s.seconds, "completion_tokens": s.completion_tokens}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    die_with_parent(args.parent)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import moecc_runtime.job.exec  # noqa: F401  (imported before the first job: its start is then quick)

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # between jobs a stop has nothing to stop; run_job's own
    # handler replaces this during a job, and the loop ends when the runner closes stdin
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        answer = run_one(json.loads(line))
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
