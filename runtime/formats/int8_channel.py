"""int8_channel: weight-only int8, symmetric, one scale per output channel (what
`moecc compile --quantize int8` writes).

Stored: "data" [R, C] int8 and "scale" [R] float32 (fp32 whatever the compute dtype: R floats
are nothing next to R x C bytes, and an fp32 scale adds no error of its own). The value is
data[r, c] * scale[r]; scale[r] = max |w[r, :]| / 127, so every row uses the whole range
[-127, 127] (-128 is never written: the format is symmetric). A row of zeros has scale 1.
With `transpose` in the format's attrs the weight as ops read it is the stored matrix's
transpose (x @ W layouts, e.g. gpt-oss's experts: the rows are still the outputs).

Legend: R = output channels (rows as stored), C = input channels.
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.formats._grouped import Grouped, as_bytes, run

NAME = "int8_channel"
QMAX = 127


def materialize(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """data [R, C] times its row's scale, in `dtype` (into `out` when given): `reference`'s bits;
    [C, R] with `transpose`."""
    data, scale = stored["data"], stored["scale"]
    g = None
    if data.dim() == 2 and data.dtype == torch.int8 and scale.numel() == data.shape[0]:
        R, C = data.shape
        g = Grouped(as_bytes(data, R), "int8", scale.reshape(R, 1), R, C, max(C, 1))
    transpose = bool(entry.get("format_attrs", {}).get("transpose"))
    return run(g, dtype, out, lambda: reference(stored, entry, dtype), transpose)


def reference(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """data [R, C] times its row's scale, in `dtype` (computed in fp32), on the stored
    tensors' device; [C, R] with `transpose`."""
    data, scale = stored["data"], stored["scale"]
    w = data.float() * scale.float().unsqueeze(-1)  # [R, C]
    if entry.get("format_attrs", {}).get("transpose"):
        w = w.t()  # [C, R]
    return w.to(dtype)


def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The stored tensors {"data": [R, C] int8, "scale": [R] fp32} of `w` [R, C] (any float
    dtype, rows = output channels). Guarantees: |materialize - w| <= scale[r] / 2 per row."""
    if w.dim() != 2:
        raise ValueError(f"int8_channel quantizes 2-D weights [out, in], got shape {list(w.shape)}")
    x = w.float()  # [R, C]
    amax = x.abs().amax(dim=1)  # [R]
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))  # [R]
    q = torch.round(x / scale.unsqueeze(1)).clamp_(-QMAX, QMAX)  # [R, C]
    return {"data": q.to(torch.int8), "scale": scale.contiguous()}


def stored_layout(shape: tuple[int, int], group: int = 0,
                  symmetric: bool = True) -> dict[str, tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of each stored tensor of a [R, C] weight, as `quantize` makes them
    (`group`, `symmetric`: unused, the signature int4_group's)."""
    R, C = shape
    return {"data": ("int8", (R, C)), "scale": ("float32", (R,))}
