"""The AMX tile loop's ceilings on this CPU against what the fused expert reaches, in one run.

    python bench/amx_tiles.py
    python bench/amx_tiles.py --json bench/results/amx-tiles.json

Builds bench/amx_tiles.c (gcc, into a temporary folder) and times, on one core, ns a tile
product (TDPBF16PS: 16x16x32 bf16, 16,384 FLOPs) of the 2x2 blocking that
runtime/native/expert_amx.c uses, one cost added at a time: the products alone (`peak`, the
baseline every row is a share of), operands loaded from L1, A streamed from L2, C stored every
8 or 24 steps, and expert_amx.c's own loop (C spilled after each block of 8 input steps and
loaded back). Then the fused expert itself (native/expert_amx.layer: 8 experts of hidden 768,
intermediate 1,152, top-2, as the bench768 model) over a prefill step's 8,192 tokens and a
decode step's 512, on both cores, as ns a product a core. Medians of --repeats. Needs AMX
(exits with a message elsewhere); never part of CI.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FLOPS_PER_PRODUCT = 2 * 16 * 16 * 32

#: (row name, what it adds, amx_tiles.c's arguments)
PATTERNS = [
    ("peak", "products alone", ["peak"]),
    ("l1", "A, B loaded from L1 (8 KB rings)", ["l1"]),
    ("stream", "A streamed from 768 KB (L2), B from L1", ["stream", "768"]),
    ("store 24", "stream, C stored every 24 steps", ["store", "768", "24"]),
    ("store 8", "stream, C stored every 8 steps", ["store", "768", "8"]),
    ("kernel K768", "expert_amx.c's loop: 512 rows, K 768, blocks of 8", ["kernel", "32", "24", "8", "32"]),
    ("kernel K1152", "expert_amx.c's loop: 512 rows, K 1,152, blocks of 8", ["kernel", "32", "36", "8", "32"]),
]


def build(tmp: Path) -> Path:
    """amx_tiles.c compiled into `tmp`; exits with the compiler's message where it fails."""
    exe = tmp / "amx_tiles"
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        sys.exit("amx_tiles: no C compiler (gcc or cc) on PATH")
    src = Path(__file__).with_name("amx_tiles.c")
    r = subprocess.run([cc, "-O2", "-std=gnu11", str(src), "-o", str(exe)], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"amx_tiles: building {src} failed:\n{r.stderr}")
    return exe


def tile_ns(exe: Path, args: list[str]) -> float:
    """One run of a pattern on one core: ns a product."""
    r = subprocess.run(["taskset", "-c", "0", str(exe), *args] if shutil.which("taskset") else [str(exe), *args],
                       capture_output=True, text=True)
    if r.returncode == 2:
        sys.exit("amx_tiles: this CPU or OS has no AMX tiles (CPUID 7.0 EDX bits 22, 24; arch_prctl)")
    if r.returncode:
        sys.exit(f"amx_tiles: {exe.name} {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return float(r.stdout)


def expert_ns(T: int, repeats: int) -> float | None:
    """The fused expert over T tokens (bench768's layer shape), both cores: ns a product a core;
    None where the kernel does not run here."""
    import torch

    from moecc_runtime.memory.packed_weights import PackedLinear
    from moecc_runtime.native import expert_amx

    g = torch.Generator().manual_seed(0)
    H, inter, E = 768, 1152, 8
    weights = {e: (PackedLinear((torch.randn(2 * inter, H, generator=g) * 0.03).bfloat16(), 1024, split=inter), None,
                   PackedLinear((torch.randn(H, inter, generator=g) * 0.03).bfloat16(), 1024)) for e in range(E)}
    x = torch.randn(T, H, generator=g).bfloat16()  # [T, H]
    top_w, top_i = torch.softmax(torch.randn(T, E, generator=g), -1).topk(2, -1)  # [T, 2]
    counts = torch.bincount(top_i.reshape(-1), minlength=E).tolist()
    out = torch.zeros_like(x)
    if not expert_amx.layer(x, top_w, top_i, counts, weights, out):
        return None
    times = []
    for _ in range(max(3, repeats * (1 if T > 1024 else 10))):
        out.zero_()
        t = time.perf_counter()
        expert_amx.layer(x, top_w, top_i, counts, weights, out)
        times.append(time.perf_counter() - t)
    products = 2 * T * 2 * 3 * H * inter / FLOPS_PER_PRODUCT
    return statistics.median(times) * torch.get_num_threads() / products * 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs of each pattern (the median is reported)")
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "out" / "amx-tiles.json")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        runs = {name: [] for name, _, _ in PATTERNS}
        for _ in range(args.repeats):  # patterns alternated so drift hits all alike
            for name, _, cargs in PATTERNS:
                runs[name].append(tile_ns(exe, cargs))
    for name, what, _ in PATTERNS:
        rows.append({"row": name, "what": what, "ns_per_product": statistics.median(runs[name])})
    for T in (8192, 512):
        ns = expert_ns(T, args.repeats)
        if ns is not None:
            rows.append({"row": f"expert T={T}", "what": f"native/expert_amx.layer, {T} tokens, both cores",
                         "ns_per_product": ns})
    peak = rows[0]["ns_per_product"]
    print(f"{'row':14s} {'ns a product':>12s} {'of peak':>8s} {'TFLOP/s a core':>15s}  what")
    for r in rows:
        r["of_peak"] = peak / r["ns_per_product"]
        r["tflops_per_core"] = FLOPS_PER_PRODUCT / r["ns_per_product"] / 1e3
        print(f"{r['row']:14s} {r['ns_per_product']:12.2f} {r['of_peak']:8.0%} {r['tflops_per_core']:15.2f}  {r['what']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": {"cpu": platform.processor() or platform.machine()},
                                     "repeats": args.repeats, "rows": rows}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
