"""Weight streaming against all-resident, on this machine, in one run.

    python bench/stream.py                       # bench model, 512 prompts, 64 tokens each
    python bench/stream.py --fractions 0.25,0.5 --prompts 256

For each plan it compiles and runs `moecc exec --stats` (a subprocess each, one after the
other, nothing else running):
  * resident   --gpu-mem twice the weights: everything is copied into the arena once;
  * NN%        --gpu-mem at NN% of the model's weight bytes: what does not fit streams
               through slots (experts only when chosen, the next module's weights and the
               next micro-batch's KV while the current one computes);
and reports generated tokens/s end to end and in steady decode (median of per-step rates
over steps with the batch at >= 90% of its peak and no prefill), the planner's predicted
bottleneck, overlap efficiency (share of copy time hidden behind compute: 1 - wait/copy)
over the whole job and over the steady steps, and the peak arena bytes against the budget.
Streamed and resident outputs are compared token by token. A table is printed and JSON
written (--json). On a CPU the "device" arena is separate host memory: copies are real
memcpys on a second thread, competing with compute for the same two cores and memory bus.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from throughput import build_model, compile_and_exec, steady_decode, write_prompts  # noqa: E402


def run_plan(name: str, model: Path, prompts: Path, work: Path, gpu_mem: int, prompt_tokens: float,
             out_tokens: int, max_batch: int) -> dict[str, Any]:
    plan, s, wall, results = compile_and_exec(model, prompts, work, name, [
        "--gpu-mem", str(gpu_mem), "--prompt-tokens", str(int(prompt_tokens)), "--output-tokens", str(out_tokens),
        "--max-batch", str(max_batch)])
    p = torch.load(plan, weights_only=True)
    eng = s["engine"]
    steady = steady_decode(eng["records"])
    copy_s = sum(r["copy_seconds"] for r in steady)
    wait_s = sum(r["wait_seconds"] for r in steady)
    tokens = {}
    for line in results.read_text().splitlines():
        d = json.loads(line)
        tokens[d["custom_id"]] = d["token_ids"]
    return {
        "gpu_mem": gpu_mem,
        "arena_bytes": eng["arena_bytes"],
        "peak_device_bytes": eng["peak_device_bytes"],
        "arena_usage": eng["arena_usage"],
        "resident_groups": p["arena"]["resident"] if p.get("arena") else None,
        "expert_slots": p["arena"]["expert_slots"] if p.get("arena") else None,
        "batch": p["batch"]["decode"],
        "predicted_decode_tokens_per_s": p["predicted"]["decode_tokens_per_s"],
        "predicted_bottleneck": p["predicted"]["bottleneck"],
        "wall_s": wall,
        "generated_tokens": s["completion_tokens"],
        "tokens_per_s": s["completion_tokens"] / wall,
        "steady_steps": len(steady),
        "steady_decode_tokens_per_s_median": median(r["decode_tokens"] / r["seconds"] for r in steady)
        if steady else None,
        "copy_bytes": eng["copy_bytes"],
        "copy_s": eng["copy_seconds"],
        "wait_s": eng["wait_seconds"],
        "overlap_efficiency": eng["overlap_efficiency"],
        "steady_copy_s": copy_s,
        "steady_wait_s": wait_s,
        "steady_overlap_efficiency": max(0.0, 1 - wait_s / copy_s) if copy_s > 0 else None,
        "_tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: build the bench model)")
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--fractions", default="0.25", help="--gpu-mem as fractions of the weight bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    model = a.model or build_model(a.work)
    cfg = json.loads((model / "config.json").read_text())
    prompts = a.work / "stream-prompts.jsonl"
    reqs = write_prompts(prompts, a.prompts, a.min_prompt, a.max_prompt, a.output_tokens, a.output_tokens,
                         cfg["vocab_size"], a.seed)
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    mean_prompt = sum(len(p) for p, _ in reqs) / len(reqs)
    runs: dict[str, dict[str, Any]] = {}
    configs = [("resident", 2 * weights)] + [(f"{float(f):.0%}", int(float(f) * weights))
                                            for f in a.fractions.split(",")]
    for name, budget in configs:
        print(f"running {name} (--gpu-mem {budget / 2**20:.0f} MiB) ...", file=sys.stderr)
        runs[name] = run_plan(name, model, prompts, a.work, budget, mean_prompt, a.output_tokens, a.max_batch)
    ref = runs["resident"].pop("_tokens")
    for name, r in runs.items():
        if name != "resident":
            toks = r.pop("_tokens")
            r["token_identical_to_resident"] = toks == ref
            base = runs["resident"]
            r["throughput_vs_resident"] = r["tokens_per_s"] / base["tokens_per_s"]
            if r["steady_decode_tokens_per_s_median"] and base["steady_decode_tokens_per_s_median"]:
                r["steady_decode_vs_resident"] = (r["steady_decode_tokens_per_s_median"]
                                                  / base["steady_decode_tokens_per_s_median"])
    out = {
        "bench": "stream",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__},
        "model": {"dir": str(model), "weight_bytes": weights, "hidden": cfg["hidden_size"],
                  "layers": cfg["num_hidden_layers"], "experts": cfg.get("num_local_experts")},
        "workload": {"prompts": a.prompts, "prompt_tokens": [a.min_prompt, a.max_prompt],
                     "output_tokens": a.output_tokens, "max_batch": a.max_batch},
        "runs": runs,
    }
    path = a.json or a.work / "stream.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print_table(out)
    print(f"\nJSON: {path}")
    return 0


def print_table(out: dict[str, Any]) -> None:
    w = out["model"]["weight_bytes"]
    print(f"\nweight streaming, {out['model']['layers']} layers, weights {w / 2**20:.0f} MiB; "
          f"{out['workload']['prompts']} prompts, {out['workload']['output_tokens']} tokens each")
    print(f"{'plan':>9} {'budget':>9} {'arena peak':>10} {'tok/s':>7} {'steady':>7} {'vs res':>7} "
          f"{'overlap':>8} {'steady ovl':>10} {'copied':>8} {'bound (pred.)':>14} same")
    for name, r in out["runs"].items():
        ov = r["overlap_efficiency"]
        sov = r["steady_overlap_efficiency"]
        vs = r.get("steady_decode_vs_resident")
        print(f"{name:>9} {r['gpu_mem'] / 2**20:>8.0f}M {r['peak_device_bytes'] / 2**20:>9.0f}M "
              f"{r['tokens_per_s']:>7.1f} {r['steady_decode_tokens_per_s_median'] or 0:>7.1f} "
              f"{'' if vs is None else f'{vs:.2f}':>7} {'' if ov is None else f'{ov:.0%}':>8} "
              f"{'' if sov is None else f'{sov:.0%}':>10} {r['copy_bytes'] / 2**30:>7.1f}G "
              f"{r['predicted_bottleneck']['decode']:>14} {r.get('token_identical_to_resident', '')}")


if __name__ == "__main__":
    sys.exit(main())
