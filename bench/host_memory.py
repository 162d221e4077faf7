"""Measured peak host memory of `moecc exec` against the --host-mem its plan was compiled
for, over a few budgets, with the unbudgeted plan as the baseline measured in the same run.

    python bench/host_memory.py                       # demo model, 64 requests
    python bench/host_memory.py --model DIR --requests 400 --json out.json

What it does:
  1. writes a prompts file of --requests prompts cut from the demo model's held-out text,
     lengths uniform in [--min-words, --max-words] words, --max-tokens each (seeded);
  2. compiles the plan with --host-reserve R and a 1-byte --host-mem, and reads the minimum
     the refusal names; then compiles at that minimum and at larger budgets (the KV pool
     takes what each leaves), and once with no --host-mem (the baseline);
  3. runs each plan's `moecc exec` in a fresh process under /usr/bin/time, recording its
     peak resident set (weights mapped and touched, KV pool pages written, buffers, the
     process itself), wall time, the planned B and KV pool;
  4. prints a table and writes JSON. At the stated minimum the pool holds one sequence of
     the compiled workload's length (B = 1), so longer requests fail alone, by design. The claim checked: peak RSS <= --host-mem for every
     budgeted plan. R must cover what the plan does not size (the runtime process: about
     0.25 GiB on CPU); the planner's default reserve is larger (1 GiB for the process,
     1 GiB for the request table, the weights' page tables).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "demo-model"


def write_prompts(path: Path, n: int, lo: int, hi: int, max_tokens: int, seed: int = 0) -> None:
    words = (DEMO / "heldout.txt").read_text(encoding="utf-8").split()
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            k = rng.randint(lo, hi)
            s = rng.randrange(0, max(1, len(words) - k))
            f.write(json.dumps({"custom_id": f"r{i}", "prompt": " ".join(words[s:s + k]),
                                "max_tokens": max_tokens}) + "\n")


def moecc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moecc.cli", *args], capture_output=True, text=True)


def stated_minimum(model: Path, reserve: str, workload: list[str], work: Path) -> int:
    """The --host-mem the compiler's refusal of a 1-byte budget names (bytes)."""
    from moecc.sizes import parse_size

    r = moecc("compile", str(model), "--host-mem", "1", "--host-reserve", reserve, *workload, "-o",
              str(work / "refused.pt"))
    m = re.search(r"use --host-mem ([0-9.]+[KMGT]?B) or more", r.stderr)
    if r.returncode == 0 or m is None:
        raise SystemExit(f"expected a refusal naming the minimum --host-mem, got rc {r.returncode}: {r.stderr}")
    return parse_size(m.group(1))


def run_one(model: Path, prompts: Path, work: Path, name: str, budget: int | None, reserve: str,
            workload: list[str]) -> dict[str, Any]:
    """Compile at `budget` (None: unbudgeted) and exec under /usr/bin/time: the figures."""
    import torch

    plan = work / f"{name}.pt"
    args = ["compile", str(model), *workload, "-o", str(plan)]
    if budget is not None:
        args += ["--host-mem", str(budget), "--host-reserve", reserve]
    c = moecc(*args)
    if c.returncode != 0:
        raise SystemExit(f"compile {name}: {c.stderr}")
    p = torch.load(plan, weights_only=True)
    t0 = time.perf_counter()
    x = subprocess.run(["/usr/bin/time", "-f", "MAXRSS_KB %M", sys.executable, "-m", "moecc.cli", "exec",
                        str(plan), str(prompts), "-o", str(work / f"{name}.jsonl"), "--overwrite"],
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    m = re.search(r"(\d+) ok, (\d+) failed", x.stderr)
    if m is None:  # rc 1 with failed requests is a result (too long for a minimal pool); anything else is not
        raise SystemExit(f"exec {name}: rc {x.returncode}: {x.stderr[-2000:]}")
    rss = int(re.search(r"MAXRSS_KB (\d+)", x.stderr).group(1)) * 1024
    kv = p["batch"]["kv"]
    return {"plan": name, "host_mem": budget, "B": p["batch"]["decode"]["B"],
            "kv_pool_bytes": kv["num_blocks"] * kv["bytes_per_block"], "peak_rss": rss, "wall_s": wall,
            "within_budget": None if budget is None else rss <= budget,
            "ok": int(m.group(1)), "failed": int(m.group(2))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEMO)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-words", type=int, default=60)
    ap.add_argument("--max-words", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--reserve", default="400MB", help="--host-reserve for the budgeted plans")
    ap.add_argument("--extra", default="0,16MB,64MB,256MB", help="budgets above the stated minimum")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    from moecc.sizes import format_bytes, parse_size

    workload = ["--prompt-tokens", "200", "--output-tokens", str(a.max_tokens)]
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        prompts = work / "prompts.jsonl"
        write_prompts(prompts, a.requests, a.min_words, a.max_words, a.max_tokens)
        least = stated_minimum(a.model, a.reserve, workload, work)
        rows = [run_one(a.model, prompts, work, "unbudgeted", None, a.reserve, workload)]
        for i, extra in enumerate(a.extra.split(",")):
            add = 0 if extra.strip() in ("0", "") else parse_size(extra.strip())
            rows.append(run_one(a.model, prompts, work, f"min+{extra.strip()}", least + add, a.reserve, workload))
    print(f"{'plan':12s} {'--host-mem':>11s} {'B':>5s} {'KV pool':>10s} {'peak RSS':>10s} {'RSS/budget':>10s} "
          f"{'wall s':>7s} {'ok':>4s} {'failed':>6s}")
    for r in rows:
        ratio = "-" if r["host_mem"] is None else f"{r['peak_rss'] / r['host_mem']:.2f}"
        print(f"{r['plan']:12s} {format_bytes(r['host_mem']) if r['host_mem'] else 'unset':>11s} {r['B']:5d} "
              f"{format_bytes(r['kv_pool_bytes']):>10s} {format_bytes(r['peak_rss']):>10s} {ratio:>10s} "
              f"{r['wall_s']:7.1f} {r['ok']:4d} {r['failed']:6d}")
    ok = all(r["within_budget"] for r in rows if r["host_mem"] is not None)
    print(f"every budgeted plan within --host-mem: {ok} (reserve {a.reserve}, stated minimum {format_bytes(least)})")
    if a.json:
        a.json.write_text(json.dumps({"bench": "host_memory", "machine": platform.platform(), "model": str(a.model),
                                      "requests": a.requests, "reserve": a.reserve, "stated_minimum": least,
                                      "rows": rows, "all_within_budget": ok}, indent=1) + "\n")


if __name__ == "__main__":
    main()
