"""mxfp4: OCP microscaling FP4 as gpt-oss publishes its experts (`*_blocks`, `*_scales`).

Stored: "data" [R, G, 16] uint8, two E2M1 values per byte (low nibble first), G groups of
32 values per row; "scale" [R, G] uint8, E8M0: the group's power of two plus 127. The
value is FP4(nibble) * 2^(scale - 127). gpt-oss stores each expert's matrix as [out, in]
(rows = outputs) while its module computes x @ W with W [in, out]: `transpose` in the
format's attrs gives the weight as the module reads it.

Legend: R = rows as stored, G = groups of 32 per row, C = 32 G columns.
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.contract.formats import MXFP4_GROUP as GROUP  # the contract's: the frontend sizes by it
from moecc_runtime.formats._grouped import Grouped, as_bytes, run

NAME = "mxfp4"
#: E2M1 values by nibble: sign bit 3, exponent bits 2-1, mantissa bit 0
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def materialize(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight in `dtype` (into `out` when given): [R, C], or [C, R] with `transpose`;
    `reference`'s bits (the scale 2^(e - 127) made as torch.ldexp makes it)."""
    blocks, scales = stored["data"], stored["scale"]
    R, G, B = blocks.shape
    pow2 = torch.pow(2.0, scales.to(torch.int32) - 127)  # [R, G] fp32, what ldexp multiplies by
    g = Grouped(as_bytes(blocks, R), "nibble", pow2, R, G * 2 * B, 2 * B, lut=FP4_VALUES)
    transpose = bool(entry.get("format_attrs", {}).get("transpose"))
    return run(g, dtype, out, lambda: reference(stored, entry, dtype), transpose)


def reference(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype`: [R, C], or [C, R] with `transpose` (exact: every FP4 value times
    a power of two is representable in bf16 and fp32)."""
    blocks, scales = stored["data"], stored["scale"]
    R, G, B = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    vals = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # [R, G, B, 2]
    vals = vals.reshape(R, G, 2 * B)  # [R, G, 32]
    w = torch.ldexp(vals, (scales.to(torch.int32) - 127).unsqueeze(-1)).reshape(R, G * 2 * B)  # [R, C]
    if entry.get("format_attrs", {}).get("transpose"):
        w = w.t()  # [C, R]
    return w.to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [R, C/32, 16] uint8, scales [R, C/32] uint8) of `w` [R, C] (C a multiple of
    32), for tests and tools: each group's scale is the power of two that brings its largest
    magnitude to at most 6, each value the nearest E2M1 value."""
    R, C = w.shape
    g = w.float().reshape(R, C // GROUP, GROUP)  # [R, G, 32]
    amax = g.abs().amax(dim=-1).clamp(min=2.0 ** -126)  # [R, G]
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # [R, G]
    scaled = g / torch.exp2(exp).unsqueeze(-1)  # [R, G, 32], |x| <= 6
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    idx = (scaled.unsqueeze(-1) - lut).abs().argmin(dim=-1).to(torch.uint8)  # [R, G, 32]
    packed = idx[..., 0::2] | (idx[..., 1::2] << 4)  # [R, G, 16]
    return packed.to(torch.uint8), (exp + 127).to(torch.uint8)
