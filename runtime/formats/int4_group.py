"""int4_group: weight-only 4-bit integers, one scale (and zero point) per group of `group`
consecutive input channels of a row (what `moecc compile --quantize int4` writes).

Stored: "data" [R, ceil(C/2)] uint8, two 4-bit values q in 0..15 per byte: column 2j in the
low nibble, 2j + 1 in the high one (an odd C leaves the last high nibble 0); "scale" [R, G]
float32; and, asymmetric (the default: it measured better, see moecc/quantize/__init__.py),
"zero" [R, G] uint8 in 0..15. The value is (q[r, c] - zero[r, c // group]) * scale[r, c // group];
without a "zero" part the format is symmetric and the zero point is 8. G = ceil(C / group):
when C is not a multiple of the group the last group is partial (it covers the columns
that exist). With `transpose` in the format's attrs the weight as ops read it is the stored
matrix's transpose (x @ W layouts: gpt-oss's experts).

Asymmetric: the group's range [min(w, 0), max(w, 0)] maps onto 0..15 (zero is exactly
representable); symmetric: max |w| maps to 7, values clamp to -8..7.

Legend: R = output channels (rows as stored), C = input channels, G = groups per row,
g = group size, Cp = G * g (C padded to whole groups).
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.formats._grouped import NIBBLES, Grouped, as_bytes, run

NAME = "int4_group"
DEFAULT_GROUP = 128
SYMMETRIC_ZERO = 8


def materialize(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight [R, C] in `dtype` (into `out` when given): `reference`'s bits; [C, R] with `transpose`."""
    data, scale = stored["data"], stored["scale"]
    attrs = entry.get("format_attrs", {})
    R, C = (int(d) for d in _stored_shape(entry))
    g = Grouped(as_bytes(data, R), "nibble", scale, R, C, int(attrs["group"]), zero=stored.get("zero"), lut=NIBBLES,
                zero_const=float(SYMMETRIC_ZERO))  # symmetric: every zero point 8, as reference's
    return run(g, dtype, out, lambda: reference(stored, entry, dtype), bool(attrs.get("transpose")))


def reference(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The weight [R, C] in `dtype` (computed in fp32) on the stored tensors' device; [C, R]
    with `transpose`."""
    data, scale = stored["data"], stored["scale"]
    attrs = entry.get("format_attrs", {})
    g = int(attrs["group"])
    R, C = (int(d) for d in _stored_shape(entry))
    G = scale.shape[-1]
    q = torch.stack((data & 0x0F, data >> 4), dim=-1).reshape(R, -1)  # [R, 2 ceil(C/2)] uint8
    q = torch.nn.functional.pad(q[:, :C].float(), (0, G * g - C)).view(R, G, g)  # [R, G, g]
    zero = stored["zero"].float() if "zero" in stored else torch.full_like(scale, SYMMETRIC_ZERO, dtype=torch.float32)
    w = ((q - zero.unsqueeze(-1)) * scale.float().unsqueeze(-1)).view(R, G * g)[:, :C]  # [R, C]
    if attrs.get("transpose"):
        w = w.t()  # [C, R]
    return w.to(dtype)


def _stored_shape(entry: dict[str, Any]) -> list[int]:
    """[R, C] of the matrix as stored (the logical shape, transposed back with `transpose`)."""
    shape = [int(d) for d in entry["logical_shape"]]
    return shape[::-1] if entry.get("format_attrs", {}).get("transpose") else shape


def quantize(w: torch.Tensor, group: int = DEFAULT_GROUP, symmetric: bool = False) -> dict[str, torch.Tensor]:
    """The stored tensors of `w` [R, C] (any float dtype, rows = output channels):
    {"data": [R, ceil(C/2)] uint8, "scale": [R, G] fp32} and, unless `symmetric`,
    {"zero": [R, G] uint8}. Guarantees: every dequantized value is within its group's
    scale / 2 of w (scale = (max(w, 0) - min(w, 0)) / 15, symmetric max |w| / 7)."""
    if w.dim() != 2:
        raise ValueError(f"int4_group quantizes 2-D weights [out, in], got shape {list(w.shape)}")
    if group < 1:
        raise ValueError(f"int4_group: group size must be at least 1, got {group}")
    R, C = w.shape
    G = -(-C // group)
    x = torch.nn.functional.pad(w.float(), (0, G * group - C)).view(R, G, group)  # [R, G, g]; padding is 0
    if symmetric:
        amax = x.abs().amax(dim=-1)  # [R, G]
        scale = torch.where(amax > 0, amax / 7, torch.ones_like(amax))
        zero = torch.full_like(scale, SYMMETRIC_ZERO)
        q = (torch.round(x / scale.unsqueeze(-1)) + SYMMETRIC_ZERO).clamp_(0, 15)  # [R, G, g]
    else:
        lo, hi = x.amin(dim=-1).clamp(max=0), x.amax(dim=-1).clamp(min=0)  # [R, G]: the range holds 0
        scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(lo))
        zero = torch.round(-lo / scale).clamp_(0, 15)
        q = (torch.round(x / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp_(0, 15)  # [R, G, g]
    q = q.view(R, G * group)[:, :C].to(torch.uint8)  # [R, C]
    if C % 2:
        q = torch.nn.functional.pad(q, (0, 1))  # [R, C + 1]: the last high nibble is 0
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()  # [R, ceil(C/2)]
    out = {"data": packed, "scale": scale.contiguous()}
    if not symmetric:
        out["zero"] = zero.to(torch.uint8).contiguous()
    return out


def stored_layout(shape: tuple[int, int], group: int = DEFAULT_GROUP,
                  symmetric: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of each stored tensor of a [R, C] weight, as `quantize` makes them."""
    R, C = shape
    G = -(-C // group)
    out = {"data": ("uint8", (R, -(-C // 2))), "scale": ("float32", (R, G))}
    if not symmetric:
        out["zero"] = ("uint8", (R, G))
    return out
