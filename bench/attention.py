"""Decode attention per step: the host kernel over the paged KV pool in place against the
gather path (KV gathered into one buffer, then grouped SDPA), measured in one run.

    python bench/attention.py                          # bench768's attention shape
    python bench/attention.py --contexts 256,1024 --seqs 256
    python bench/attention.py --engine bench/out/model-bench768 --seqs 64 --contexts 256,512
    python bench/attention.py --isas avx2,avx512 --contexts 256,1024 --json bench/results/attention-isa.json

For each context length, B sequences hold that many positions in a pool whose blocks are
handed out in a shuffled order (as a long job leaves them); one decode step of attention
for every sequence (queries already projected) is timed both ways, medians of --repeats,
alternating the two so drift hits both alike. The two outputs are compared. The host kernel
runs once per build the CPU has (baseline, AVX2, AVX-512: runtime/native/isa.py), forced in
turn, for fp32 and bf16 pools (the gather path: fp32 only); per layer and per decode step
(--layers of them). A table is printed and JSON written (--json). Only attention itself is timed: projections, rope and
the KV store are the same for both paths and excluded.

With --prompts LENGTHS prefill attention is timed instead: for each length n, --seqs fresh
prompts of n tokens, every row of each attending its own causal prefix, through the host kernel
(a prompt's consecutive rows grouped, as HostAttention sends prompt chunks of
host_attention.NATIVE_PROMPT_ROWS rows or more) against torch's causal SDPA one prompt a call
(what a prompt alone, or of a length no other shares, runs otherwise), in the pool's dtype; and the
dtype's fresh-prompt kernel where it runs (every prompt in one call, over the prompts' own K/V rows,
as HostAttention sends fresh prompts: bf16 on a CPU with AMX native/prompt_amx.py, fp32 on a CPU
with AVX-512 native/prompt_fp32.py).

    python bench/attention.py --prompts 300,450,600 --seqs 16 --block-size 8

With --engine MODEL_DIR the whole worker runs instead: a plan compiled for the shape, B
prompts of `context` tokens each prefilled, then decode steps, once with attention on the
host and once with today's gather path (`Engine(attention="device")`, which on a CPU gathers
each micro-batch's KV into a buffer); the attention modules' time of one traced decode step
(the KV gather, projections, rope, the KV store and attention, every layer) is compared.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from statistics import median
from typing import Any, Callable

import torch

from moecc_runtime import native
from moecc_runtime.memory.kv import KVPool
from moecc_runtime.worker.attention import attend_decode, kv_view
from moecc_runtime.worker.attention_backends import Where
from moecc_runtime.worker.batch import MicroBatch
from moecc_runtime.worker.host_attention import host_view, prompt_kernel


def micro_batch(B: int, ctx: int, bs: int, num_blocks: int, gen: torch.Generator) -> MicroBatch:
    """B decoding sequences of `ctx` positions each, their blocks drawn from a shuffled pool."""
    per = -(-ctx // bs)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[i * per:(i + 1) * per] for i in range(B)]
    items = [(i, i, ctx - 1, 1) for i in range(B)]
    last = torch.tensor([t[(ctx - 1) // bs] for t in tables])
    return MicroBatch(0, B, items, tables, last, torch.full((B,), (ctx - 1) % bs), Where.HOST)


def time_paths(pool: KVPool, mb: MicroBatch, q: torch.Tensor, a: dict, repeats: int, isas: list[str]
               ) -> dict[str, Any]:
    """Median seconds of the host kernel's builds `isas` over one micro-batch (each forced in
    turn, alternating so drift hits all alike) and, for an fp32 pool, of the gather path."""
    bs = pool.block_size
    out_g = torch.empty(q.shape[0], q.shape[1] * pool.v.shape[-1])
    outs = {name: torch.empty(q.shape[0], q.shape[1], pool.v.shape[-1]) for name in isas}
    kview = kv_view(mb, None, bs)
    hv = host_view(mb, None, bs)
    nb = kview.blocks.numel()
    kbuf = torch.empty(pool.k.shape[1], nb, bs, pool.k.shape[-1], dtype=pool.k.dtype)
    vbuf = torch.empty(pool.v.shape[1], nb, bs, pool.v.shape[-1], dtype=pool.v.dtype)

    def gather() -> None:
        pool.gather(0, kview.blocks, kbuf, vbuf)
        attend_decode(out_g, q, kbuf, vbuf, kview, a, None)

    qk = q.to(pool.k.dtype)  # the queries as the worker hands them over: a bf16 model's in bf16

    def host(name: str) -> Callable[[], None]:
        def run() -> None:
            native.use_attention_isa(name)
            native.paged_attention(qk, pool.k[0], pool.v[0], hv.rows, hv.tables, hv.table_off, hv.ctx, hv.lo,
                                   a["scaling"], outs[name])
        return run

    paths = {name: host(name) for name in isas}
    if pool.k.dtype == torch.float32:
        paths["gather"] = gather
    times: dict[str, list[float]] = {name: [] for name in paths}
    for f in paths.values():
        f()
    for _ in range(repeats):
        for name, f in paths.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    ref = out_g if "gather" in paths else outs[isas[0]].view_as(out_g)
    kv_bytes = mb.r1 * (mb.items[0][2] + 1) * pool.bytes_per_token
    host_s = {name: median(times[name]) for name in isas}
    r: dict[str, Any] = {"kv_bytes": kv_bytes, "isa": {
        name: {"host_s": host_s[name], "host_GBps": kv_bytes / host_s[name] / 1e9,
               "max_abs_diff": (ref - outs[name].view_as(ref)).abs().max().item()} for name in isas}}
    best = isas[-1]
    r.update(host_isa=best, host_s=host_s[best], host_GBps=kv_bytes / host_s[best] / 1e9)
    if "avx512" in host_s and "avx2" in host_s:
        r["avx512_vs_avx2"] = host_s["avx2"] / host_s["avx512"]
    if "gather" in paths:
        r.update(gather_s=median(times["gather"]), speedup=median(times["gather"]) / host_s[best])
    return r


def print_row(r: dict[str, Any], layers: int) -> None:
    """One context's line: per build, ms per layer and per decode step (x layers)."""
    cells = "  ".join(f"{n} {v['host_s'] * 1e3:6.2f} ms/layer {v['host_s'] * layers * 1e3:7.1f} ms/step"
                      for n, v in r["isa"].items())
    extra = f"  avx512 vs avx2 {r['avx512_vs_avx2']:.2f}x" if "avx512_vs_avx2" in r else ""
    if "gather_s" in r:
        extra += f"  gather {r['gather_s'] * 1e3:6.2f} ms/layer ({r['speedup']:.2f}x slower than {r['host_isa']})"
    worst = max(v["max_abs_diff"] for v in r["isa"].values())
    print(f"ctx {r['context']:5d} {r['dtype']:>8}: {cells}{extra}  max|diff| {worst:.1e}")


def engine_attention_s(model: Path, B: int, ctx: int, placement: str) -> dict[str, Any]:
    """Seconds of the attention jobs in one traced decode step of B sequences at ~ctx."""
    from moecc.compiler import compile_model
    from moecc_runtime.engine import Engine, generate
    from moecc_runtime.scheduler.sequence import GenRequest

    plan, _ = compile_model(model, prompt_tokens=ctx, output_tokens=8, max_batch=B)
    gen = torch.Generator().manual_seed(ctx)
    vocab = int(plan["model"]["info"]["vocab_size"])
    reqs = [GenRequest(str(i), torch.randint(3, vocab, (ctx,), generator=gen).tolist(), 6) for i in range(B)]
    engine = Engine(plan, model, "cpu", record_steps=True, attention=placement)
    try:
        generate(engine, reqs, lambda r: None, max_batch=B)
        step = engine.stats.timeline["decode"]
    finally:
        engine.close()
    return {"attention_s": attention_module_s(step["jobs"]), "step_s": step["step_s"], "sequences": step["sequences"],
            "context": step["context"]}


def attention_module_s(jobs: list[list[Any]]) -> float:
    """Seconds the attention modules took, every layer: from the end of the job before a
    module's first (the KV gather, untraced on a CPU, happens in that gap) to its last job's end.
    Jobs: [name, lane, kind, layer, start, seconds]."""
    jobs = sorted((j for j in jobs if j[1] == "compute"), key=lambda j: j[4])
    total, i = 0.0, 0
    while i < len(jobs):
        if ".attn" not in jobs[i][0]:
            i += 1
            continue
        begin = jobs[i - 1][4] + jobs[i - 1][5] if i else jobs[i][4]
        while i < len(jobs) and ".attn" in jobs[i][0]:
            end = jobs[i][4] + jobs[i][5]
            i += 1
        total += end - begin
    return total


def run_engine(model: Path, B: int, contexts: list[int]) -> list[dict[str, Any]]:
    rows = []
    for ctx in contexts:
        host, gather = engine_attention_s(model, B, ctx, "host"), engine_attention_s(model, B, ctx, "device")
        r = {"context": ctx, "sequences": B, "host": host, "gather": gather,
             "speedup": gather["attention_s"] / host["attention_s"]}
        rows.append(r)
        print(f"ctx {ctx:5d}, {B} sequences: attention per decode step: gather {gather['attention_s'] * 1e3:7.1f} ms "
              f"(step {gather['step_s'] * 1e3:.0f} ms)  host {host['attention_s'] * 1e3:7.1f} ms "
              f"(step {host['step_s'] * 1e3:.0f} ms)  speedup {r['speedup']:.2f}x")
    return rows


def time_prompts(n: int, S: int, dtype: torch.dtype, args: argparse.Namespace, gen: torch.Generator,
                 repeats: int) -> dict[str, Any]:
    """Median seconds of one layer's prefill attention for S fresh prompts of n tokens: the host
    kernel over every row (grouped) against causal SDPA per prompt; and their largest difference."""
    bs, Hq, Hkv, D = args.block_size, args.heads, args.kv_heads, args.head_dim
    per = -(-n // bs)
    pool = KVPool(1, Hkv, D, block_size=bs, num_blocks=S * per, dtype=dtype)
    pool.k.normal_(generator=gen), pool.v.normal_(generator=gen)
    order = torch.randperm(S * per, generator=gen)
    tables = [order[i * per:(i + 1) * per] for i in range(S)]
    q = torch.randn(S * n, Hq, D, generator=gen).to(dtype)  # [S*n, Hq, D]: the prompts' rows
    rows = torch.arange(S * n)
    table_off = torch.repeat_interleave(torch.arange(S) * per, n)
    ctx = torch.arange(1, n + 1).repeat(S)
    lo = torch.zeros(S * n, dtype=torch.long)
    flat = torch.cat(tables)
    # each prompt's own K/V, contiguous [1, Hkv, n, D]: what SDPA reads (gathered outside the timing)
    ks = [pool.k[0][:, t].flatten(1, 2)[None, :, :n] for t in tables]
    vs = [pool.v[0][:, t].flatten(1, 2)[None, :, :n] for t in tables]
    out_k = torch.empty(S * n, Hq, D)
    out_s = torch.empty(S * n, Hq, D, dtype=dtype)
    scale = D ** -0.5

    def kernel() -> None:
        native.paged_attention(native.kernel_queries(q), pool.k[0], pool.v[0], rows, flat, table_off, ctx, lo, scale,
                               out_k)  # as the worker hands them over

    # the prompts' own K/V as the layer's new rows [S*n, Hkv, D]: what a prompt kernel reads
    k_rows = torch.cat([k[0].transpose(0, 1) for k in ks])
    v_rows = torch.cat([v[0].transpose(0, 1) for v in vs])
    spans = [(i * n, (i + 1) * n) for i in range(S)]
    out_a = torch.empty(S * n, Hq, D, dtype=dtype)
    pk = prompt_kernel(dtype)[0]
    pk = pk if pk is not None and pk.available() else None

    def prompts() -> None:
        assert pk.attend(q, k_rows, v_rows, spans, scale, out_a)

    def sdpa() -> None:
        for i in range(S):
            qi = q[i * n:(i + 1) * n].transpose(0, 1)[None]  # [1, Hq, n, D]
            o = torch.nn.functional.scaled_dot_product_attention(qi, ks[i], vs[i], is_causal=True, scale=scale,
                                                                 enable_gqa=True)
            out_s[i * n:(i + 1) * n] = o[0].transpose(0, 1)

    paths = (("kernel", kernel), ("sdpa", sdpa)) + ((("prompts", prompts),) if pk else ())
    times: dict[str, list[float]] = {name: [] for name, _ in paths}
    for _, f in paths:
        f()
    for _ in range(repeats):
        for name, f in paths:
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    k_s, s_s = median(times["kernel"]), median(times["sdpa"])
    flops = 4.0 * S * Hq * D * n * (n + 1) / 2
    r = {"prompt_tokens": n, "prompts": S, "dtype": str(dtype).removeprefix("torch."), "kernel_s": k_s,
         "sdpa_s": s_s, "speedup": s_s / k_s, "kernel_GFLOPs": flops / k_s / 1e9, "sdpa_GFLOPs": flops / s_s / 1e9,
         "max_abs_diff": (out_k - out_s.float()).abs().max().item()}
    if pk:  # the dtype's prompt kernel: every prompt in one call
        a_s = median(times["prompts"])
        r.update(prompt_kernel=pk.__name__.rsplit(".", 1)[-1], prompt_kernel_s=a_s, prompt_kernel_speedup=s_s / a_s,
                 prompt_kernel_GFLOPs=flops / a_s / 1e9,
                 prompt_kernel_max_abs_diff=(out_a.float() - out_s.float()).abs().max().item())
    return r


def run_prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype in args.dtypes.split(","):
        for n in (int(x) for x in args.prompts.split(",")):
            r = time_prompts(n, args.seqs, getattr(torch, dtype), args, gen, args.repeats)
            rows.append(r)
            print(f"prompts of {n:4d} {r['dtype']:>8} x{r['prompts']}: kernel {r['kernel_s'] * 1e3:7.2f} ms/layer "
                  f"({r['kernel_GFLOPs']:.0f} GFLOP/s)  SDPA {r['sdpa_s'] * 1e3:7.2f} ms/layer ({r['sdpa_GFLOPs']:.0f} "
                  f"GFLOP/s)  kernel {r['speedup']:.2f}x  max|diff| {r['max_abs_diff']:.1e}"
                  + (f"  {r['prompt_kernel']} {r['prompt_kernel_s'] * 1e3:7.2f} ms/layer ({r['prompt_kernel_GFLOPs']:.0f} "
                     f"GFLOP/s) {r['prompt_kernel_speedup']:.2f}x SDPA, max|diff| {r['prompt_kernel_max_abs_diff']:.1e}"
                     if "prompt_kernel_s" in r else ""))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=256, help="decoding sequences (B)")
    ap.add_argument("--contexts", default="64,256,512,1024")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--isas", default="", help="the kernel's builds to compare, e.g. avx2,avx512 (default: every "
                    "one this CPU runs)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="KV pool dtypes (the gather path: fp32 only)")
    ap.add_argument("--layers", type=int, default=8, help="layers per decode step (bench768: 8)")
    ap.add_argument("--engine", type=Path, default=None, help="a checkpoint: time the whole worker's attention")
    ap.add_argument("--prompts", default="", help="prompt lengths: time prefill attention (kernel against SDPA)")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "out" / "attention.json")
    args = ap.parse_args(argv)
    if args.engine is not None:
        rows = run_engine(args.engine, args.seqs, [int(c) for c in args.contexts.split(",")])
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": {"cpu": platform.processor() or platform.machine(),
                                                     "threads": torch.get_num_threads()},
                                         "model": str(args.engine), "per_step": rows}, indent=1))
        print(f"wrote {args.json}")
        return 0
    if not native.available():
        raise SystemExit("bench/attention.py: the native kernel is not built (pip install the project)")
    if args.prompts:
        rows = run_prompts(args)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": {"cpu": platform.processor() or platform.machine(),
                                                     "threads": torch.get_num_threads()},
                                         "shape": {"heads": args.heads, "kv_heads": args.kv_heads,
                                                   "head_dim": args.head_dim, "block_size": args.block_size},
                                         "prefill_per_layer": rows}, indent=1))
        print(f"wrote {args.json}")
        return 0
    isas = args.isas.split(",") if args.isas else native.attention_isas()
    before = native.attention_isa()
    gen = torch.Generator().manual_seed(0)
    a = {"scaling": args.head_dim ** -0.5}
    rows = []
    for dtype in args.dtypes.split(","):
        for ctx in (int(c) for c in args.contexts.split(",")):
            per = -(-ctx // args.block_size)
            pool = KVPool(1, args.kv_heads, args.head_dim, block_size=args.block_size, num_blocks=args.seqs * per,
                          dtype=getattr(torch, dtype))
            pool.k.normal_(generator=gen), pool.v.normal_(generator=gen)
            mb = micro_batch(args.seqs, ctx, args.block_size, pool.num_blocks, gen)
            q = torch.randn(args.seqs, args.heads, args.head_dim, generator=gen)
            r = {"context": ctx, "dtype": dtype, **time_paths(pool, mb, q, a, args.repeats, isas)}
            rows.append(r)
            print_row(r, args.layers)
    native.use_attention_isa(before)
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "isas": native.attention_isas(), "default_isa": before},
              "shape": {"seqs": args.seqs, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                        "block_size": args.block_size, "layers": args.layers},
              "per_layer": rows,
              "per_step_s": [{"context": r["context"], "dtype": r["dtype"],
                              **{n: v["host_s"] * args.layers for n, v in r["isa"].items()}} for r in rows]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
