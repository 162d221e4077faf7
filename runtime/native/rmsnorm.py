"""transformers' RMSNorm on the host in one pass over each row (rmsnorm.c,
`moecc_runtime.native._rmsnorm`), with kernels._rmsnorm's bits; `add_rmsnorm` the residual add
that makes its input in the same pass (torch's `a + b`, same bits). `rmsnorm` returns None (and
`add_rmsnorm` False), having done nothing, where it does not apply (not built, MOECC_NO_NATIVE,
a GPU tensor, a dtype other than fp32 / bf16, x and w not of one dtype, rows wider than the pass
takes, torch's CPU kernels whose sum adds in an order the pass does not know: `sum_lanes`); the
caller then runs torch's passes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from moecc_runtime.native import DTYPE_CODES, extension

MAX_WIDTH = 16384  # rmsnorm.c's SCRATCH_H; rows of up to this many elements sum in one pass in torch too


def _module() -> Any:
    """The extension (native.extension); None: not built."""
    return extension("_rmsnorm", "moecc_rmsnorm")


#: widths whose rows the calibration checks: narrower than a vector, a cascade level, odd tails
_CHECK_WIDTHS = (7, 40, 777, 2085)


@lru_cache(maxsize=None)
def sum_lanes() -> int | None:
    """The vector width (fp32 lanes) of torch's CPU inner sum here, whose order the pass
    follows: the width (8 or 16) at which the pass gives torch's own bits on rows of
    _CHECK_WIDTHS (fp32 and bf16, one-time, a few ms); None when neither does (a torch whose sum
    the pass does not know: the norm stays on torch)."""
    mod = _module()
    if mod is None:
        return None
    gen = torch.Generator().manual_seed(0)
    for lanes in (8, 16):
        if all(_agrees(mod, lanes, H, dtype, gen) for H in _CHECK_WIDTHS for dtype in DTYPE_CODES):
            return lanes
    return None


def _agrees(mod: Any, lanes: int, H: int, dtype: torch.dtype, gen: torch.Generator) -> bool:
    """The pass at `lanes` gives the bits of torch's own passes (kernels._rmsnorm, transformers'
    composition) on 64 random rows of H."""
    from moecc_runtime.worker.kernels import _rmsnorm  # at call time: kernels imports this module

    x = (torch.randn(64, H, generator=gen) * 3).to(dtype)  # [64, H]
    w = torch.randn(H, generator=gen).to(dtype)  # [H]
    ref = _rmsnorm(x, w, 1e-6)  # [64, H]
    out = _run(mod, x, w, 1e-6, lanes)
    return out is not None and torch.equal(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                           ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def _run(mod: Any, x: torch.Tensor, w: torch.Tensor, eps: float, lanes: int) -> torch.Tensor | None:
    """The pass over x's rows at torch's sum width `lanes` (1 for rows narrower than it).
    x: [..., H] whose rows are contiguous  w: [H] -> [..., H], or None (refused)."""
    H = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, H)  # [R, H]: a view where x's rows allow one
    if rows.stride(-1) != 1 and H > 1:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)  # [..., H]
    rc = mod.rmsnorm(rows.data_ptr(), rows.stride(0), rows.shape[0], H, w.data_ptr(), float(eps),
                     out.data_ptr(), DTYPE_CODES[x.dtype], lanes if H >= lanes else 1, torch.get_num_threads())
    return out if rc == 0 else None


def _pass(w: torch.Tensor, H: int, dtype: torch.dtype) -> tuple[Any, int] | None:
    """The extension and torch's sum width for rows of H elements of `dtype` normalised by w, or
    None where the pass does not take them (a dtype other than fp32 / bf16, w not [H] contiguous
    on the host in that dtype, rows wider than the pass takes, not built, a sum it does not know)."""
    if (dtype not in DTYPE_CODES or w.dtype != dtype or w.device.type != "cpu" or w.shape != (H,)
            or not w.is_contiguous() or H > MAX_WIDTH):
        return None
    mod, lanes = _module(), sum_lanes()
    return None if mod is None or lanes is None else (mod, lanes)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype) over the last dimension.
    x: [..., H] (rows contiguous, any row stride when 2-D)  w: [H], x's dtype -> [..., H]
    contiguous, or None (not done)."""
    found = _pass(w, x.shape[-1], x.dtype) if x.device.type == "cpu" and x.dim() >= 1 else None
    return None if found is None else _run(found[0], x, w, eps, found[1])


def _rows(x: torch.Tensor, H: int) -> bool:
    """x is [R, H] on the host with contiguous rows (any row stride)."""
    return x.device.type == "cpu" and x.dim() == 2 and x.shape[1] == H and (x.stride(1) == 1 or H == 1)


def add_rmsnorm(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, eps: float, sum_out: torch.Tensor,
                out: torch.Tensor) -> bool:
    """sum_out = a + b (torch's add, same bits) and out = rmsnorm(sum_out, w, eps) (`rmsnorm`'s
    bits), in one pass over each row. a, b, sum_out: [R, H] with contiguous rows (any row stride),
    sum_out overlapping neither a nor b  w: [H]  out: [R, H] contiguous; all of one dtype (fp32 or
    bf16). False, nothing written, where it does not apply (as `rmsnorm`, or other shapes)."""
    R, H = a.shape if a.dim() == 2 else (0, 0)
    if (not all(_rows(t, H) for t in (a, b, sum_out, out)) or b.shape != a.shape or sum_out.shape != a.shape
            or out.shape != a.shape or not out.is_contiguous() or any(t.dtype != a.dtype for t in (b, sum_out, out))
            or H == 0):
        return False
    found = _pass(w, H, a.dtype)
    if found is None:
        return False
    mod, lanes = found
    rc = mod.add_rmsnorm(a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), sum_out.data_ptr(), sum_out.stride(0),
                         R, H, w.data_ptr(), float(eps), out.data_ptr(), DTYPE_CODES[a.dtype],
                         lanes if H >= lanes else 1, torch.get_num_threads())
    return rc == 0
