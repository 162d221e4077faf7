"""ct_packed: compressed-tensors' `pack-quantized` format (llm-compressor's W4A16 / W8A16
releases: `quantization_config: {quant_method: compressed-tensors, format: pack-quantized,
config_groups: {...: {weights: {num_bits, type: int, strategy, group_size, symmetric}}}}`),
one Linear `X` as `X.weight_packed`, `X.weight_scale`, `X.weight_shape` (and
`X.weight_zero_point`, `X.weight_g_idx`).

Stored: "data" = weight_packed [R, ceil(C b / 32)] int32, packed along the input dimension,
each value stored plus 2^(b-1) (the signed range -2^(b-1) .. 2^(b-1) - 1 made unsigned);
"scale" = weight_scale [R, G] (strategy group: G = C / group; channel: G = 1); asymmetric,
"zero" = weight_zero_point [ceil(R b / 32), G] int32, packed along the *output* dimension
with the same offset; "g_idx" = weight_g_idx [C] when the file has one (older activation-
ordered releases). The value is W[r, c] = (q[r, c] - z[r, g(c)]) * scale[r, g(c)], which the
library computes in the scale's dtype: the fp32 product here is exact (at most 9 bits times
the scale), so cast to the scale's dtype it is the library's bit for bit.

Source: compressed_tensors/compressors/pack_quantized/base.py and helpers.py
(pack_to_int32 / unpack_from_int32), quantization/lifecycle/forward_helpers.py (_dequantize).

Legend: R = output channels, C = input channels, G = groups, b = bits (4 or 8).
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.formats._grouped import NIBBLES, Grouped, as_bytes, run
from moecc_runtime.formats._packing import unpack_cols, unpack_rows
from moecc_runtime.formats.gptq import group_index

NAME = "ct_packed"


def materialize(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The Linear weight [R, C] in `dtype` (into `out` when given): `reference`'s bits (an
    activation-ordered `g_idx`: `reference` itself)."""
    a = entry["format_attrs"]
    bits, group = int(a["bits"]), int(a["group"])
    R, C = (int(d) for d in entry["logical_shape"])
    scale = stored["scale"]
    g = None
    if "g_idx" not in stored and bits in (4, 8):
        mid = float(1 << (bits - 1))
        zero = unpack_rows(stored["zero"], bits)[:R].float() if "zero" in stored else None  # [R, G]
        g = Grouped(as_bytes(stored["data"], R), "nibble" if bits == 4 else "uint8", scale, R, C,
                    group if group > 0 else max(C, 1), zero=zero, lut=NIBBLES if bits == 4 else None, zero_const=mid)
    return run(g, dtype, out, lambda: reference(stored, entry, dtype))


def reference(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The Linear weight [R, C] in `dtype` (computed in fp32)."""
    a = entry["format_attrs"]
    bits, group = int(a["bits"]), int(a["group"])
    R, C = (int(d) for d in entry["logical_shape"])
    mid = float(1 << (bits - 1))
    q = unpack_cols(stored["data"], bits)[:, :C].float() - mid  # [R, C]
    s = stored["scale"].float()  # [R, G]
    g = group_index(stored.get("g_idx"), C, group, q.device)  # [C]
    if "zero" in stored:
        z = unpack_rows(stored["zero"], bits)[:R].float() - mid  # [R, G]
        q = q - z[:, g]
    return (q * s[:, g]).to(dtype)  # [R, C]
