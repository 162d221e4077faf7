"""Shared prompt prefixes: a job whose requests share a long system prompt, run by `moecc exec`
with prefix sharing (the default) and without it (`--no-share-prefixes`), same plan, same run.

    python bench/prefix_sharing.py                      # 1024 requests, 512 shared + 32 own tokens, 32 new
    python bench/prefix_sharing.py --requests 128       # quick look

What it does:
  1. builds (or reuses) the bench768 model (bench/throughput.py's build_model: random fp32
     weights, no EOS, so every request generates its full max_tokens), or --model DIR;
  2. writes a prompts file: every request is the same --shared-tokens token ids followed by
     its own --own-tokens (seeded), --new-tokens each;
  3. compiles one plan from that file (`--prompts`: the workload's shape and its shared share);
  4. runs `moecc exec --stats` on it twice, with and without sharing, in subprocesses, and
     reads the engine's per-step records: prompt tokens computed, the seconds of prefill
     steps (steps whose rows are mostly prompt tokens), the job's wall time, the KV bytes
     held at the peak; checks both runs wrote the same tokens;
  5. prints a table and writes JSON (--json).
Absolute times on shared machines drift; the ratios are what this reports.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import ROOT, build_model  # noqa: E402


def write_prompts(path: Path, n: int, shared: int, own: int, new: int, vocab: int, seed: int) -> None:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(shared)]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            ids = system + [rng.randrange(3, vocab) for _ in range(own)]
            f.write(json.dumps({"custom_id": f"r{i}", "prompt": ids, "max_tokens": new}) + "\n")


def run(plan: Path, prompts: Path, work: Path, name: str, extra: list[str]) -> dict[str, Any]:
    stats, results = work / f"stats-{name}.json", work / f"results-{name}.jsonl"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "moecc.cli", "exec", str(plan), str(prompts), "-o", str(results),
                    "--stats", str(stats), "--device", "cpu", "--overwrite", *extra], check=True)
    wall = time.perf_counter() - t0
    s = json.loads(stats.read_text())
    recs = s["engine"]["records"]
    prefill_steps = [r for r in recs if r["prefill_tokens"] > r["decode_tokens"]]
    tokens = {json.loads(line)["custom_id"]: json.loads(line)["token_ids"]
              for line in results.read_text().splitlines() if line.strip()}
    return {
        "wall_s": wall,
        "engine_s": s["seconds"],
        "requests": s["succeeded"],
        "generated_tokens": s["completion_tokens"],
        "tokens_per_s": s["completion_tokens"] / wall,
        "prompt_tokens": s["prompt_tokens"],
        "prompt_tokens_computed": sum(r["prefill_tokens"] for r in recs),
        "prefill_steps": len(prefill_steps),
        "prefill_step_s": sum(r["seconds"] for r in prefill_steps),
        "steps": len(recs),
        "kv_peak_held_bytes": max(r["kv_allocated_bytes"] for r in recs),
        "kv_peak_live_bytes": max(r["kv_live_bytes"] for r in recs),
        "_tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="checkpoint dir (default: the bench768 preset, built once)")
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out")
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--shared-tokens", type=int, default=512)
    ap.add_argument("--own-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    model = a.model or build_model(a.work, "bench768")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = a.work / "prompts-shared-prefix.jsonl"
    write_prompts(prompts, a.requests, a.shared_tokens, a.own_tokens, a.new_tokens, vocab, a.seed)
    plan = a.work / "plan-shared-prefix.pt"
    subprocess.run([sys.executable, "-m", "moecc.cli", "compile", str(model), "-o", str(plan), "--prompts",
                    str(prompts), "--max-batch", str(a.max_batch)], check=True, stdout=subprocess.DEVNULL)
    shared = run(plan, prompts, a.work, "shared-prefix-on", [])
    alone = run(plan, prompts, a.work, "shared-prefix-off", ["--no-share-prefixes"])
    same = shared.pop("_tokens") == alone.pop("_tokens")
    out = {
        "bench": "prefix_sharing", "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
        "model": str(model), "requests": a.requests, "shared_tokens": a.shared_tokens, "own_tokens": a.own_tokens,
        "new_tokens": a.new_tokens, "max_batch": a.max_batch, "same_tokens": same,
        "shared": shared, "not_shared": alone,
        "prefill_time_ratio": alone["prefill_step_s"] / shared["prefill_step_s"],
        "prefill_tokens_ratio": alone["prompt_tokens_computed"] / shared["prompt_tokens_computed"],
        "job_time_ratio": alone["wall_s"] / shared["wall_s"],
        "kv_peak_held_ratio": alone["kv_peak_held_bytes"] / shared["kv_peak_held_bytes"],
    }
    print_table(out)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if same else 1


def print_table(r: dict[str, Any]) -> None:
    print(f"{r['requests']} requests: {r['shared_tokens']} shared + {r['own_tokens']} own prompt tokens, "
          f"{r['new_tokens']} new tokens each (B <= {r['max_batch']}); same tokens: {r['same_tokens']}")
    print(f"| {'':14s} | prompt tokens computed | prefill steps | prefill s | job wall s | gen tok/s | KV held at peak |")
    print("|---|---|---|---|---|---|---|")
    for name, key in (("sharing", "shared"), ("no sharing", "not_shared")):
        x = r[key]
        print(f"| {name:14s} | {x['prompt_tokens_computed']:>22d} | {x['prefill_steps']:>13d} | "
              f"{x['prefill_step_s']:9.1f} | {x['wall_s']:10.1f} | {x['tokens_per_s']:9.1f} | "
              f"{x['kv_peak_held_bytes'] / 2**20:12.1f} MiB |")
    print(f"prefill time {r['prefill_time_ratio']:.2f}x less, prompt tokens computed {r['prefill_tokens_ratio']:.2f}x "
          f"fewer, job {r['job_time_ratio']:.2f}x faster, KV held at peak {r['kv_peak_held_ratio']:.2f}x less")


if __name__ == "__main__":
    sys.exit(main())
