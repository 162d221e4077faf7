"""ct_naive: compressed-tensors' `naive-quantized`, `int-quantized` and `float-quantized`
formats (one compressor in the library: NaiveQuantizationCompressor): each quantized value
in its own byte, `X.weight` int8 or float8_e4m3fn [R, C], with `X.weight_scale` (and, an
asymmetric int scheme, `X.weight_zero_point`). moecc reads the weights only: FP8 W8A8
releases compute here with activations in the compute dtype (their `input_scale` unread).

Stored: "data" [R, C] int8 or float8_e4m3fn; "scale" [R, 1] (strategy channel), [1] or []
(tensor) or [R, G] (group of `group` columns); "zero" of the scale's shape (int8), when
asymmetric. The value is (data - zero) * scale, which the library computes in the scale's
dtype; the fp32 product here is exact (an 8-bit integer or e4m3 value times the scale), so
cast to the scale's dtype it is the library's bit for bit.

Source: compressed_tensors/compressors/naive_quantized/base.py,
quantization/lifecycle/forward_helpers.py (_dequantize, _process_group).

Legend: R = output channels, C = input channels, G = groups.
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.formats._grouped import Grouped, as_bytes, run

NAME = "ct_naive"


def _per_element(t: torch.Tensor, R: int, C: int, group: int) -> torch.Tensor:
    """A scale or zero point (tensor [] / [1], channel [R, 1], group [R, G]) broadcastable to [R, C]."""
    t = t.float()
    if t.dim() < 2:
        return t.reshape(1, 1)  # [1, 1]
    if group > 0 and t.shape[-1] > 1:
        return t.repeat_interleave(group, dim=-1)[:, :C]  # [R, C]
    return t  # [R, 1]


def materialize(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The Linear weight [R, C] in `dtype` (into `out` when given): `reference`'s bits."""
    group = int(entry.get("format_attrs", {}).get("group", 0))
    data = stored["data"]
    kind = {torch.int8: "int8", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(data.dtype)
    grid = _grid(stored["scale"], *data.shape, group) if data.dim() == 2 and kind else None
    g = None
    if grid is not None and ("zero" not in stored or stored["zero"].shape == stored["scale"].shape):
        R, C = data.shape
        zero = stored["zero"].reshape(grid[0].shape) if "zero" in stored else None
        g = Grouped(as_bytes(data, R), kind, grid[0], R, C, grid[1], grid[2], zero=zero)
    return run(g, dtype, out, lambda: reference(stored, entry, dtype))


def _grid(t: torch.Tensor, R: int, C: int, group: int) -> tuple[torch.Tensor, int, int] | None:
    """A scale as (grid [SR, G], column group, row group) as _per_element reads it, or None."""
    if t.dim() < 2 and t.numel() == 1:
        return t.reshape(1, 1), max(C, 1), max(R, 1)  # tensor
    if t.dim() == 2 and t.shape[0] == R and t.shape[1] == 1:
        return t, max(C, 1), 1  # channel
    if t.dim() == 2 and t.shape[0] == R and group > 0 and t.shape[1] == -(-C // group):
        return t, group, 1  # group
    return None


def reference(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The Linear weight [R, C] in `dtype` (computed in fp32)."""
    group = int(entry.get("format_attrs", {}).get("group", 0))
    data = stored["data"]
    R, C = data.shape
    w = data.float()  # [R, C]
    if "zero" in stored:
        w = w - _per_element(stored["zero"], R, C, group)
    return (w * _per_element(stored["scale"], R, C, group)).to(dtype)  # [R, C]
