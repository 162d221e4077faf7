"""awq_gemm: AutoAWQ's GEMM layout (`quantization_config: {quant_method: awq, version: gemm,
bits: 4, group_size, zero_point: true}`), one Linear `X` as `X.qweight`, `X.qzeros`, `X.scales`.

Stored: "data" = qweight [C, R / 8] int32, packed along the *output* dimension in AutoAWQ's
interleaved order: nibble i of word j holds output channel 8 j + ORDER[i], ORDER =
[0, 2, 4, 6, 1, 3, 5, 7]; "zero" = qzeros [G, R / 8] int32, packed the same way (no offset);
"scale" = scales [G, R] (fp16 as published). Input channel c is in group c // group. The
value is W[r, c] = (q[c, r] - z[c // group, r]) * scale[c // group, r], exact in fp32.

Sources: AutoAWQ awq/modules/linear/gemm.py (WQLinear_GEMM.from_linear: the packing and
order_map) and awq/utils/packing_utils.py (unpack_awq, reverse_awq_order, dequantize_gemm).

Legend: R = output channels, C = input channels, G = groups.
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.formats._grouped import NIBBLES, Grouped, as_bytes, run
from moecc_runtime.formats._packing import AWQ_REVERSE, unpack_cols
from moecc_runtime.formats.gptq import group_index

NAME = "awq_gemm"
BITS = 4
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word -> its output channel within the word's 8
REVERSE = AWQ_REVERSE  # output channel k of a word's 8 -> its nibble


def unpack(words: torch.Tensor) -> torch.Tensor:
    """words [N, R / 8] int32 in AWQ order -> values [N, R] uint8 in channel order."""
    v = unpack_cols(words, BITS)  # [N, R] in nibble order
    return v.unflatten(-1, (-1, 8))[..., list(REVERSE)].flatten(-2)  # [N, R]


def materialize(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The Linear weight [R, C] in `dtype` (into `out` when given): `reference`'s bits, made as
    its [C, R] transpose (the layout as stored: a scale per output channel of each row)."""
    group = int(entry["format_attrs"]["group"])
    R, C = (int(d) for d in entry["logical_shape"])
    zero = stored["zero"]  # qzeros [G, R / 8]: decoded by dequant.c as `unpack` does
    g = Grouped(as_bytes(stored["data"], C), "awq", stored["scale"], C, R, 1, group if group > 0 else max(C, 1),
                lut=NIBBLES, zero_codes=as_bytes(zero, zero.shape[0]), zero_kind="awq")
    return run(g, dtype, out, lambda: reference(stored, entry, dtype), transpose=True)


def reference(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The Linear weight [R, C] in `dtype` (computed in fp32)."""
    group = int(entry["format_attrs"]["group"])
    R, C = (int(d) for d in entry["logical_shape"])
    q = unpack(stored["data"]).float()  # [C, R]
    z = unpack(stored["zero"]).float()  # [G, R]
    s = stored["scale"].float()  # [G, R]
    g = group_index(None, C, group, q.device)  # [C]
    w = (q - z[g]) * s[g]  # [C, R]
    return w.t().to(dtype)  # [R, C]
