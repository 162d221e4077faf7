"""The host's element-wise passes against torch's own, measured in one run: the experts' silu and
product and weighted sum (runtime/native/expert_rows.c), the rotary embedding (rope.c), the
RMSNorm against kernels' NORM_ROWS-chunked torch passes (rmsnorm.c), a
layer of packed experts (kernels.experts) with its rows gathered straight into the GEMMs' padded
row count against gathered alone, and a step's 8 layers of packed experts against oneDNN's GEMMs
and the passes between them (every layer's weights distinct, so they stream from memory as in a
job): on a CPU with AMX in bf16 each expert in one fused call (expert_amx.c), on a CPU with
AVX-512 in fp32 each layer in one call (expert_fp32.c). Every pair is checked bit-equal before it
is timed (the fused experts: as close to the exact result as the unfused path, since oneDNN
splits these GEMMs' sums between threads and the fp32 kernel has its own exp); the two sides run
interleaved, and the table gives medians and their ratio.

    python bench/host_passes.py [--rows 128,2048] [--tokens 96,512,8192] [--repeats 7] [--json PATH]

Shapes are bench768's (hidden 768, intermediate 1,152, 8 experts top-2, 8 query and 2 KV heads
of 96), bf16 unless a row says fp32. Writes bench/out/host_passes.json unless --json says where.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from moecc_runtime.memory.packed_weights import PackedLinear
from moecc_runtime.native import expert_amx, expert_fp32, expert_rows, rmsnorm, rope
from moecc_runtime.worker import kernels

H, I, E, K, HQ, HKV, D = 768, 1152, 8, 2, 8, 2, 96


#: the switch of each dtype's fused expert kernel (bf16: one AMX call an expert, fp32: one call a layer)
SWITCH = {torch.bfloat16: "MOECC_EXPERT_AMX", torch.float32: "MOECC_EXPERT_FP32"}


@contextmanager
def fused_expert(on: str, switch: str = "MOECC_EXPERT_AMX") -> Iterator[None]:
    """The environment variable `switch` set to `on` ("1" or "0") inside, as it was after."""
    before = os.environ.get(switch)
    os.environ[switch] = on
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(switch)
        else:
            os.environ[switch] = before


def timed_pair(a: Callable[[], Any], b: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Medians (ms) of a and b, each call of one timed right after one of the other."""
    ta, tb = [], []
    for f in (a, b):
        f()
    for _ in range(repeats):
        for f, acc in ((a, ta), (b, tb)):
            t = time.perf_counter()
            f()
            acc.append((time.perf_counter() - t) * 1e3)
    return sorted(ta)[repeats // 2], sorted(tb)[repeats // 2]


def silu_rows(rows: int, repeats: int) -> dict[str, Any]:
    gu = torch.randn(rows, 2 * I).to(torch.bfloat16)  # [R, 2I]

    def torch_pass() -> torch.Tensor:
        h = F.silu(gu[:, :I])
        return h.mul_(gu[:, I:])

    assert torch.equal(expert_rows.silu_mul(gu, I), torch_pass())
    native, ref = timed_pair(lambda: expert_rows.silu_mul(gu, I), torch_pass, repeats)
    return {"pass": "silu * up", "shape": f"[{rows}, {2 * I}] bf16", "native_ms": native, "torch_ms": ref}


def weighted_sum_rows(rows: int, repeats: int) -> dict[str, Any]:
    T = max(rows * 4, 512)
    out = torch.zeros(T, H, dtype=torch.bfloat16)  # [T, H]
    tok = torch.randperm(T)[:rows]  # [n]
    y, w = torch.randn(rows, H).to(torch.bfloat16), torch.rand(rows)  # [n, H], [n]

    def torch_pass() -> None:
        yy = y.clone()  # torch's pass scales y in place
        yy.mul_(w[:, None])
        out.index_add_(0, tok, yy)

    a, b = torch.zeros_like(out), torch.zeros_like(out)
    expert_rows.scale_add_rows(a, tok, y, w)
    yy = y.clone()
    yy.mul_(w[:, None])
    b.index_add_(0, tok, yy)
    assert torch.equal(a, b)
    native, ref = timed_pair(lambda: expert_rows.scale_add_rows(out, tok, y, w), torch_pass, repeats)
    return {"pass": "weighted rows into the output", "shape": f"[{rows}, {H}] bf16", "native_ms": native,
            "torch_ms": ref}


def rope_rows(rows: int, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    qkv = torch.randn(rows, (HQ + 2 * HKV) * D).to(dtype)  # [T, (Hq + 2 Hkv) D]: a packed GEMM's output
    x = qkv.as_strided((rows, HQ + HKV, D), (qkv.stride(0), D, 1))  # [T, Hq + Hkv, D]: q and k
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    table = kernels.rope_table(torch.arange(rows), inv, 1.0, dtype)  # [T, 2D]
    cos, sin = table[:, :D], table[:, D:]
    native_pass = lambda: rope.rope(x, cos, sin)  # noqa: E731

    def torch_pass() -> torch.Tensor:
        module = rope._module
        rope._module = lambda: None  # apply_rope's own torch passes
        try:
            return kernels.apply_rope(x, cos, sin)
        finally:
            rope._module = module

    assert torch.equal(native_pass(), torch_pass())
    native, ref = timed_pair(native_pass, torch_pass, repeats)
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    return {"pass": "rotary embedding", "shape": f"[{rows}, {HQ + HKV}, {D}] {name}", "native_ms": native,
            "torch_ms": ref}


def norm_rows(rows: int, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    x = torch.randn(rows, H).to(dtype)  # [T, H]
    w = torch.randn(H).to(dtype)  # [H]
    native_pass = lambda: rmsnorm.rmsnorm(x, w, 1e-5)  # noqa: E731

    def torch_pass() -> torch.Tensor:
        module = rmsnorm._module
        rmsnorm._module = lambda: None  # kernels.rmsnorm's own torch passes, NORM_ROWS rows at a time
        try:
            return kernels.rmsnorm(x, w, 1e-5)
        finally:
            rmsnorm._module = module

    assert torch.equal(native_pass(), torch_pass())
    native, ref = timed_pair(native_pass, torch_pass, repeats)
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    return {"pass": "RMSNorm", "shape": f"[{rows}, {H}] {name}", "native_ms": native, "torch_ms": ref}


def experts_layer(tokens: int, repeats: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    bank = []
    for _ in range(E):
        gu = (torch.randn(2 * I, H, generator=g) * 0.02).to(torch.bfloat16)
        down = (torch.randn(H, I, generator=g) * 0.02).to(torch.bfloat16)
        bank.append((PackedLinear(gu, tokens, split=I, sections=(I, I)), None, PackedLinear(down, tokens)))
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    top_w, top_i = torch.topk(torch.randn(tokens, E, generator=g).softmax(-1), K)  # [T, k]
    padded = kernels._gather_rows

    def run(gather: Callable[..., torch.Tensor]) -> torch.Tensor:
        kernels._gather_rows = gather
        try:
            return kernels.experts(x, top_w, top_i, lambda used: (bank[e] for e in used), E, "silu", 4096)[0]
        finally:
            kernels._gather_rows = padded

    alone = lambda x, tok, w: x.index_select(0, tok)  # noqa: E731
    with fused_expert("0"):  # the GEMMs' own inputs (the fused expert gathers its own)
        assert torch.equal(run(padded), run(alone))
        native, ref = timed_pair(lambda: run(padded), lambda: run(alone), repeats)
    return {"pass": "a layer of packed experts, rows gathered into the GEMMs' padded rows",
            "shape": f"{tokens} tokens, {E} experts top-{K}", "native_ms": native, "torch_ms": ref}


def fused_experts_step(tokens: int, repeats: int, dtype: torch.dtype = torch.bfloat16,
                       layers: int = 8) -> dict[str, Any]:
    """A decode step's experts over `layers` layers of distinct weights, the dtype's fused kernel
    (SWITCH: bf16 each expert one AMX call, expert_amx.c; fp32 each layer one call read in place,
    expert_fp32.c) against oneDNN's two GEMMs an expert and the passes between them; ms per layer."""
    g = torch.Generator().manual_seed(1)
    banks = [[(PackedLinear((torch.randn(2 * I, H, generator=g) * 0.02).to(dtype), 128, split=I,
                            sections=(I, I)), None,
               PackedLinear((torch.randn(H, I, generator=g) * 0.02).to(dtype), 128)) for _ in range(E)]
             for _ in range(layers)]
    x = torch.randn(tokens, H, generator=g).to(dtype)  # [T, H]
    top_w, top_i = torch.topk(torch.randn(tokens, E, generator=g).softmax(-1), K)  # [T, k]
    together = dtype == torch.float32  # the fp32 kernel runs a whole layer read in place

    def step(on: str) -> list[torch.Tensor]:
        with fused_expert(on, SWITCH[dtype]):
            return [kernels.experts(x, top_w, top_i, lambda used, b=bank: (b[e] for e in used), E, "silu", 4096,
                                    together=together)[0] for bank in banks]

    exact = _exact_experts(x, top_w, top_i, banks[0])
    err = [(o.double() - exact).abs().mean().item() for o in (step("1")[0], step("0")[0])]
    assert err[0] <= (1.05 if dtype == torch.bfloat16 else 1.5) * err[1], \
        f"the fused experts' mean error {err[0]} against the unfused {err[1]}"
    native, ref = timed_pair(lambda: step("1"), lambda: step("0"), repeats)
    kind = "each expert one fused AMX call" if dtype == torch.bfloat16 else "each layer one fp32 call"
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    return {"pass": f"a step's packed experts, {kind} (ms a layer)",
            "shape": f"{tokens} tokens, {E} experts top-{K} {name}", "native_ms": native / layers,
            "torch_ms": ref / layers}


def _exact_experts(x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, bank: list) -> torch.Tensor:
    """The layer's experts in fp64 from the same weights (oneDNN's packed copies unpacked)."""
    out = torch.zeros(x.shape, dtype=torch.float64)  # [T, H]
    for e, (gu, _, down) in enumerate(bank):
        tok, slot = (top_i == e).nonzero(as_tuple=True)
        if not tok.numel():
            continue
        gu_w, down_w = gu.packed.to_dense().double(), down.packed.to_dense().double()  # [2I, H], [H, I]
        z = x[tok].double() @ gu_w.T  # [n, 2I]
        y = (F.silu(z[:, :I]) * z[:, I:]) @ down_w.T  # [n, H]
        out.index_add_(0, tok, top_w[tok, slot].double()[:, None] * y)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="128,2048", help="rows of an expert (silu, weighted sum)")
    ap.add_argument("--tokens", default="96,512,8192", help="a step's tokens (rope, norm, a layer of experts)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, default=Path("bench/out/host_passes.json"))
    a = ap.parse_args(argv)
    if expert_rows._module() is None or rope._module() is None or rmsnorm.sum_lanes() is None:
        raise SystemExit("host_passes: the native passes were not built (pip install the project with a C compiler)")
    rows = [int(r) for r in a.rows.split(",")]
    tokens = [int(t) for t in a.tokens.split(",")]
    table = [f(r, a.repeats) for r in rows for f in (silu_rows, weighted_sum_rows)]
    table += [rope_rows(t, dt, a.repeats) for t in tokens for dt in (torch.bfloat16, torch.float32)]
    table += [norm_rows(t, dt, a.repeats) for t in tokens for dt in (torch.bfloat16, torch.float32)]
    table += [experts_layer(t, a.repeats) for t in tokens]
    if expert_amx._module() is not None:
        table += [fused_experts_step(t, a.repeats) for t in tokens if t <= 4 * expert_amx.MAX_ROWS]
    if expert_fp32._module() is not None:
        table += [fused_experts_step(t, a.repeats, torch.float32) for t in tokens if t <= 4 * expert_fp32.MAX_ROWS]
    print(f"{'pass':<70} {'shape':<30} {'new ms':>8} {'before ms':>9} {'x':>6}")
    for r in table:
        r["speedup"] = r["torch_ms"] / r["native_ms"]
        print(f"{r['pass']:<70} {r['shape']:<30} {r['native_ms']:8.3f} {r['torch_ms']:9.3f} {r['speedup']:6.2f}")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                  "threads": torch.get_num_threads(), "repeats": a.repeats, "rows": table}, indent=1))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
