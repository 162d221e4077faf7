"""What the stored weight formats buy, measured in one run against the bf16 checkpoint:
host bytes of the weights, bytes copied per decode step under one tight --gpu-mem, and
the CPU throughput cost of dequantizing (tok/s of each format against bf16).

    python bench/weight_formats.py                 # Mixtral-shaped bf16, 4 layers, 128 requests
    python bench/weight_formats.py --json out.json
    python bench/weight_formats.py --micro         # only the dequantize of one expert weight, per format

What it does:
  1. writes a bf16 Mixtral-shaped checkpoint (moecc.testing.checkpoints, --hidden/--inter,
     8 experts top-2, 4 layers), its fine-grained FP8 copy in DeepSeek's published layout
     (moecc.testing.quantized.write_fp8_checkpoint, 128x128 blocks) and its copies in the
     downloaded 4-bit layouts, every Linear but the router and head quantized as the
     libraries publish them (moecc.testing.quantized_libs): GPTQ (4 bits, group 128), AWQ
     (group 128), compressed-tensors W4A16 (pack-quantized, symmetric, group 16) and NVFP4;
  2. compiles eleven plans at one --gpu-mem (the largest of their stated minimums times --slack):
     bf16, int8 and int4 (`moecc compile --quantize`, experts only and --quantize-scope all),
     fp8, gptq, awq, ct-w4 and nvfp4 (as published), and bf16 without a budget (every weight
     read in place);
  3. runs each plan's `moecc exec --stats` on the same prompts (short prompts, --max-tokens
     outputs: decode-heavy), and reads the copy bytes and the decode rate (tokens over seconds
     of the steps without prefill) from the per-step records;
  4. prints a table and writes JSON. MXFP4 (gpt-oss's experts) is not in this run: it needs
     a gpt-oss-shaped model; its stored bytes are 0.53 byte per weight (4 bits and one scale
     byte per 32), as int4's are with its fp32 group scales (4 bits + 4 bytes per 128).
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
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def moecc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moecc.cli", *args], capture_output=True, text=True)


def build(work: Path, hidden: int, inter: int) -> tuple[Path, dict[str, Path]]:
    """(the bf16 checkpoint, its published-layout copies by row name)."""
    from moecc.testing.checkpoints import write_checkpoint
    from moecc.testing.quantized import write_fp8_checkpoint
    from moecc.testing.quantized_libs import (write_awq_checkpoint, write_ct_checkpoint, write_gptq_checkpoint,
                                              write_nvfp4_checkpoint)

    bf16 = write_checkpoint(work / "bf16", "mixtral", dtype="bfloat16", hidden_size=hidden, intermediate_size=inter,
                            num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, num_attention_heads=8,
                            num_key_value_heads=2, vocab_size=2048, max_position_embeddings=256,
                            initializer_range=0.02)
    out = {"fp8": write_fp8_checkpoint(bf16, work / "fp8", block=(128, 128)),
           "gptq": write_gptq_checkpoint(bf16, work / "gptq", bits=4, group=128, dtype="bfloat16"),
           "awq": write_awq_checkpoint(bf16, work / "awq", group=128, dtype="bfloat16"),
           "ct-w4": write_ct_checkpoint(bf16, work / "ct-w4", scheme="w4_group_sym", dtype="bfloat16"),
           "nvfp4": write_nvfp4_checkpoint(bf16, work / "nvfp4", dtype="bfloat16")}
    return bf16, {name: Path(d) for name, d in out.items()}


def write_prompts(path: Path, n: int, max_tokens: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = "the of and a to in is that for it as with was on be by this are from".split()
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
            f.write(json.dumps({"custom_id": f"r{i}", "prompt": text, "max_tokens": max_tokens}) + "\n")


def stated_minimum(model: Path, work: Path, workload: list[str], extra: tuple[str, ...] = ()) -> int:
    """The --gpu-mem the compiler's refusal names as the least that runs `model` (with `extra` options)."""
    from moecc.sizes import parse_size

    r = moecc("compile", str(model), "--gpu-mem", "1", *workload, *extra, "-o", str(work / "refused.pt"))
    m = re.search(r"use --gpu-mem ([0-9.]+[KMGT]?B) or more", r.stderr)
    if m is None:
        raise SystemExit(f"expected a refusal naming the minimum --gpu-mem: {r.stderr}")
    return parse_size(m.group(1))


def run_one(name: str, model: Path, work: Path, prompts: Path, workload: list[str], extra: list[str],
            repeat: int = 1) -> dict[str, Any]:
    """Compile, exec with --stats `repeat` times, and read the figures (the decode rate: the median run's)."""
    import torch

    plan = work / f"{name}.pt"
    c = moecc("compile", str(model), *workload, *extra, "-o", str(plan))
    if c.returncode != 0:
        raise SystemExit(f"compile {name}: {c.stderr}")
    p = torch.load(plan, weights_only=True)
    stats = work / f"{name}.stats.json"
    runs = []
    for _ in range(repeat):
        x = moecc("exec", str(plan), str(prompts), "-o", str(work / f"{name}.jsonl"), "--overwrite", "--stats",
                  str(stats), "-q")
        if x.returncode != 0:
            raise SystemExit(f"exec {name}: {x.stderr[-2000:]}")
        s = json.loads(stats.read_text())
        decode = [r for r in s["engine"].get("records") or [] if r["prefill_tokens"] == 0 and r["decode_tokens"] > 0]
        rate = sum(r["decode_tokens"] for r in decode) / max(sum(r["seconds"] for r in decode), 1e-9)
        runs.append((rate, s, decode))
    runs.sort(key=lambda t: t[0])
    _, s, decode = runs[len(runs) // 2]
    from moecc.views.explain import weight_formats

    experts = weight_formats(p)["experts"]
    return {"format": name, "host_weight_bytes": p["memory"]["host"]["weights"],
            "expert_bytes": experts["stored_bytes"], "expert_formats": experts["formats"],
            "resident": p["arena"]["resident"] if p.get("arena") else ["all"],
            "copy_bytes_per_decode_step": median(r["copy_bytes"] for r in decode) if decode else 0,
            "decode_steps": len(decode),
            "tokens_per_s": sum(r["decode_tokens"] for r in decode) / max(sum(r["seconds"] for r in decode), 1e-9),
            "tokens_per_s_runs": [round(t[0], 1) for t in runs],
            "job_tokens_per_s": s["completion_tokens"] / max(s["seconds"], 1e-9),
            "B": p["batch"]["decode"]["B"]}


def micro(R: int, C: int) -> None:
    """Per-format dequantize of one [R, C] weight to bf16 on one thread, CPU time (time.thread_time:
    robust on a shared machine): each format's `reference` (the whole-tensor torch code) against
    `materialize` into a reused `out` (dequant.c when built), next to a bf16 copy of the weight."""
    import time

    import torch

    from moecc.testing.quantized_libs import awq_pack, gptq_pack, nvfp4_pack
    from moecc_runtime.formats import awq, fp8_block, gptq, int4_group, int8_channel, materialize, mxfp4, nvfp4

    torch.manual_seed(0)
    torch.set_num_threads(1)
    w = torch.randn(R, C) * 0.02  # [R, C]
    gq, aw, nv, (bl, sc) = gptq_pack(w, 4, 128, True, False, True), awq_pack(w, 128), nvfp4_pack(w), mxfp4.quantize(w)

    def ent(fmt: str, shape: list[int], **attrs: Any) -> dict[str, Any]:
        return {"format": fmt, "shape": shape, "logical_shape": [R, C], "format_attrs": attrs}

    cases = {"int8": (ent("int8_channel", [R, C]), int8_channel.quantize(w), int8_channel.reference),
             "int4": (ent("int4_group", [R, C // 2], group=128), int4_group.quantize(w), int4_group.reference),
             "fp8": (ent("fp8_block", [R, C], block=[128, 128]), dict(zip(("data", "scale"), fp8_block.quantize(w))),
                     fp8_block.reference),
             "gptq": (ent("gptq", [C // 8, R], bits=4, group=128, zero_offset=1),
                      {"data": gq["qweight"], "zero": gq["qzeros"], "scale": gq["scales"]}, gptq.reference),
             "awq": (ent("awq_gemm", [C, R // 8], group=128),
                     {"data": aw["qweight"], "zero": aw["qzeros"], "scale": aw["scales"]}, awq.reference),
             "nvfp4": (ent("nvfp4", [R, C // 2]), {"data": nv["weight"], "scale": nv["weight_scale"],
                                                   "scale_2": nv["weight_scale_2"]}, nvfp4.reference),
             "mxfp4": (ent("mxfp4", list(bl.shape)), {"data": bl, "scale": sc}, mxfp4.reference)}

    def cpu_us(fn, n: int) -> float:
        fn()
        best = float("inf")
        for _ in range(3):
            t0 = time.thread_time()
            for _ in range(n):
                fn()
            best = min(best, (time.thread_time() - t0) / n * 1e6)
        return best

    wb = w.bfloat16()
    dst, buf = torch.empty_like(wb), torch.empty(R * C, dtype=torch.bfloat16)
    copy = cpu_us(lambda: dst.copy_(wb), 20)
    print(f"[{R}, {C}] to bf16, one thread, CPU time: bf16 copy of the weight {copy:.0f} us")
    for k, (e, st, ref) in cases.items():
        a = cpu_us(lambda: ref(st, e, torch.bfloat16), 3)
        b = cpu_us(lambda: materialize(e, st, torch.bfloat16, out=buf), 20)
        print(f"{k:6s} reference {a:8.0f} us   materialize into out= {b:6.0f} us   x{a / b:5.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1536)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=1, help="execs of each plan; the median run's figures are reported")
    ap.add_argument("--max-batch", type=int, default=64, help="sequences a decode step holds (compile's --max-batch)")
    ap.add_argument("--slack", type=float, default=1.1, help="--gpu-mem = the largest stated minimum of the plans x this")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--micro", action="store_true", help="only the per-format dequantize of one expert weight "
                                                         "[--inter, --hidden] (CPU time, one thread)")
    a = ap.parse_args()
    if a.micro:
        return micro(a.inter, a.hidden)
    from moecc.sizes import format_bytes

    workload = ["--prompt-tokens", "12", "--output-tokens", str(a.max_tokens), "--max-batch", str(a.max_batch)]
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        bf16, published = build(work, a.hidden, a.inter)
        prompts = work / "prompts.jsonl"
        write_prompts(prompts, a.requests, a.max_tokens)
        # (row, checkpoint, compile options); one --gpu-mem for all: the largest stated minimum x slack
        # (a quantized plan's minimum is above bf16's: it holds the dequantize's temporaries too)
        cases = [("bf16", bf16, ()), ("int8", bf16, ("--quantize", "int8")), ("int4", bf16, ("--quantize", "int4")),
                 ("int8-all", bf16, ("--quantize", "int8", "--quantize-scope", "all")),
                 ("int4-all", bf16, ("--quantize", "int4", "--quantize-scope", "all")),
                 *((name, d, ()) for name, d in published.items())]
        gpu = int(max(stated_minimum(m, work, workload, x) for _, m, x in cases) * a.slack)
        budget = ["--gpu-mem", str(gpu)]
        rows = [run_one("bf16-in-place", bf16, work, prompts, workload, [], a.repeat),
                *(run_one(name, m, work, prompts, workload, budget + list(x), a.repeat) for name, m, x in cases)]
    base = rows[1]
    print(f"--gpu-mem {format_bytes(gpu)} (the largest stated minimum of the plans x {a.slack}); {a.requests} requests x "
          f"{a.max_tokens} tokens, --max-batch {a.max_batch}; decode tok/s: the median of {a.repeat} run(s)")
    print(f"{'format':14s} {'host weights':>12s} {'x smaller':>9s} {'experts x':>9s} {'copied/step':>12s} {'x fewer':>8s} "
          f"{'decode tok/s':>12s} {'vs bf16':>7s} {'resident':>8s}")
    for r in rows:
        hs = base["host_weight_bytes"] / r["host_weight_bytes"]
        cs = (base["copy_bytes_per_decode_step"] / r["copy_bytes_per_decode_step"]
              if r["copy_bytes_per_decode_step"] else float("inf"))
        es = base["expert_bytes"] / r["expert_bytes"]
        r.update(host_ratio=hs, expert_ratio=es, copy_ratio=cs, speed_ratio=r["tokens_per_s"] / base["tokens_per_s"])
        print(f"{r['format']:14s} {format_bytes(r['host_weight_bytes']):>12s} {hs:9.2f} {es:9.2f} "
              f"{format_bytes(r['copy_bytes_per_decode_step']):>12s} {cs:8.2f} {r['tokens_per_s']:12.1f} "
              f"{r['speed_ratio']:7.2f} {len(r['resident']):8d}")
    if a.json:
        a.json.write_text(json.dumps({"bench": "weight_formats", "machine": platform.platform(), "gpu_mem": gpu,
                                      "hidden": a.hidden, "inter": a.inter, "requests": a.requests,
                                      "max_tokens": a.max_tokens, "max_batch": a.max_batch, "repeat": a.repeat, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
