"""Time to first result and peak memory of `moecc exec` on a huge prompts file (read as a
stream), against reading the whole file into encoded requests first (the old exec).

    python bench/streaming_input.py                     # 1,000,000 lines, stop after 100 results
    python bench/streaming_input.py --lines 20000 --first 50    # a quick smoke run
    python bench/streaming_input.py --first 0           # run every request (long)

What it does:
  1. builds (or reuses) a tiny random Mixtral (moecc.testing.checkpoints, no EOS) in
     WORK/model-streaming-tiny, or takes --model DIR, and compiles a plan for it;
  2. writes --lines short text prompts, `{"custom_id": "r<i>", "prompt": "...", "max_tokens": 1}`;
  3. times the byte scan that gives the progress total (exec.count_request_lines);
  4. runs `moecc exec PLAN PROMPTS -o OUT --device cpu --quiet` in a subprocess, polling the
     output file: time to the first result line and to --first result lines, when it sends
     SIGINT (the first Ctrl-C: no more admitted, those in flight finish, results on disk)
     so the run stops early; its peak RSS comes from wait4 (ru_maxrss) and /proc VmHWM;
  5. baseline (unless --skip-baseline): in a fresh subprocess, what the old exec did before
     its first step: every line parsed, validated and tokenized into a list of GenRequests
     (Job.read's work, materialised), with its seconds and peak RSS;
  6. prints a table and writes JSON (and the table) under --out (default bench/results/),
     or to --json.
Absolute times on shared machines drift; run the real measurement on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the kettle clicked off and a pulley is a wheel on an axle that turns with rope".split()


def build_model(work: Path) -> Path:
    out = work / "model-streaming-tiny"
    if (out / "config.json").exists():
        return out
    from moecc.testing.checkpoints import write_checkpoint

    print(f"building a tiny checkpoint in {out} ...", file=sys.stderr)
    return write_checkpoint(out, "mixtral", eos_token_id=None)


def compile_plan(model: Path, work: Path, max_batch: int) -> Path:
    plan = work / "plan-streaming.pt"
    subprocess.run([sys.executable, "-m", "moecc.cli", "compile", str(model), "-o", str(plan),
                    "--max-batch", str(max_batch)], check=True, stdout=subprocess.DEVNULL)
    return plan


def write_prompts(path: Path, n: int) -> int:
    with open(path, "w", encoding="utf-8", buffering=1 << 20) as f:
        for i in range(n):
            words = " ".join(WORDS[i % 7:i % 7 + 3 + i % 5])
            f.write(f'{{"custom_id": "r{i}", "prompt": "{words} {i}", "max_tokens": 1}}\n')
    return path.stat().st_size


def _hwm_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _wait4(proc: subprocess.Popen, timeout: float) -> tuple[int, int]:
    """(exit status, peak RSS KiB of that child alone) once it exits (SIGKILL past timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss
        if time.monotonic() > deadline:
            proc.kill()
            deadline = float("inf")
        time.sleep(0.02)


def run_exec(plan: Path, prompts: Path, out: Path, first: int, timeout: float) -> dict[str, Any]:
    """`moecc exec` in a subprocess; time to the first and to `first` result lines (then
    SIGINT: drain), its exit status and peak RSS."""
    out.unlink(missing_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "TERM": "dumb"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "moecc.cli", "exec", str(plan), str(prompts), "-o", str(out),
                             "--device", "cpu", "--quiet", "--overwrite"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: dict[str, Any] = {"first": None, "k": None, "hwm_kib": None}
    exited = threading.Event()  # set once wait4 reaped it (polling must not reap it: it would lose the rusage)

    def poll() -> None:
        size = 0
        while not exited.is_set():
            hwm = _hwm_kib(proc.pid)
            if hwm is not None:
                seen["hwm_kib"] = max(seen["hwm_kib"] or 0, hwm)
            try:
                now = out.stat().st_size
            except FileNotFoundError:
                now = 0
            if now != size:
                size = now
                wanted = seen["first"] is None or (first and seen["k"] is None)
                lines = out.read_bytes().count(b"\n") if wanted else 0
                if lines >= 1 and seen["first"] is None:
                    seen["first"] = time.perf_counter() - t0
                if first and lines >= first and seen["k"] is None:
                    seen["k"] = time.perf_counter() - t0
                    if not exited.is_set():
                        proc.send_signal(signal.SIGINT)
            time.sleep(0.005)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    rc, maxrss = _wait4(proc, timeout)
    wall = time.perf_counter() - t0
    exited.set()
    watcher.join(timeout=5)
    err = proc.stderr.read() if proc.stderr else ""
    results = out.read_bytes().count(b"\n") if out.is_file() else 0
    return {"exit_status": rc, "wall_s": wall, "time_to_first_result_s": seen["first"],
            "time_to_k_results_s": seen["k"], "results_written": results, "peak_rss_mib": maxrss / 1024,
            "vmhwm_mib": None if seen["hwm_kib"] is None else seen["hwm_kib"] / 1024,
            "summary": next((ln for ln in err.splitlines() if " ok, " in ln), err.strip()[-300:])}


BASELINE = r"""
import sys, time
from pathlib import Path
t0 = time.perf_counter()
from moecc_runtime.job.reader import encode_request
from moecc_runtime.job.requests import Request, iter_identified
from moecc_runtime.plan import load_plan
from moecc_runtime.tokenizer import Tokenizer
plan = load_plan(sys.argv[1])
tok = Tokenizer(Path(plan["model"]["dir"]))
ctx, vocab = int(plan["model"]["info"]["max_position_embeddings"]), int(plan["model"]["info"]["vocab_size"])
t1 = time.perf_counter()
out, lines, hashes, apis = [], {}, {}, {}
for item, request in iter_identified(sys.argv[2], 256):
    if isinstance(item, Request):
        out.append(encode_request(item, tok, ctx, 256, vocab))
        lines[item.custom_id], hashes[item.custom_id], apis[item.custom_id] = item.line, request, (item.api, item.model, item.stop)
print(len(out), time.perf_counter() - t1, t1 - t0)
"""


def run_baseline(plan: Path, prompts: Path, timeout: float) -> dict[str, Any]:
    """The old exec's reading, materialised: every request encoded into one list (and its
    bookkeeping dicts) before the first step could run."""
    proc = subprocess.Popen([sys.executable, "-c", BASELINE, str(plan), str(prompts)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    rc, maxrss = _wait4(proc, timeout)
    text = proc.stdout.read() if proc.stdout else ""
    if rc != 0:
        return {"exit_status": rc, "error": (proc.stderr.read() if proc.stderr else "")[-500:]}
    n, read_s, setup_s = text.split()
    return {"exit_status": rc, "requests": int(n), "read_and_encode_s": float(read_s), "setup_s": float(setup_s),
            "peak_rss_mib": maxrss / 1024}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--first", type=int, default=100, help="SIGINT (drain) after this many results; 0: run all")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: a tiny Mixtral)")
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out", help="model, plan, prompts, results")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per subprocess")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where the JSON and table go")
    ap.add_argument("--json", type=Path, default=None, help="the JSON file (default: OUT/DATE-streaming-input-N.json)")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    model = a.model or build_model(a.work)
    plan = compile_plan(model, a.work, a.max_batch)
    prompts = a.work / f"streaming-prompts-{a.lines}.jsonl"
    size = write_prompts(prompts, a.lines)
    from moecc_runtime.job.exec import count_request_lines

    t = time.perf_counter()
    counted = count_request_lines(prompts)
    scan_s = time.perf_counter() - t
    print(f"exec over {a.lines} lines ({size / 2**20:.1f} MiB) ...", file=sys.stderr)
    streamed = run_exec(plan, prompts, a.work / "streaming-results.jsonl", a.first, a.timeout)
    baseline = None
    if not a.skip_baseline:
        print("baseline: reading the whole file into encoded requests ...", file=sys.stderr)
        baseline = run_baseline(plan, prompts, a.timeout)
    result = {
        "bench": "streaming_input",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "model": str(model),
        "input": {"lines": a.lines, "bytes": size, "counted": counted, "count_scan_s": scan_s},
        "first": a.first, "max_batch": a.max_batch,
        "streamed_exec": streamed,
        "baseline_read_all": baseline,
    }
    table = format_table(result)
    print(table)
    path = a.json or a.out / f"{time.strftime('%Y-%m-%d')}-streaming-input-{a.lines}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    path.with_suffix(".txt").write_text(table + "\n")
    print(f"\nJSON: {path}")
    return 0 if streamed["exit_status"] in (0, 130) else 1


def format_table(r: dict[str, Any]) -> str:
    s, b, i = r["streamed_exec"], r["baseline_read_all"], r["input"]

    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}s"

    rows = [f"prompts file: {i['lines']} lines, {i['bytes'] / 2**20:.1f} MiB; request lines counted in "
            f"{i['count_scan_s']:.3f}s ({i['counted']})",
            f"{'':34} {'first result':>12} {'K results':>10} {'peak RSS':>10} {'wall':>8}",
            f"{'moecc exec (streamed input)':34} {sec(s['time_to_first_result_s']):>12} "
            f"{sec(s['time_to_k_results_s']):>10} {s['peak_rss_mib']:>8.0f}Mi {s['wall_s']:>7.1f}s",
            f"  exit {s['exit_status']}, {s['results_written']} results written (K = {r['first'] or 'all'}); "
            f"{s['summary']}"]
    if b is not None and b.get("exit_status") == 0:
        rows.append(f"{'old exec: read all, then run':34} {'>' + sec(b['read_and_encode_s'] + b['setup_s']):>12} "
                    f"{'-':>10} {b['peak_rss_mib']:>8.0f}Mi    (reading + encoding {b['read_and_encode_s']:.1f}s "
                    f"before the first step; the model load comes on top)")
    elif b is not None:
        rows.append(f"baseline failed: {b}")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
