"""How `moecc exec --ray` scales with workers on this machine, against a local run.

    python bench/ray_scaling.py [--prompts 256] [--output-tokens 32] [--workers 1,2]

Builds (once) the bench checkpoint of bench/throughput.py, compiles one plan, then runs the
same prompts: locally (`moecc exec`, one process using every core) and with `--ray` at each
worker count (each actor one CPU core, on a local cluster started by the run). Prints a
table of wall time, generated tokens/s and the speed-up over one worker, checks that every
run wrote the same results (greedy), and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from throughput import build_model, write_prompts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray
    import torch

    from moecc.compiler import compile_model
    from moecc_runtime.job.distributed import RayOptions
    from moecc_runtime.job.exec import run_job
    from moecc_runtime.plan import save_plan

    a.work.mkdir(parents=True, exist_ok=True)
    model = a.model or build_model(a.work)
    cfg = json.loads((model / "config.json").read_text())
    prompts = a.work / "ray-prompts.jsonl"
    write_prompts(prompts, a.prompts, 16, 64, a.output_tokens, a.output_tokens, cfg["vocab_size"], 2)
    B = max(16, a.prompts // 8)  # a batch that leaves several shards per worker
    plan, _ = compile_model(model, prompt_tokens=40, output_tokens=a.output_tokens, max_batch=B)
    plan_path = a.work / "plan-ray.pt"
    save_plan(plan, plan_path)

    def rows_of(p: Path) -> dict[str, list[int]]:
        return {r["custom_id"]: r["token_ids"] for r in map(json.loads, p.read_text().splitlines())}

    runs = []
    out = a.work / "ray-local.jsonl"
    t0 = time.perf_counter()
    s = run_job(plan_path, prompts, out, device="cpu", log=None)
    runs.append({"run": f"local (one process, {torch.get_num_threads()} threads)", "workers": 0,
                 "wall_s": time.perf_counter() - t0, "tokens": s.completion_tokens})
    ref = rows_of(out)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    same = True
    for w in [int(x) for x in a.workers.split(",")]:
        out = a.work / f"ray-{w}.jsonl"
        t0 = time.perf_counter()
        s = run_job(plan_path, prompts, out, device="cpu", log=None, ray=RayOptions(workers=w))
        runs.append({"run": f"--ray, {w} worker{'s' if w > 1 else ''} (1 core each)", "workers": w,
                     "wall_s": time.perf_counter() - t0, "tokens": s.completion_tokens})
        same &= rows_of(out) == ref
    ray.shutdown()
    one = next((r["wall_s"] for r in runs if r["workers"] == 1), None)
    print(f"\n{'run':40s} {'wall s':>8s} {'tok/s':>8s} {'vs 1 worker':>12s}")
    for r in runs:
        r["tokens_per_s"] = r["tokens"] / r["wall_s"]
        r["speedup_vs_one_worker"] = one / r["wall_s"] if one else None
        print(f"{r['run']:40s} {r['wall_s']:8.1f} {r['tokens_per_s']:8.1f} "
              f"{r['speedup_vs_one_worker'] or float('nan'):11.2f}x")
    print(f"every run wrote the same results: {same}")
    path = a.json or a.work / "ray_scaling.json"
    path.write_text(json.dumps({"runs": runs, "same_results": same, "prompts": a.prompts,
                                "output_tokens": a.output_tokens, "cpus": os.cpu_count(), "B": B}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
