"""End-to-end throughput of `moecc exec` against transformers' `generate`, and against the
GEMM roofline of this machine, all measured in one run.

    python bench/throughput.py                      # default: decode-heavy job
    python bench/throughput.py --workload prefill-heavy
    python bench/throughput.py --prompts 256 --output-tokens 32 --skip-hf   # quick look
    python bench/throughput.py --preset bench768 --prompts 512 --min-prompt 16 --max-prompt 48
    python bench/throughput.py --workload long-context --prompts 256

What it does:
  1. builds (or reuses) the model: by default a Mixtral-shaped random-weight fp32
     checkpoint (`python -m moecc.testing.checkpoints --preset bench`, 380M parameters,
     hidden 1024; `--preset bench768`: 200M parameters, hidden 768, 8 layers), no EOS so
     every request generates its full max_tokens, or --model DIR;
  2. writes a prompts file: --prompts requests of token ids, lengths uniform in
     [--min-prompt, --max-prompt], --output-tokens each (seeded);
  3. measures the GEMM rate at the model's own weight shapes (best over token counts
     256..2048, per shape, the better of F.linear and oneDNN over a packed weight) before and
     after the runs; the roofline is the larger rate
     divided into the FLOPs per generated token (every matmul of the active path plus
     attention at the job's mean context);
  4. compiles a plan from the prompts file (`--prompts`: the workload's shape) and runs
     `moecc exec ... --stats` in a subprocess, timing it end to
     end (plan load, weights, prompts, results written); steady decode is measured from
     the engine's per-step records (steps without prefill, batch at least 90% of its peak);
  5. runs transformers' `generate(do_sample=False)` with static batches (left-padded):
     searches the batch size (and the experts implementation) on a short run, then times
     the best over --hf-prompts prompts at the full output length;
  6. prints a table and writes JSON (--json).
Absolute times on shared machines drift; the ratios are what this reports.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {
    "decode-heavy": {"min_prompt": 16, "max_prompt": 64, "output_tokens": (128, 128)},
    # output lengths vary per request as EOS makes them vary in real jobs (here set by each
    # request's max_tokens, so both systems produce exactly the same tokens): static
    # batches decode to their longest member, moecc refills freed slots
    "mixed-output": {"min_prompt": 16, "max_prompt": 64, "output_tokens": (16, 240)},
    "prefill-heavy": {"min_prompt": 256, "max_prompt": 512, "output_tokens": (16, 16)},
    # long prompts, a short answer each: attention over long contexts dominates decode
    "long-context": {"min_prompt": 300, "max_prompt": 600, "output_tokens": (64, 64)},
}


# -- model and workload --------------------------------------------------------------------

def build_model(work: Path, preset: str = "bench", dtype: str = "float32") -> Path:
    """The preset's random-weight checkpoint (no EOS) in `dtype`, built once under `work`."""
    out = work / (f"model-{preset}" if dtype == "float32" else f"model-{preset}-{dtype}")
    if (out / "model.safetensors").exists():
        return out
    from moecc.testing.checkpoints import PRESETS, write_checkpoint

    family, overrides = PRESETS[preset]
    print(f"building the bench checkpoint in {out} ...", file=sys.stderr)
    return write_checkpoint(out, family, eos_token_id=None, dtype=dtype, **overrides)


def write_prompts(path: Path, n: int, lo: int, hi: int, out_lo: int, out_hi: int, vocab: int,
                  seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request, also written to `path` as JSONL."""
    rng = random.Random(seed)
    reqs = [([rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))], rng.randint(out_lo, out_hi))
            for _ in range(n)]
    with open(path, "w", encoding="utf-8") as f:
        for i, (p, m) in enumerate(reqs):
            f.write(json.dumps({"custom_id": f"r{i}", "prompt": p, "max_tokens": m}) + "\n")
    return reqs


# -- the roofline --------------------------------------------------------------------------

def gemm_shapes(plan: dict[str, Any]) -> dict[tuple[int, int], int]:
    """(in, out) of every weight matmul a generated token goes through -> times per token."""
    top_k = int(plan["model"]["info"].get("top_k") or 1)
    shapes: dict[tuple[int, int], int] = {}
    for module in plan["schedule"]:
        for op in module["ops"]:
            kind = op["op"]
            for local, key in op["weights"].items():
                shape = plan["weights"][key]["shape"]
                if kind == "experts":
                    if not local.startswith("e0."):
                        continue
                    mult = top_k
                elif kind in ("attention", "linear", "router", "mlp", "lm_head") and len(shape) == 2:
                    mult = 1
                else:
                    continue
                out_f, in_f = shape[-2], shape[-1]
                shapes[(in_f, out_f)] = shapes.get((in_f, out_f), 0) + mult
    return shapes


def _best_rate(f, flops: float, seconds: float) -> float:
    f()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        f()
        reps += 1
    return flops * reps / (time.perf_counter() - t0)


def measure_gemm(shapes: dict[tuple[int, int], int], dtype: torch.dtype, seconds: float = 0.4) -> dict[str, Any]:
    """Best rate per shape over token counts and over the GEMMs this torch has (F.linear, and
    oneDNN over a weight packed once where the build has it: what moecc's CPU run uses); the
    FLOP-weighted rate for one token's path."""
    from moecc_runtime.memory.packed_weights import PackedLinear, packing_available

    per_shape = {}
    for (k, n) in shapes:
        best = 0.0
        w = torch.randn(n, k, dtype=dtype)
        gemms = [lambda x: F.linear(x, w)]
        if packing_available():
            gemms.append(PackedLinear(w, 256))
        for m in (256, 512, 1024, 2048):
            x = torch.randn(m, k, dtype=dtype)
            for g in gemms:
                best = max(best, _best_rate(lambda: g(x), 2 * m * k * n, seconds / len(gemms)))
        per_shape[f"{k}x{n}"] = best
    flops = sum(2 * k * n * c for (k, n), c in shapes.items())
    secs = sum(2 * k * n * c / per_shape[f"{k}x{n}"] for (k, n), c in shapes.items())
    return {"per_shape_flops_per_s": per_shape, "flops_per_s": flops / secs, "matmul_flops_per_token": flops}


def attention_flops_per_token(info: dict[str, Any], mean_context: float) -> float:
    return 4.0 * mean_context * info["num_heads"] * info["head_dim"] * info["num_layers"]


# -- moecc ---------------------------------------------------------------------------------

def compile_and_exec(model: Path, prompts: Path, work: Path, name: str, compile_args: list[str]
                     ) -> tuple[Path, dict[str, Any], float, Path]:
    """`moecc compile` then `moecc exec --stats` as subprocesses: (plan, stats, exec wall
    seconds, results file)."""
    plan = work / f"plan-{name}.pt"
    subprocess.run([sys.executable, "-m", "moecc.cli", "compile", str(model), "-o", str(plan)] + compile_args,
                   check=True, stdout=subprocess.DEVNULL)
    return (plan, *exec_plan(plan, prompts, work, name))


def exec_plan(plan: Path, prompts: Path, work: Path, name: str) -> tuple[dict[str, Any], float, Path]:
    """`moecc exec --stats` of a compiled plan as a subprocess: (stats, exec wall seconds,
    results file); the results file is overwritten."""
    stats, results = work / f"stats-{name}.json", work / f"results-{name}.jsonl"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "moecc.cli", "exec", str(plan), str(prompts), "-o", str(results),
                    "--stats", str(stats), "--device", "cpu", "--overwrite"], check=True)
    return json.loads(stats.read_text()), time.perf_counter() - t0, results


def steady_decode_rate(recs: list[dict[str, Any]]) -> float | None:
    """Decode tokens/s over the steady_decode steps (None: there are none)."""
    steady = steady_decode(recs)
    return sum(r["decode_tokens"] for r in steady) / sum(r["seconds"] for r in steady) if steady else None


def steady_decode(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Steps without prefill with the batch at >= 90% of its peak."""
    peak_batch = max(r["sequences"] for r in recs)
    return [r for r in recs if r["prefill_tokens"] == 0 and r["sequences"] >= 0.9 * peak_batch]


def run_moecc(model: Path, prompts: Path, work: Path, max_batch: int) -> dict[str, Any]:
    plan, s, wall, _ = compile_and_exec(model, prompts, work, "moecc", [
        "--prompts", str(prompts), "--max-batch", str(max_batch)])
    eng = s["engine"]
    recs = eng["records"]
    peak_batch = max(r["sequences"] for r in recs)
    steady = steady_decode(recs)
    peak = max(recs, key=lambda r: r["kv_allocated_bytes"])
    busy = [r for r in recs if r["sequences"] >= 0.1 * peak_batch and r["kv_live_bytes"] > 0]
    return {
        "wall_s": wall,
        "job_s": s["seconds"],
        "requests": s["succeeded"],
        "generated_tokens": s["completion_tokens"],
        "tokens_per_s": s["completion_tokens"] / wall,
        "steps": len(recs),
        "peak_batch": peak_batch,
        "steady_decode_steps": len(steady),
        "steady_decode_tokens_per_s": steady_decode_rate(recs),
        "steady_decode_step_s_median": median(r["seconds"] for r in steady) if steady else None,
        "kv_peak_allocated_bytes": peak["kv_allocated_bytes"],
        "kv_peak_live_bytes": peak["kv_live_bytes"],
        "kv_allocated_over_live_at_peak": peak["kv_allocated_bytes"] / peak["kv_live_bytes"],
        "kv_allocated_over_live_max": max(r["kv_allocated_bytes"] / r["kv_live_bytes"] for r in busy),
        "plan": str(plan),
    }


# -- transformers --------------------------------------------------------------------------

def hf_generate_rate(model, reqs: list[tuple[list[int], int]], batch: int,
                     new_tokens: int | None = None) -> tuple[float, int]:
    """Generated tokens/s of static batches of `batch` left-padded prompts, in input order.
    A batch decodes to its longest request's max_tokens (or `new_tokens` for all); only each
    request's own max_tokens count as generated."""
    done, t0 = 0, time.perf_counter()
    for a in range(0, len(reqs), batch):
        chunk = reqs[a:a + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        wants = [new_tokens or m for _, m in chunk]
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(wants), do_sample=False,
                             pad_token_id=0)
        done += sum(min(w, out.shape[1] - width) for w in wants)
    return done / (time.perf_counter() - t0), done


def run_hf(model_dir: Path, prompts: list[tuple[list[int], int]], batches: list[int], search_tokens: int,
           final_prompts: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    impls: list[str | None] = [None]
    if hasattr(model, "set_experts_implementation"):
        default = getattr(model.config, "_experts_implementation", None)
        impls = [default if isinstance(default, str) else None, "eager"]
    search = []
    best = (0.0, batches[0], impls[0])
    with torch.inference_mode():
        for b in batches:
            if b > len(prompts):
                break
            rate, _ = hf_generate_rate(model, prompts[:b], b, search_tokens)
            search.append({"batch": b, "experts_implementation": impls[0], "tokens_per_s": rate})
            print(f"  transformers batch {b:4d} ({impls[0]}): {rate:7.1f} tok/s", file=sys.stderr)
            if rate > best[0]:
                best = (rate, b, impls[0])
            elif rate < 0.95 * best[0]:
                break
        for impl in impls[1:]:
            model.set_experts_implementation(impl)
            rate, _ = hf_generate_rate(model, prompts[:best[1]], best[1], search_tokens)
            search.append({"batch": best[1], "experts_implementation": impl, "tokens_per_s": rate})
            print(f"  transformers batch {best[1]:4d} ({impl}): {rate:7.1f} tok/s", file=sys.stderr)
            if rate > best[0]:
                best = (rate, best[1], impl)
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation(best[2] or impls[0] or "grouped_mm")
        n = min(len(prompts), max(best[1], final_prompts))
        n -= n % best[1] if n > best[1] else 0
        t0 = time.perf_counter()
        rate, tokens = hf_generate_rate(model, prompts[:n], best[1])
        wall = time.perf_counter() - t0
    return {"search": search, "search_new_tokens": search_tokens, "best_batch": best[1],
            "experts_implementation": best[2], "prompts": n, "generated_tokens": tokens, "wall_s": wall,
            "tokens_per_s": rate}


# -- main ----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: build the bench model)")
    ap.add_argument("--preset", choices=("bench", "bench768"), default="bench", help="the model to build")
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out", help="where models, plans, results go")
    ap.add_argument("--workload", choices=tuple(WORKLOADS), default="decode-heavy")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--min-prompt", type=int, default=None)
    ap.add_argument("--max-prompt", type=int, default=None)
    ap.add_argument("--output-tokens", type=int, default=None, help="every request's max_tokens")
    ap.add_argument("--max-batch", type=int, default=1024, help="moecc's B bound (passed to compile)")
    ap.add_argument("--hf-batches", default="32,64,128,256,512", help="static batch sizes to search")
    ap.add_argument("--hf-search-tokens", type=int, default=32, help="new tokens per search run")
    ap.add_argument("--hf-prompts", type=int, default=0,
                    help="prompts for the timed transformers run (default: one batch of the best size; "
                         "give the prompt count for the whole job)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here (default: WORK/throughput.json)")
    a = ap.parse_args(argv)
    w = WORKLOADS[a.workload]
    lo = a.min_prompt or w["min_prompt"]
    hi = a.max_prompt or w["max_prompt"]
    out_lo, out_hi = (a.output_tokens, a.output_tokens) if a.output_tokens else w["output_tokens"]
    a.work.mkdir(parents=True, exist_ok=True)
    model = a.model or build_model(a.work, a.preset)
    cfg = json.loads((model / "config.json").read_text())
    prompts_path = a.work / "prompts.jsonl"
    prompts = write_prompts(prompts_path, a.prompts, lo, hi, out_lo, out_hi, cfg["vocab_size"], a.seed)
    mean_prompt = sum(len(p) for p, _ in prompts) / len(prompts)
    mean_out = sum(m for _, m in prompts) / len(prompts)

    moecc = run_moecc(model, prompts_path, a.work, a.max_batch)
    from moecc_runtime.plan import load_plan
    from moecc_runtime.memory.weights import TORCH_DTYPES

    plan = load_plan(moecc["plan"])
    info = plan["model"]["info"]
    dtype = TORCH_DTYPES[info["dtype"]]
    shapes = gemm_shapes(plan)
    gemm_before = measure_gemm(shapes, dtype)
    hf = None
    if not a.skip_hf:
        batches = [int(b) for b in a.hf_batches.split(",")]
        hf = run_hf(model, prompts, batches, a.hf_search_tokens, a.hf_prompts)
    gemm_after = measure_gemm(shapes, dtype)
    gemm_rate = max(gemm_before["flops_per_s"], gemm_after["flops_per_s"])
    mean_ctx = mean_prompt + (mean_out + 1) / 2
    flops_per_token = gemm_before["matmul_flops_per_token"] + attention_flops_per_token(info, mean_ctx)
    roofline = gemm_rate / flops_per_token
    # the job must also run every prompt token through the model: its own roofline
    job_roofline = roofline * mean_out / (mean_out + mean_prompt)
    res = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "workload": {"name": a.workload, "prompts": a.prompts, "prompt_tokens": [lo, hi],
                     "mean_prompt_tokens": mean_prompt, "output_tokens": [out_lo, out_hi],
                     "mean_output_tokens": mean_out, "dtype": info["dtype"],
                     "model": str(model), "parameters": sum(v["nbytes"] for v in plan["weights"].values())
                     // torch.empty(0, dtype=dtype).element_size()},
        "gemm": {"flops_per_s_before": gemm_before["flops_per_s"], "flops_per_s_after": gemm_after["flops_per_s"],
                 "flops_per_s_used": gemm_rate, "per_shape_before": gemm_before["per_shape_flops_per_s"]},
        "flops_per_generated_token": flops_per_token,
        "roofline_tokens_per_s": roofline,
        "job_roofline_tokens_per_s": job_roofline,
        "moecc": moecc,
        "transformers": hf,
    }
    res["moecc"]["fraction_of_roofline_end_to_end"] = moecc["tokens_per_s"] / roofline
    res["moecc"]["fraction_of_job_roofline_end_to_end"] = moecc["tokens_per_s"] / job_roofline
    if moecc["steady_decode_tokens_per_s"]:
        res["moecc"]["fraction_of_roofline_steady_decode"] = moecc["steady_decode_tokens_per_s"] / roofline
    if hf:
        hf["fraction_of_roofline"] = hf["tokens_per_s"] / roofline
        hf["fraction_of_job_roofline"] = hf["tokens_per_s"] / job_roofline
        res["speedup_vs_transformers"] = moecc["tokens_per_s"] / hf["tokens_per_s"]
    out = a.json or a.work / "throughput.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    print_table(res)
    print(f"\nwrote {out}")
    return 0


def print_table(r: dict[str, Any]) -> None:
    wl, m, hf = r["workload"], r["moecc"], r["transformers"]
    lo, hi = wl["output_tokens"]
    outs = f"{lo}" if lo == hi else f"{lo}-{hi} (mean {wl['mean_output_tokens']:.1f})"
    print(f"\nworkload {wl['name']}: {wl['prompts']} prompts of {wl['prompt_tokens'][0]}-{wl['prompt_tokens'][1]} "
          f"tokens (mean {wl['mean_prompt_tokens']:.1f}), {outs} output tokens, {wl['dtype']}, "
          f"{wl['parameters'] / 1e6:.0f}M parameters")
    print(f"GEMM rate at the model's shapes: {r['gemm']['flops_per_s_before'] / 1e9:.1f} GFLOP/s before, "
          f"{r['gemm']['flops_per_s_after'] / 1e9:.1f} after; {r['flops_per_generated_token'] / 1e6:.1f} MFLOP "
          f"per generated token -> roofline {r['roofline_tokens_per_s']:.1f} tok/s; counting the prompt tokens "
          f"every job must also run: {r['job_roofline_tokens_per_s']:.1f} tok/s\n")
    rows = [("system", "tokens/s", "x transformers", "of roofline", "of job roofline", "notes")]
    if hf:
        rows.append(("transformers generate", f"{hf['tokens_per_s']:.1f}", "1.00", f"{hf['fraction_of_roofline']:.1%}",
                     f"{hf['fraction_of_job_roofline']:.1%}",
                     f"static batch {hf['best_batch']} ({hf['experts_implementation']}), {hf['prompts']} prompts"))
    speed = r.get("speedup_vs_transformers")
    rows.append(("moecc exec (end to end)", f"{m['tokens_per_s']:.1f}", f"{speed:.2f}" if speed else "-",
                 f"{m['fraction_of_roofline_end_to_end']:.1%}", f"{m['fraction_of_job_roofline_end_to_end']:.1%}",
                 f"peak batch {m['peak_batch']}, {m['steps']} steps, {m['wall_s']:.0f} s"))
    if m["steady_decode_tokens_per_s"]:
        rows.append(("moecc steady decode", f"{m['steady_decode_tokens_per_s']:.1f}", "-",
                     f"{m['fraction_of_roofline_steady_decode']:.1%}", "-", f"{m['steady_decode_steps']} steps"))
    rows.append(("roofline", f"{r['roofline_tokens_per_s']:.1f}", "-", "100%", "-", "GEMM rate / FLOPs per token"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(wd) for c, wd in zip(row, widths)))
    print(f"\nhost KV: peak {m['kv_peak_allocated_bytes'] / 2**20:.1f} MiB allocated for "
          f"{m['kv_peak_live_bytes'] / 2**20:.1f} MiB of live tokens ({m['kv_allocated_over_live_at_peak']:.3f}x; "
          f"worst step with >=10% of the batch live: {m['kv_allocated_over_live_max']:.3f}x)")


if __name__ == "__main__":
    sys.exit(main())
