"""Soak test: many short requests through the demo model, a kill -9 in the middle, --resume.

    python bench/soak.py                      # 200,000 requests, killed at 100,000
    python bench/soak.py --requests 20000 --window 2000

What it does:
  1. compiles examples/demo-model (unless --plan) and writes N short prompts (unique
     custom_ids, a few words each, max_tokens 4);
  2. runs `moecc exec` under /usr/bin/time -v, samples the exec process's RSS
     (/proc/PID/status VmRSS) and the output's line count every --interval seconds, and
     kill -9s it once --kill-at results are written;
  3. runs `moecc exec --resume` on the same files to the end, sampled the same way;
  4. checks every request is in the output exactly once and no error was written.
It reports (and writes as JSON into bench/results/): the peak RSS of each run (/usr/bin/time
-v), the RSS at --window results and at the end, the throughput of each window of results
(first and last), and whether RSS grew after the first window by no more than what is in
flight allows (--rss-allowance-mib: the per-request bookkeeping of B requests in flight).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo-model"
WORDS = ("class", "for", "while", "import", "yield", "lambda", "with", "try", "def", "return", "global", "async")


@dataclass
class Run:
    """One exec process: its samples (seconds since start, results in the output, RSS KiB)."""

    name: str
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    peak_rss_kib: int | None = None  # /usr/bin/time -v's maximum resident set size
    exit: str = ""
    seconds: float = 0.0


def write_prompts(path: Path, n: int, max_tokens: int) -> None:
    """N short requests, custom_ids r0000000.., prompts of a few words."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            words = " ".join(WORDS[(i >> k) % len(WORDS)] for k in (0, 3, 6))
            f.write(json.dumps({"custom_id": f"r{i:07d}", "prompt": f"The {words} statement", "max_tokens": max_tokens})
                    + "\n")


def child_pid(pid: int, wait: float = 30.0) -> int | None:
    """The process /usr/bin/time started (its one child)."""
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return None
        if kids:
            return int(kids[0])
        time.sleep(0.05)
    return None


def rss_kib(pid: int) -> int:
    try:
        m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
        return int(m.group(1)) if m else 0
    except OSError:
        return 0


class LineCounter:
    """Counts the newlines of a growing file, reading only what was appended."""

    def __init__(self, path: Path):
        self.path, self.offset, self.lines = path, 0, 0

    def count(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return self.lines
        self.offset += len(data)
        self.lines += data.count(b"\n")
        return self.lines


def run_exec(run: Run, cmd: list[str], out: Path, start_lines: int, interval: float, kill_at: int | None,
             log: Path) -> None:
    """Run `cmd` under /usr/bin/time -v, sampling until it ends (or kill -9 at kill_at results)."""
    counter = LineCounter(out)
    counter.lines = start_lines if out.exists() else 0
    counter.offset = out.stat().st_size if out.exists() else 0
    t0 = time.monotonic()
    with open(log, "w") as errf:
        proc = subprocess.Popen(["/usr/bin/time", "-v", *cmd], stdout=subprocess.DEVNULL, stderr=errf,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        pid = child_pid(proc.pid)
        while proc.poll() is None:
            lines = counter.count()
            run.samples.append((time.monotonic() - t0, lines, rss_kib(pid) if pid else 0))
            if kill_at is not None and lines >= kill_at and pid:
                os.kill(pid, signal.SIGKILL)
                run.exit = f"killed -9 at {lines} results"
                kill_at = None
            time.sleep(interval)
        run.samples.append((time.monotonic() - t0, counter.count(), 0))
    run.seconds = time.monotonic() - t0
    text = log.read_text()
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    run.peak_rss_kib = int(m.group(1)) if m else None
    if not run.exit:
        run.exit = f"exit {proc.returncode}"


def windows(runs: list[Run], size: int) -> list[dict[str, float]]:
    """Throughput of each window of `size` results: seconds from the first sample at or past
    k*size results to the first at or past (k+1)*size, within one run."""
    out = []
    for run in runs:
        s = [(t, n) for t, n, _ in run.samples]
        if not s:
            continue
        k = -(-s[0][1] // size)
        while True:
            a = next(((t, n) for t, n in s if n >= k * size), None)
            b = next(((t, n) for t, n in s if n >= (k + 1) * size), None)
            if a is None or b is None:
                break
            if b[0] > a[0]:
                out.append({"run": run.name, "from": k * size, "to": (k + 1) * size,
                            "requests_per_s": round((b[1] - a[1]) / (b[0] - a[0]), 1)})
            k += 1
    return out


def rss_at(run: Run, lines: int) -> int | None:
    """RSS (KiB) of the first sample at or past `lines` results."""
    return next((r for _, n, r in run.samples if n >= lines and r), None)


def check_output(out: Path, n: int) -> dict[str, int]:
    """Each custom_id r0000000..r{n-1} exactly once."""
    seen: dict[str, int] = {}
    with open(out, encoding="utf-8") as f:
        for line in f:
            cid = json.loads(line)["custom_id"]
            seen[cid] = seen.get(cid, 0) + 1
    want = {f"r{i:07d}" for i in range(n)}
    return {"lines": sum(seen.values()), "distinct": len(seen), "missing": len(want - seen.keys()),
            "duplicated": sum(1 for v in seen.values() if v > 1), "unexpected": len(seen.keys() - want)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--kill-at", type=int, default=None, help="results written before kill -9 (default: half)")
    ap.add_argument("--window", type=int, default=10_000, help="results per throughput window and the RSS baseline")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--plan", type=Path, default=None, help="a compiled plan of the demo model (default: compile)")
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "soak")
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--rss-allowance-mib", type=float, default=64.0,
                    help="RSS growth after the first window that what is in flight may explain")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    kill_at = a.kill_at if a.kill_at is not None else a.requests // 2
    py = [sys.executable, "-m", "moecc.cli"]
    plan = a.plan or a.work / "plan.pt"
    if a.plan is None:
        subprocess.run([*py, "compile", str(DEMO), "-o", str(plan)], check=True, stderr=subprocess.DEVNULL)
    prompts, out = a.work / "prompts.jsonl", a.work / "results.jsonl"
    write_prompts(prompts, a.requests, a.max_tokens)
    out.unlink(missing_ok=True)
    first, second = Run("first"), Run("resumed")
    base = [*py, "exec", str(plan), str(prompts), "-o", str(out), "-q"]
    run_exec(first, base, out, 0, a.interval, kill_at, a.work / "first.log")
    done_before = LineCounter(out).count()
    run_exec(second, [*base, "--resume"], out, done_before, a.interval, None, a.work / "resumed.log")
    report = summarize(a, first, second, check_output(out, a.requests), done_before, kill_at)
    dest = a.out or ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-soak-{a.requests}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    print(f"wrote {dest}")


def summarize(a: argparse.Namespace, first: Run, second: Run, check: dict[str, int], done_before: int,
              kill_at: int) -> dict[str, object]:
    """The figures the bench reports."""
    w = windows([first, second], a.window)
    base = rss_at(first, a.window)
    last = next((r for _, _, r in reversed(second.samples) if r), None)
    first_end = next((r for _, _, r in reversed(first.samples) if r), None)
    base2 = rss_at(second, done_before + a.window)
    growth = [x for x in ((first_end - base) if base and first_end else None,
                          (last - base2) if base2 and last else None) if x is not None]
    return {
        "requests": a.requests, "max_tokens": a.max_tokens, "kill_at": kill_at, "window": a.window,
        "results_before_kill": done_before, "exactly_once": check["missing"] == check["duplicated"] ==
        check["unexpected"] == 0 and check["lines"] == a.requests, "check": check,
        "peak_rss_mib": {"first": _mib(first.peak_rss_kib), "resumed": _mib(second.peak_rss_kib)},
        "rss_mib_at_first_window": _mib(base), "rss_mib_at_end_of_first_run": _mib(first_end),
        "rss_mib_at_end": _mib(last), "rss_growth_after_first_window_mib": [_mib(g) for g in growth],
        "rss_growth_bounded": all(g / 1024 <= a.rss_allowance_mib for g in growth),
        "rss_allowance_mib": a.rss_allowance_mib,
        "throughput_first_window_rps": w[0]["requests_per_s"] if w else None,
        "throughput_last_window_rps": w[-1]["requests_per_s"] if w else None,
        "windows": w, "seconds": {"first": round(first.seconds, 1), "resumed": round(second.seconds, 1)},
        "exits": {"first": first.exit, "resumed": second.exit},
        "runs": [asdict(first), asdict(second)],
    }


def _mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


if __name__ == "__main__":
    main()
