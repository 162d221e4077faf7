"""Two builds of a fused expert kernel on the same layer, in one run: a step's routed experts over
--layers layers of distinct weights (so they stream from memory as in a job), the build under
test (this tree's) against another build of the same extension (--old: a .so built from an
earlier commit), alternated call for call so this machine's drift hits both alike. Every output
is checked bit-equal before anything is timed; a change that moves a bit is refused.

    git worktree add /tmp/moecc-old REV && (cd /tmp/moecc-old && python setup.py build_ext --inplace)
    python bench/kernel_ab.py --kernel amx --old /tmp/moecc-old/runtime/native/_expert_amx*.so \
        [--tokens 96,512,2048,8192] [--json PATH]

Or this tree's build against itself with one of the wrapper's integer settings otherwise for the
"old" side (no --old): `--old-set DEAL_EXPERTS=1000000` (expert_amx.py's dealing of whole experts
to the threads, off).

--kernel amx: bf16, one AMX call per layer (native/expert_amx.py); fp32: one AVX-512 call per layer
(native/expert_fp32.py). Shapes are bench768's experts (hidden 768, intermediate 1,152, 8 experts
top-2) unless --hidden/--inter say otherwise. Prints ms a layer and the ratio old / new (above 1:
the tree's build is faster), medians of --repeats, and writes JSON (--json).

--kernel linear: the bf16 projection (native/linear_amx.py, `_linear_amx`) at each of --shapes
(rows x inputs x outputs), ms a call (five calls a timing), the outputs checked equal the same way.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from types import ModuleType
from typing import Any

import torch

from moecc_runtime.memory.packed_weights import PackedLinear
from moecc_runtime.native import expert_amx, expert_fp32, linear_amx, threads

KERNELS = {"amx": (expert_amx, "_expert_amx", torch.bfloat16), "fp32": (expert_fp32, "_expert_fp32", torch.float32)}
E, K = 8, 2


def load_build(path: Path, name: str) -> ModuleType:
    """Extension `name` imported from the file at `path`, on torch's OpenMP team (as the runtime runs it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"kernel_ab: {path} is not an extension module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    threads.hand_over(ctypes.CDLL(str(path)))
    return mod


def two_builds(wrapper: ModuleType, name: str, old: Path | None) -> dict[str, ModuleType]:
    """{"old": build `old` (None: this tree's again), "new": this tree's} of extension `name`,
    whose wrapper module is `wrapper`."""
    built = wrapper._module()
    if built is None:
        raise SystemExit(f"kernel_ab: this tree's {name} does not run here")
    new_path = Path(built.__file__)
    return {"old": load_build(old or new_path, name), "new": load_build(new_path, name)}


def alternated(run: Callable[[str], object], repeats: int, per: int) -> dict[str, float]:
    """run("old") and run("new") timed in turn, `repeats` times each (one timing covers `per`
    layers or calls): their medians in ms a layer or call, and old / new."""
    times: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(repeats):
        for k, ts in times.items():
            t0 = time.perf_counter()
            run(k)
            ts.append((time.perf_counter() - t0) / per)
    r = {"old_ms": median(times["old"]) * 1e3, "new_ms": median(times["new"]) * 1e3}
    r["old_over_new"] = r["old_ms"] / r["new_ms"]
    return r


def checked_row(key: dict[str, Any], label: str, at: str, unit: str, same: bool, run: Callable[[str], object],
                repeats: int, per: int) -> dict[str, Any]:
    """One case's row: refused (SystemExit) unless the builds' outputs were the same bits (`same`,
    `at` names the case), then `key` with `alternated(run, repeats, per)`, printed as `label`'s
    line (ms a `unit`)."""
    if not same:
        raise SystemExit(f"kernel_ab: the two builds' outputs differ at {at}: not the same bits")
    r = {**key, **alternated(run, repeats, per)}
    print(f"{label}: old {r['old_ms']:8.3f} ms a {unit}  new {r['new_ms']:8.3f}  "
          f"old/new {r['old_over_new']:.3f}  (same bits)", flush=True)
    return r


def run_layers(wrapper: ModuleType, mod: ModuleType, x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor,
               banks: list[list[tuple[Any, ...]]], settings: dict[str, int] | None = None) -> list[torch.Tensor]:
    """Every layer's experts through build `mod` (wrapper's `layer`), with the wrapper's `settings`
    (module attributes, put back after): each layer's output [T, H]."""
    wrapper._module = lambda: mod  # the wrapper's checks and scratch, this build's call
    counts = torch.bincount(top_i.flatten(), minlength=E).tolist()
    saved = {k: getattr(wrapper, k) for k in settings or {}}
    outs = []
    try:
        for k, v in (settings or {}).items():
            setattr(wrapper, k, v)
        for bank in banks:
            out = torch.zeros_like(x)
            if not wrapper.layer(x, top_w, top_i, counts, dict(enumerate(bank)), out):
                raise SystemExit("kernel_ab: the kernel declined the layer (not built for this CPU?)")
            outs.append(out)
    finally:
        for k, v in saved.items():
            setattr(wrapper, k, v)
    return outs


def compare(kernel: str, old: Path | None, tokens: list[int], layers: int, H: int, I: int, repeats: int,
            old_set: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Per token count: ms a layer of the old build (None: this tree's, with the wrapper settings
    `old_set`) and of this tree's, and their ratio."""
    wrapper, name, dtype = KERNELS[kernel]
    for k in old_set or {}:
        if not isinstance(getattr(wrapper, k, None), int):
            raise SystemExit(f"kernel_ab: --old-set {k}: {wrapper.__name__} has no integer setting {k}")
    own = wrapper._module  # put back after (run_layers points the wrapper at one build)
    builds = two_builds(wrapper, name, old)
    sets = {"old": old_set, "new": None}
    g = torch.Generator().manual_seed(1)
    banks = [[(PackedLinear((torch.randn(2 * I, H, generator=g) * 0.02).to(dtype), 4096, split=I, sections=(I, I)),
               None, PackedLinear((torch.randn(H, I, generator=g) * 0.02).to(dtype), 4096)) for _ in range(E)]
             for _ in range(layers)]
    rows = []
    try:
        for T in tokens:
            x = torch.randn(T, H, generator=g).to(dtype)  # [T, H]
            top_w, top_i = torch.topk(torch.randn(T, E, generator=g).softmax(-1), K)  # [T, k]
            outs = {k: run_layers(wrapper, m, x, top_w, top_i, banks, sets[k]) for k, m in builds.items()}
            same = all(torch.equal(a, b) for a, b in zip(outs["old"], outs["new"]))
            rows.append(checked_row({"tokens": T}, f"{kernel} {T:6d} tokens", f"{T} tokens", "layer", same,
                                    lambda k: run_layers(wrapper, builds[k], x, top_w, top_i, banks, sets[k]),
                                    repeats, layers))
    finally:
        wrapper._module = own
    return rows


def compare_linear(old: Path | None, shapes: list[tuple[int, int, int]], repeats: int) -> list[dict[str, Any]]:
    """Per shape (M, K, N): ms a call of the old build of _linear_amx (None: this tree's) and of
    this tree's on the same packed weight and rows, and their ratio; outputs equal first."""
    own, g, rows = linear_amx._module, torch.Generator().manual_seed(1), []
    builds = two_builds(linear_amx, "_linear_amx", old)

    def calls(mod: ModuleType, x: torch.Tensor, w: PackedLinear, n: int) -> torch.Tensor:
        linear_amx._module = lambda: mod
        for _ in range(n):
            y = linear_amx.linear(x, w)
        return y

    try:
        for M, Kin, N in shapes:
            w = PackedLinear((torch.randn(N, Kin, generator=g) * 0.02).to(torch.bfloat16), 4096)
            x = torch.randn(M, Kin, generator=g).to(torch.bfloat16)  # [M, K]
            same = torch.equal(calls(builds["old"], x, w, 1), calls(builds["new"], x, w, 1))
            rows.append(checked_row({"shape": [M, Kin, N]}, f"linear {M}x{Kin}x{N}", f"{M}x{Kin}x{N}", "call", same,
                                    lambda k: calls(builds[k], x, w, 5), repeats, 5))
    finally:
        linear_amx._module = own
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=sorted(KERNELS) + ["linear"], required=True)
    ap.add_argument("--old", type=Path, help="the other build of the kernel's extension (.so); default: this tree's")
    ap.add_argument("--old-set", action="append", default=[], metavar="NAME=INT",
                    help="the wrapper's integer setting NAME otherwise for the old side (repeatable)")
    ap.add_argument("--tokens", default="96,512,2048,8192", help="a step's tokens (8 experts top-2)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--inter", type=int, default=1152)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--shapes", default="8192x768x1152,4096x1024x1536,512x768x8192,256x768x1152",
                    help="--kernel linear: rows x inputs x outputs, comma-separated")
    ap.add_argument("--json", type=Path, default=Path("bench/out/kernel_ab.json"))
    args = ap.parse_args(argv)
    if args.old is None and not args.old_set:
        ap.error("give --old (another build), --old-set (a setting otherwise), or both")
    old_set = {k: int(v) for k, _, v in (s.partition("=") for s in args.old_set)}
    if args.kernel == "linear":
        if old_set:
            ap.error("--kernel linear takes --old only (its wrapper has no integer settings)")
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        rows = compare_linear(args.old, shapes, args.repeats)  # type: ignore[arg-type]
    else:
        rows = compare(args.kernel, args.old, [int(t) for t in args.tokens.split(",")], args.layers, args.hidden,
                       args.inter, args.repeats, old_set)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"kernel": args.kernel, "old": str(args.old or "this tree's build"),
                                     "old_set": old_set, "machine": platform.processor(),
                                     "torch_threads": torch.get_num_threads(), "layers": args.layers,
                                     "hidden": args.hidden, "inter": args.inter, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
