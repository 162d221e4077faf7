"""The element-wise passes around an expert's GEMMs on the host, one pass each (expert_rows.c,
`moecc_runtime.native._expert_rows`): `silu_mul` (the gated MLP's activation) and
`scale_add_rows` (an expert's weighted rows added into the layer's output), with torch's bits.
Each returns None or False, having done nothing, where it does not apply (not built, MOECC_NO_NATIVE, a
GPU tensor, a dtype it does not take: silu_mul bf16 only, scale_add_rows fp32 or bf16; strides
it does not take); the caller then runs torch's passes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from moecc_runtime.native import DTYPE_CODES, extension


def _module() -> Any:
    """The extension (native.extension); None: not built."""
    return extension("_expert_rows", "moecc_silu_mul")


def _rows(t: torch.Tensor) -> bool:
    """A 2-D host tensor whose rows are contiguous (any row stride)."""
    return t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1


@lru_cache(maxsize=None)
def _silu_table() -> torch.Tensor:
    """[65536] fp32: torch's F.silu of every bf16 value (indexed by its bits), rounded to bf16."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # [65536]
    return torch.nn.functional.silu(every).float()


def silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor | None:
    """silu(gu[:, :inter]) * gu[:, inter:2*inter], the bits of F.silu(g) * u.
    gu: [R, >= 2I] bf16 -> [R, I] bf16, or None: not done, nothing allocated (see the module
    docstring)."""
    mod = _module()
    if mod is None or gu.dtype != torch.bfloat16 or not _rows(gu):
        return None
    if gu.shape[1] < 2 * inter:
        raise ValueError(f"silu_mul: gu {tuple(gu.shape)} for intermediate size {inter}")
    out = gu.new_empty((gu.shape[0], inter))  # [R, I]
    rc = mod.silu_mul(gu.data_ptr(), gu.stride(0), gu.shape[0], inter, out.data_ptr(), out.stride(0),
                      _silu_table().data_ptr(), torch.get_num_threads())
    return out if rc == 0 else None


def scale_add_rows(out: torch.Tensor, rows: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> bool:
    """out[rows[i]] += w[i] * y[i], torch's rounding (y.mul_(w[:, None]); out.index_add_(0, rows, y)).
    out: [T, H]  rows: [n] int64, distinct  y: [n, H], out's dtype  w: [n] fp32 or y's dtype.
    False: not done (see the module docstring); y is never written."""
    mod = _module()
    if (mod is None or out.dtype not in DTYPE_CODES or y.dtype != out.dtype or not (_rows(out) and _rows(y))
            or rows.dtype != torch.int64 or w.dtype not in (torch.float32, y.dtype)):
        return False
    n = rows.shape[0]
    if y.shape != (n, out.shape[1]) or w.shape != (n,):
        raise ValueError(f"scale_add_rows: out {tuple(out.shape)}, rows {tuple(rows.shape)}, y {tuple(y.shape)}, "
                         f"w {tuple(w.shape)}")
    rows, wf = rows.contiguous(), w.to(torch.float32).contiguous()  # a bf16 weight widens exactly
    rc = mod.scale_add_rows(out.data_ptr(), out.stride(0), rows.data_ptr(), n, y.data_ptr(), y.stride(0),
                            wf.data_ptr(), out.shape[1], DTYPE_CODES[out.dtype], torch.get_num_threads())
    return rc == 0
