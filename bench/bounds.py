"""How far each peers cell is from this machine's floor: for a `bench/peers.py` result (its JSON),
the job's arithmetic and its unavoidable memory traffic counted from the model's shapes and the
job's prompts, priced at rates measured now, in the same run. Says what 1.3x the best peer asks
of moecc against that floor, and where moecc and the peer stand.

    python bench/bounds.py bench/results/2026-12-06-peers-*-s19.json [--json PATH]

Counted (a lower bound: nothing a real engine can skip, nothing it could avoid):
  - arithmetic: every weight matmul a token goes through (attention's q/k/v/o, the router, its
    top-k experts' gate, up and down; the lm_head once a prompt in prefill, once a row in
    decode) and attention's q.k and p.v at each position's context (causal in prefill);
  - memory: each decode step reads every weight once (at the cells' 96-512 rows a step every
    expert has rows) and every running sequence's KV; each prefill step of --step-tokens tokens reads
    the weights once and writes its tokens' KV. Activations are not counted.
The job runs as peers.py runs it: every prompt prefilled, then all sequences decoding together
(each request generating exactly its max_tokens; the first token comes from its prefill).

Each floor is priced twice: at the GEMM rate oneDNN reaches now at the model's own shapes (the
rate peers.py's roofline uses), and at the arithmetic ceiling measured now (fp32: AVX-512 FMAs on
registers, bench/micro/fma_peak.c; bf16: AMX tile products alone, bench/amx_tiles.c's `peak`; both
built with gcc, on every thread torch runs), which no kernel that loads its operands reaches.

Three floors, in seconds (the table's shares are of `per_step`):
  - `roofline`: max(arithmetic / rate, bytes / read rate) over the whole job (perfect
    overlap, even across steps);
  - `per_step`: that max taken per step and summed (each step's reads overlap its own arithmetic);
  - `serial`: arithmetic / rate + bytes / read rate (a core that never computes and reads at
    once, each at its best rate).
And the most of peers.py's roofline steady decode can reach (decode's arithmetic at the rate over
its per-step floor): where a decode step's bytes take longer at the read rate than its arithmetic
at the rate, no engine's steady decode reaches the roofline's tokens/s.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from amx_tiles import FLOPS_PER_PRODUCT, tile_ns  # noqa: E402
from amx_tiles import build as build_amx_tiles  # noqa: E402
from throughput import attention_flops_per_token, measure_gemm, write_prompts  # noqa: E402

TARGET = 1.3  #: issue 31's ratio over the best peer


@dataclass
class Shapes:
    """The model's sizes that set its work: a Mixtral-shaped decoder."""

    H: int
    inter: int
    layers: int
    experts: int
    top_k: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, preset: str) -> Shapes:
        from moecc.testing.checkpoints import PRESETS

        c = PRESETS[preset][1]
        return cls(c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_local_experts"],
                   c["num_experts_per_tok"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                   c["vocab_size"])

    def gemms(self) -> dict[tuple[int, int], int]:
        """(in, out) of every weight matmul a token goes through in one layer -> times a token
        (shapes that coincide add up)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        out: dict[tuple[int, int], int] = {}
        for shape, times in (((self.H, q + 2 * kv), 1), ((q, self.H), 1), ((self.H, self.experts), 1),
                             ((self.H, 2 * self.inter), self.top_k), ((self.inter, self.H), self.top_k)):
            out[shape] = out.get(shape, 0) + times
        return out

    def token_flops(self) -> float:
        """A token's weight matmuls over the layers, the lm_head aside."""
        return 2.0 * self.layers * sum(k * n * c for (k, n), c in self.gemms().items())

    def head_flops(self) -> float:
        return 2.0 * self.H * self.vocab

    def attention_flops(self, positions: float) -> float:
        """q.k and p.v of one token over `positions` positions, every layer (peers.py's roofline's count)."""
        info = {"num_heads": self.heads, "head_dim": self.head_dim, "num_layers": self.layers}
        return attention_flops_per_token(info, positions)

    def weight_elems(self) -> int:
        """Every weight a decode step reads: attention, router and all experts each layer, the lm_head."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = self.H * (q + 2 * kv) + q * self.H + self.H * self.experts + self.experts * 3 * self.H * self.inter
        return self.layers * layer + self.H * self.vocab

    def kv_elems(self) -> int:
        """KV elements of one position, every layer."""
        return 2 * self.kv_heads * self.head_dim * self.layers


@dataclass
class Work:
    """A phase's arithmetic (FLOPs) and bytes, and its per-step floor at the given rates."""

    flops: float = 0.0
    bytes: float = 0.0
    per_step: float = 0.0

    def add(self, flops: float, nbytes: float, rate: float, bw: float) -> None:
        self.flops += flops
        self.bytes += nbytes
        self.per_step += max(flops / rate, nbytes / bw)


def job_work(m: Shapes, lens: list[int], outs: list[int], itemsize: int, step_tokens: int, rate: float,
             bw: float) -> dict[str, Work]:
    """The job's prefill and decode work (module docstring), every prompt of `lens` generating `outs`."""
    pre, dec = Work(), Work()
    w_bytes, kv_bytes = m.weight_elems() * itemsize, m.kv_elems() * itemsize
    tokens = sum(lens)
    flops = sum(n * m.token_flops() + m.head_flops() + m.attention_flops(n * (n + 1) / 2) for n in lens)
    steps = math.ceil(tokens / step_tokens)
    for s in range(steps):  # the prompts' arithmetic spread evenly over the steps
        part = min(step_tokens, tokens - s * step_tokens) / tokens
        pre.add(flops * part, w_bytes + kv_bytes * tokens * part, rate, bw)
    for s in range(1, max(outs)):  # decode step s: every sequence still generating, at its context
        ctx = [n + s for n, o in zip(lens, outs) if o > s]
        rows = len(ctx)
        f = rows * (m.token_flops() + m.head_flops()) + sum(m.attention_flops(c) for c in ctx)
        dec.add(f, w_bytes + kv_bytes * sum(ctx), rate, bw)
    return {"prefill": pre, "decode": dec}


def floors(work: dict[str, Work], rate: float, bw: float) -> dict[str, float]:
    f = sum(w.flops for w in work.values())
    b = sum(w.bytes for w in work.values())
    return {"roofline": max(f / rate, b / bw), "per_step": sum(w.per_step for w in work.values()),
            "serial": f / rate + b / bw, "compute": f / rate, "memory": b / bw}


def read_rate(mb: int = 1024, seconds: float = 1.0) -> float:
    """Bytes/s of a plain read over a buffer far past the caches, on torch's threads (best pass)."""
    buf = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
    buf.sum()
    best, t0 = 0.0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        s = time.perf_counter()
        buf.sum()
        best = max(best, buf.numel() * 4 / (time.perf_counter() - s))
    return best


def fma_ceiling(tmp: Path, threads: int) -> float | None:
    """FLOP/s of fp32 FMAs on registers over `threads` threads (bench/micro/fma_peak.c); None where it
    does not build or run here (no gcc, no AVX-512)."""
    cc, src, exe = shutil.which("gcc") or shutil.which("cc"), ROOT / "bench" / "micro" / "fma_peak.c", tmp / "fma_peak"
    if cc is None or subprocess.run([cc, "-O2", "-mavx512f", str(src), "-o", str(exe), "-lpthread"]).returncode:
        return None
    r = subprocess.run([str(exe), str(threads), "1.0"], capture_output=True, text=True)
    return float(r.stdout.split()[1]) * 1e9 if r.returncode == 0 else None


def amx_ceiling(tmp: Path, threads: int) -> float | None:
    """FLOP/s of AMX bf16 tile products alone (bench/amx_tiles.c `peak`, one core) times `threads`;
    None without AMX (amx_tiles exits)."""
    try:
        return FLOPS_PER_PRODUCT / (tile_ns(build_amx_tiles(tmp), ["peak"]) * 1e-9) * threads
    except SystemExit:
        return None


def engines(result: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A peers result's moecc row and its best (fastest) peer's row."""
    moecc = next(e for e in result["engines"] if e["engine"].startswith("moecc"))
    peer = min((e for e in result["engines"] if not e["engine"].startswith("moecc")), key=lambda e: e["seconds"])
    return moecc, peer


def priced(result: dict[str, Any], m: Shapes, reqs: list[tuple[list[int], int]], step_tokens: int, rate: float,
           bw: float) -> dict[str, Any]:
    """The job's floors at arithmetic rate `rate`, with moecc's, the best peer's and TARGET x the
    peer's seconds each as the share of the per-step floor they are."""
    itemsize = getattr(torch, result["dtype"]).itemsize
    work = job_work(m, [len(p) for p, _ in reqs], [o for _, o in reqs], itemsize, step_tokens, rate, bw)
    fl = floors(work, rate, bw)
    moecc, peer = engines(result)
    return {"flops_per_s": rate, "flops": {k: w.flops for k, w in work.items()},
            "bytes": {k: w.bytes for k, w in work.items()}, "floors_s": fl,
            "moecc_of_floor": fl["per_step"] / moecc["seconds"], "peer_of_floor": fl["per_step"] / peer["seconds"],
            "need_of_floor": fl["per_step"] * TARGET / peer["seconds"],
            # steady decode's share of peers.py's roofline (arithmetic at `rate`) can be no more than this
            "decode_best_of_roofline": work["decode"].flops / rate / work["decode"].per_step}


def cell(result: dict[str, Any], step_tokens: int, seed: int, rates: dict[str, float | None], bw: float
         ) -> dict[str, Any]:
    """One peers result against its floors, priced at each of `rates` (name -> FLOP/s, None: not
    measured here): moecc's, the best peer's and TARGET x the peer's seconds beside them."""
    m, lo_hi = Shapes.of(result["preset"]), result["prompt_tokens"]
    with tempfile.TemporaryDirectory() as tmp:  # the same prompts peers.py wrote (its seed)
        reqs = write_prompts(Path(tmp) / "p.jsonl", result["prompts"], *lo_hi, *result["output_tokens"], m.vocab, seed)
    moecc, peer = engines(result)
    return {"cell": f"{result['preset']} {result['dtype']} {result['workload']}", "read_bytes_per_s": bw,
            "moecc_s": moecc["seconds"], "peer": peer["engine"], "peer_s": peer["seconds"],
            "need_s": peer["seconds"] / TARGET,
            "at": {name: priced(result, m, reqs, step_tokens, r, bw) for name, r in rates.items() if r}}


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| cell (result) | moecc s | best peer s | 1.3x needs s | at | floors s: roofline / per step / serial "
          "| per-step floor as a share of moecc / peer / 1.3x | decode's best share of the roofline |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for i, (name, p) in enumerate(r["at"].items()):
            f = p["floors_s"]
            head = "| | | | " if i else (f"| {r['cell']} ({r['source']}) | {r['moecc_s']:.2f} | {r['peer_s']:.2f} "
                                         f"| {r['need_s']:.2f} ")
            print(head + f"| {name} {p['flops_per_s'] / 1e9:.0f} GFLOP/s "
                  f"| {f['roofline']:.2f} / {f['per_step']:.2f} / {f['serial']:.2f} "
                  f"| {p['moecc_of_floor']:.0%} / {p['peer_of_floor']:.0%} / {p['need_of_floor']:.0%} "
                  f"| {p['decode_best_of_roofline']:.0%} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="bench/peers.py JSON files")
    ap.add_argument("--step-tokens", type=int, default=8192, help="tokens a prefill step")
    ap.add_argument("--seed", type=int, default=0, help="peers.py's --seed (the prompts)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    results = [(p, json.loads(p.read_text())) for p in a.results]
    threads = torch.get_num_threads()
    bw = read_rate()
    gemm = {(r["preset"], r["dtype"]): 0.0 for _, r in results}
    for preset, d in gemm:  # the GEMM rate at each model's own shapes, in its dtype
        gemm[preset, d] = measure_gemm(Shapes.of(preset).gemms(), getattr(torch, d))["flops_per_s"]
    with tempfile.TemporaryDirectory() as tmp:
        ceiling = {"float32": fma_ceiling(Path(tmp), threads), "bfloat16": amx_ceiling(Path(tmp), threads)}
    print(f"measured now, {threads} threads: read {bw / 1e9:.1f} GB/s; GEMM " +
          ", ".join(f"{p} {d} {r / 1e9:.0f}" for (p, d), r in gemm.items()) + " GFLOP/s; ceilings " +
          ", ".join(f"{d} {(r or 0) / 1e9:.0f}" for d, r in ceiling.items()) + " GFLOP/s", file=sys.stderr)
    rows = []
    for path, r in results:
        rates = {"GEMM": gemm[r["preset"], r["dtype"]], "ceiling": ceiling[r["dtype"]]}
        rows.append({"source": path.name, **cell(r, a.step_tokens, a.seed, rates, bw)})
    print_table(rows)
    out = a.json or ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-bounds.json"
    measured = {"read_bytes_per_s": bw, "gemm_flops_per_s": {f"{p} {d}": r for (p, d), r in gemm.items()},
                "ceiling_flops_per_s": ceiling}
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "threads": threads, "step_tokens": a.step_tokens,
                               **measured, "cells": rows}, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
