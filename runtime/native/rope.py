"""Rotary position embedding on the host in one pass (rope.c, `moecc_runtime.native._rope`), with
kernels.apply_rope's bits. `rope` returns None, having done nothing, where it does not apply
(not built, MOECC_NO_NATIVE, a GPU tensor, a dtype other than fp32 / bf16, x, cos and sin not
of one dtype, strides it does not take); the caller then runs torch's passes.
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.native import DTYPE_CODES, extension


def _module() -> Any:
    """The extension (native.extension); None: not built."""
    return extension("_rope", "moecc_rope")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x * cos + rotate_half(x) * sin, each product rounded, then their sum (kernels.apply_rope).
    x: [T, heads, D] (any row and head strides, the last contiguous)  cos/sin: [T, D], one row
    stride -> [T, heads, D] contiguous, or None (not done)."""
    mod = _module()
    if (mod is None or x.device.type != "cpu" or x.dtype not in DTYPE_CODES or cos.dtype != x.dtype
            or sin.dtype != x.dtype or x.dim() != 3 or x.stride(2) != 1 or cos.stride(1) != 1
            or sin.stride(1) != 1 or cos.stride(0) != sin.stride(0) or cos.device.type != "cpu"):
        return None
    T, heads, D = x.shape
    if cos.shape != (T, D) or sin.shape != (T, D):
        raise ValueError(f"rope: x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    out = torch.empty((T, heads, D), dtype=x.dtype)  # [T, heads, D]
    rc = mod.rope(x.data_ptr(), x.stride(0), x.stride(1), T, heads, D, cos.data_ptr(), sin.data_ptr(),
                  cos.stride(0), out.data_ptr(), DTYPE_CODES[x.dtype], torch.get_num_threads())
    return out if rc == 0 else None
