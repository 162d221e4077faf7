"""Process replay for the compiler (in the spirit of tinygrad's): compile a fixed set of
models and budgets, write each plan as canonical plain data, and compare two such sets, so
a refactor proves it changed no plan.

    python bench/replay.py record DIR        # compile every case, write DIR/<case>.json
    python bench/replay.py compare OLD NEW [--expect REGEX ...]
                                             # list every difference not expected, by case and key path

The cases: every config under examples/configs/ (config-only plans) unbudgeted and at
--gpu-mem 24GB --host-mem 2TB on the a5000 preset, and a tiny checkpoint of every family and
layout that `moecc.testing.checkpoints` writes, unbudgeted and at 50% and 80% of its weight
bytes.
What varies between two compiles of one input is left out of the comparison: absolute
paths (the checkpoint directory), wall-clock times, and the solver's own statistics.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
#: keys whose values differ between two compiles of the same input (paths, clocks)
VOLATILE = {"dir", "seconds", "compile_seconds", "wall_seconds", "solve_seconds", "solver_seconds", "wall_time"}
#: values at these paths differ too: the host-memory sentence quotes the machine's free memory at compile time
VOLATILE_PATHS = {("memory", "host_model", "budget")}


def canonical(x: Any, path: tuple[str, ...] = ()) -> Any:
    """Plain JSON-able data: tensors as {dtype, shape, values}, tuples as lists, sorted keys;
    volatile keys (and paths) dropped."""
    if isinstance(x, torch.Tensor):
        return {"tensor": str(x.dtype), "shape": list(x.shape), "values": x.flatten().tolist()}
    if isinstance(x, dict):
        return {str(k): canonical(v, (*path, str(k))) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))
                if str(k) not in VOLATILE and (*path, str(k)) not in VOLATILE_PATHS}
    if isinstance(x, (list, tuple)):
        return [canonical(v, path) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    return x


def cases(tmp: Path) -> Iterator[tuple[str, Path, dict[str, Any]]]:
    """(case name, model dir, compile_model keyword arguments)."""
    from moecc.testing.checkpoints import FAMILIES, LAYOUTS, write_checkpoint

    for cfg in sorted(p for p in CONFIGS.iterdir() if (p / "config.json").is_file()):
        yield f"config-{cfg.name}", cfg, {}
        yield f"config-{cfg.name}-24GB", cfg, {"gpu_mem": 24 * 10**9, "host_mem": 2 * 10**12, "hardware": "a5000"}
    for family in FAMILIES:
        for layout in LAYOUTS:
            d = write_checkpoint(tmp / f"{family}-{layout}", family, layout=layout)
            weights = sum(f.stat().st_size for f in d.glob("*.safetensors"))
            yield f"ckpt-{family}-{layout}", d, {"prompt_tokens": 32, "output_tokens": 16, "max_batch": 64}
            for share in (50, 80):
                yield f"ckpt-{family}-{layout}-{share}pct", d, {"gpu_mem": weights * share // 100, "prompt_tokens": 32,
                                                                "output_tokens": 16, "max_batch": 64}


def record(out: Path) -> int:
    from moecc.compiler import compile_model

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, model_dir, kwargs in cases(Path(tmp)):
            try:
                plan, _ = compile_model(model_dir, verify=True, **kwargs)
                data: Any = canonical(plan)
            except Exception as e:  # a refused compile is part of the behaviour replayed
                data = {"refused": f"{type(e).__name__}: {e}".replace(tmp, "<tmp>")}
            (out / f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            print(f"{name}: {'refused' if 'refused' in data else 'plan'}", file=sys.stderr, flush=True)
    return 0


def differences(a: Any, b: Any, path: str = "") -> Iterator[str]:
    """Key paths where `a` and `b` differ (floats to 1e-9 relative)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                yield f"{path}.{k}: only in {'new' if k in b else 'old'}"
            else:
                yield from differences(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from differences(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12):
            yield f"{path}: {a!r} -> {b!r}"
    elif a != b:
        yield f"{path}: {_short(a)} -> {_short(b)}"


def _short(x: Any) -> str:
    text = json.dumps(x)
    return text if len(text) <= 120 else text[:117] + "..."


def compare(old: Path, new: Path, expect: list[str] | None = None) -> int:
    """Every difference between the two recorded sets; those whose key path matches one of
    the `expect` regexes (intended changes) are counted per pattern, the rest are listed."""
    import re

    patterns = [re.compile(e) for e in expect or []]
    names = sorted({p.name for p in old.glob("*.json")} | {p.name for p in new.glob("*.json")})
    counts = {e: 0 for e in expect or []}
    bad = 0
    for name in names:
        if not (old / name).is_file() or not (new / name).is_file():
            print(f"{name}: only in {'new' if (new / name).is_file() else 'old'}")
            bad += 1
            continue
        diffs = list(differences(json.loads((old / name).read_text()), json.loads((new / name).read_text())))
        unexpected = []
        for d in diffs:
            hit = next((p.pattern for p in patterns if p.search(d.split(": ")[0])), None)
            if hit is None:
                unexpected.append(d)
            else:
                counts[hit] += 1
        for d in unexpected[:20]:
            print(f"{name}{d}")
        if len(unexpected) > 20:
            print(f"{name}: ... {len(unexpected) - 20} more")
        bad += bool(unexpected)
    for e, n in counts.items():
        print(f"intended: {n} differences at {e}")
    print(f"{len(names) - bad} of {len(names)} cases identical" + (" but for the intended differences" if expect else ""))
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("record").add_argument("dir", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("old", type=Path)
    c.add_argument("new", type=Path)
    c.add_argument("--expect", action="append", default=[], metavar="REGEX",
                   help="key paths of an intended difference (repeatable)")
    args = ap.parse_args(argv)
    return record(args.dir) if args.cmd == "record" else compare(args.old, args.new, args.expect)


if __name__ == "__main__":
    sys.exit(main())
