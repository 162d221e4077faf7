"""`moecc serve` under load (issue 34): 16 concurrent clients uploading and polling while a
batch runs, on this machine's loopback only; and the same file through `moecc exec`.

    python bench/serve_load.py                       # 16 clients, 384 requests, at most 240 s
    python bench/serve_load.py --clients 4 --requests 64 --max-seconds 60   # a quick run

What it does, in one run:
  1. writes a Batch API file of --requests chat lines for the demo model (examples/demo-model),
     each of a fixed length (max_tokens = min_tokens, 8..63 tokens: no early EOS);
  2. `moecc exec` on that file (--format openai, the plan `moecc serve` compiled and cached,
     the same torch threads as the server's worker): its job time (model load to the last
     result, from --stats) and generated tokens/s;
  3. starts `moecc serve` on a free 127.0.0.1 port, runs a warm-up batch of 8 lines, uploads
     the file, creates the batch (its time: create to completed, as a client sees it),
     first alone, then again while --clients threads each loop (bounded by --max-seconds
     and the batch's end; --interval seconds between turns): retrieve the batch (timed: the
     status latency), every 5th turn upload a small file (timed), every 10th list batches;
  4. checks that no request was lost: every HTTP request answered 2xx, every uploaded file
     listed with its exact bytes, and the batch's output holds each request once;
  5. prints and writes JSON to bench/results/<date>-serve-load.json (or --json): status
     latency p50/p99/max, uploads, errors, the batch's throughput against exec's.
Absolute figures on a shared 2-core VM drift; the ratio in one run is what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import openai

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "demo-model"
sys.path.insert(0, str(ROOT))

from moecc.serve.testing import ServerProcess, cached_plans, data_dir_with_plans  # noqa: E402


def write_batch(path: Path, n: int) -> Path:
    """n chat lines of fixed lengths 8..63 tokens."""
    lines = []
    for i in range(n):
        k = 8 + (i * 7) % 56
        lines.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "demo-model", "max_tokens": k, "min_tokens": k,
                               "messages": [{"role": "user", "content": f"Tell me about topic {i}."}]}})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def run_exec(plan: Path, prompts: Path, work: Path, threads: int) -> dict[str, Any]:
    """`moecc exec` on the file with `threads` torch threads: the job's seconds (model load to
    last result, as its --stats reports: the process's imports left out, as a server's worker
    has them done before a batch comes) and tokens/s."""
    stats = work / "exec-stats.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "moecc.cli", "exec", str(plan), str(prompts), "-o", str(work / "exec.jsonl"),
                    "--format", "openai", "--quiet", "--overwrite", "--device", "cpu", "--stats", str(stats)],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    s = json.loads(stats.read_text())
    return {"process_wall_s": wall, "job_s": s["wall_seconds"], "engine_s": s["seconds"],
            "completion_tokens": s["completion_tokens"], "succeeded": s["succeeded"],
            "tokens_per_s_job": s["completion_tokens"] / s["wall_seconds"],
            "tokens_per_s_engine": s["completion_tokens"] / s["seconds"]}


class Load:
    """The clients' loop and what it measured."""

    def __init__(self, server: ServerProcess, batch_id: str, clients: int, deadline: float,
                 interval: float) -> None:
        self.server, self.batch_id, self.clients, self.deadline = server, batch_id, clients, deadline
        self.interval = interval
        self.status_ms: list[float] = []
        self.upload_ms: list[float] = []
        self.uploaded: dict[str, bytes] = {}
        self.errors: list[str] = []
        self.sent = 0
        self.done = threading.Event()
        self.lock = threading.Lock()

    def client(self, k: int) -> None:
        c = openai.OpenAI(base_url=self.server.url + "/v1", api_key="none", max_retries=0, timeout=30)
        turn = 0
        while not self.done.is_set() and time.monotonic() < self.deadline:
            turn += 1
            try:
                self.timed(self.status_ms, lambda: c.batches.retrieve(self.batch_id))
                if turn % 5 == 0:
                    data = f'{{"custom_id": "c{k}-{turn}", "client": {k}}}\n'.encode() * 20
                    f = self.timed(self.upload_ms, lambda: c.files.create(file=(f"c{k}.jsonl", data), purpose="batch"))
                    with self.lock:
                        self.uploaded[f.id] = data
                if turn % 10 == 0:
                    self.timed(None, lambda: c.batches.list(limit=20))
            except Exception as e:  # every failure is counted: the bench's "lost"
                with self.lock:
                    self.errors.append(f"{type(e).__name__}: {e}")
            time.sleep(self.interval)

    def timed(self, into: list[float] | None, call: Any) -> Any:
        t0 = time.perf_counter()
        with self.lock:
            self.sent += 1
        out = call()
        if into is not None:
            with self.lock:
                into.append((time.perf_counter() - t0) * 1000)
        return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_serve(prompts: Path, work: Path, plans: Path, clients: int, max_seconds: float,
              interval: float) -> dict[str, Any]:
    """The batch through `moecc serve` twice on one server (after a warm-up batch of 8 lines):
    alone, then with the clients' load on it."""
    d = data_dir_with_plans(plans, work / "serve-data")
    server = ServerProcess([str(DEMO)], d, log=work / "serve.log").start()
    try:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        warm = c.files.create(file=("warm.jsonl", b"".join(prompts.read_bytes().splitlines(True)[:8])),
                              purpose="batch")
        one_batch(server, c, warm.id, 0, max_seconds, interval)  # the worker's first job: its one-time costs
        f = c.files.create(file=open(prompts, "rb"), purpose="batch")
        return {"alone": one_batch(server, c, f.id, 0, max_seconds, interval),
                "loaded": one_batch(server, c, f.id, clients, max_seconds, interval)}
    finally:
        server.stop()


def one_batch(server: ServerProcess, c: openai.OpenAI, file_id: str, clients: int, max_seconds: float,
              interval: float) -> dict[str, Any]:
    """One batch of the file, timed from create to completed, with `clients` loading the server."""
    t0 = time.perf_counter()
    b = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    load = Load(server, b.id, clients, time.monotonic() + max_seconds, interval)
    threads = [threading.Thread(target=load.client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    while b.status not in ("completed", "failed", "cancelled", "expired") and time.monotonic() < load.deadline:
        time.sleep(0.2)
        b = c.batches.retrieve(b.id)
    wall = time.perf_counter() - t0
    load.done.set()
    for t in threads:
        t.join()
    return finish(c, b, load, wall, clients)


def finish(c: openai.OpenAI, b: Any, load: Load, wall: float, clients: int) -> dict[str, Any]:
    """The figures, and the checks that nothing was lost."""
    listed = {x.id for x in c.files.list(purpose="batch")}
    missing = [fid for fid in load.uploaded if fid not in listed]
    changed = [fid for fid, data in load.uploaded.items() if fid in listed and c.files.content(fid).content != data]
    out_ids = ([json.loads(x)["custom_id"] for x in c.files.content(b.output_file_id).text.splitlines()]
               if b.output_file_id else [])
    tokens = b.usage.output_tokens if b.usage else 0
    return {"clients": clients, "status": b.status, "requests": b.request_counts.total,
            "completed": b.request_counts.completed, "failed": b.request_counts.failed,
            "results_each_once": len(out_ids) == len(set(out_ids)) == b.request_counts.completed,
            "http_requests": load.sent, "http_errors": len(load.errors), "first_errors": load.errors[:5],
            "uploads": len(load.uploaded), "uploads_missing": len(missing), "uploads_changed": len(changed),
            "status_polls": len(load.status_ms), "status_p50_ms": pct(load.status_ms, 0.5),
            "status_p99_ms": pct(load.status_ms, 0.99), "status_max_ms": max(load.status_ms, default=float("nan")),
            "status_mean_ms": statistics.fmean(load.status_ms) if load.status_ms else float("nan"),
            "upload_p50_ms": pct(load.upload_ms, 0.5), "upload_p99_ms": pct(load.upload_ms, 0.99),
            "batch_wall_s": wall, "completion_tokens": tokens, "tokens_per_s_wall": tokens / wall if wall else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=384)
    ap.add_argument("--max-seconds", type=float, default=240.0, help="bound on each served batch's run")
    ap.add_argument("--interval", type=float, default=0.25, help="seconds each client waits between turns")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="serve-load-"))
    work.mkdir(parents=True, exist_ok=True)
    prompts = write_batch(work / "batch.jsonl", args.requests)
    plans = cached_plans(DEMO, work / "plan-cache")
    plan = next(plans.glob("*.pt"))
    threads = max(1, (os.cpu_count() or 2) - 1)  # what `moecc serve` gives its worker by default
    ex = run_exec(plan, prompts, work, threads)
    runs = run_serve(prompts, work, plans, args.clients, args.max_seconds, args.interval)
    sv, alone = runs["loaded"], runs["alone"]
    report = {"bench": "serve_load", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.node(),
              "cpus": os.cpu_count(), "torch_threads": threads, "requests": args.requests,
              "poll_interval_s": args.interval, "exec": ex, "serve_alone": alone, "serve": sv,
              "serve_alone_over_exec": alone["tokens_per_s_wall"] / ex["tokens_per_s_job"],
              "serve_over_exec_tokens_per_s": sv["tokens_per_s_wall"] / ex["tokens_per_s_job"],
              "lost": sv["http_errors"] + sv["uploads_missing"] + sv["uploads_changed"]
              + (sv["requests"] - sv["completed"] - sv["failed"]) + (0 if sv["results_each_once"] else 1)}
    print(f"exec:  {ex['completion_tokens']} tokens in {ex['job_s']:.1f}s = {ex['tokens_per_s_job']:.1f} tok/s "
          f"(engine alone {ex['tokens_per_s_engine']:.1f}; the process {ex['process_wall_s']:.1f}s with its imports)")
    print(f"serve, no clients: {alone['tokens_per_s_wall']:.1f} tok/s ({report['serve_alone_over_exec']:.2f}x exec)")
    print(f"serve, {args.clients} clients: {sv['completion_tokens']} tokens in {sv['batch_wall_s']:.1f}s = "
          f"{sv['tokens_per_s_wall']:.1f} tok/s ({report['serve_over_exec_tokens_per_s']:.2f}x exec); "
          f"batch {sv['status']}")
    print(f"status latency p50 {sv['status_p50_ms']:.1f} ms, p99 {sv['status_p99_ms']:.1f} ms, max "
          f"{sv['status_max_ms']:.1f} ms over {sv['status_polls']} polls; {sv['uploads']} uploads "
          f"(p50 {sv['upload_p50_ms']:.1f} ms); {sv['http_requests']} HTTP requests, lost {report['lost']}")
    out = args.json or ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-serve-load.json"
    out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
