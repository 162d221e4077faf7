"""gptq: GPTQ weight-only integers as AutoGPTQ / GPTQModel / optimum write them
(`quantization_config: {quant_method: gptq, bits, group_size, desc_act, sym}`), one Linear
`X` as `X.qweight`, `X.qzeros`, `X.scales` (and `X.g_idx`).

Stored: "data" = qweight [C * b / 32, R] int32, packed along the *input* dimension (value i
of a word at bits [i b, (i + 1) b): input channel 32 / b * row + i); "zero" = qzeros
[G, R * b / 32] int32, packed along the output dimension the same way; "scale" = scales
[G, R] (fp16 as published); with `desc_act` "g_idx" = g_idx [C] int32, the group of each
input channel (a permutation's groups); otherwise channel c is in group c // group
(group -1: one group, G = 1). The value is

    W[r, c] = (q[c, r] - (z[g(c), r] + zero_offset)) * scale[g(c), r]

`zero_offset` is the checkpoint format's: 1 in v1 files (`checkpoint_format: gptq`, and every
file without the field: AutoGPTQ stores z - 1), 0 in `gptq_v2`. Symmetric files store the
middle value 2^(b-1) that way too. The product is exact in fp32 (an integer of at most 9
bits times an fp16 scale), so casting it gives what the library's fp16 arithmetic gives.

Sources: AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py (QuantLinear.pack and the
torch dequantization in forward), GPTQModel gptqmodel/utils/model.py
(convert_gptq_v1_to_v2_format).

Legend: R = output channels, C = input channels, G = groups, b = bits (4 or 8).
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.formats._grouped import Grouped, as_bytes, run
from moecc_runtime.formats._packing import unpack_cols, unpack_rows

NAME = "gptq"


def materialize(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The Linear weight [R, C] in `dtype` (into `out` when given): `reference`'s bits, made as
    its [C, R] transpose (the layout as stored: a scale per output channel of each row)."""
    a = entry["format_attrs"]
    bits, group, offset = int(a["bits"]), int(a["group"]), int(a["zero_offset"])
    R, C = (int(d) for d in entry["logical_shape"])
    g_idx = stored.get("g_idx")
    g = None
    if bits in (4, 8):  # the zeros [G, R] decoded from qzeros' bytes by dequant.c: unpack_cols(qzeros) + offset
        zero = stored["zero"]
        g = Grouped(as_bytes(stored["data"], stored["data"].shape[0]), f"wrow{bits}", stored["scale"], C, R, 1,
                    group if group > 0 else max(C, 1), g_idx=g_idx, zero_codes=as_bytes(zero, zero.shape[0]),
                    zero_kind="nibble" if bits == 4 else "uint8", zero_add=float(offset))
    return run(g, dtype, out, lambda: reference(stored, entry, dtype), transpose=True)


def reference(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The Linear weight [R, C] in `dtype` (computed in fp32)."""
    a = entry["format_attrs"]
    bits, group, offset = int(a["bits"]), int(a["group"]), int(a["zero_offset"])
    R, C = (int(d) for d in entry["logical_shape"])
    q = unpack_rows(stored["data"], bits)[:C].float()  # [C, R]
    z = unpack_cols(stored["zero"], bits)[:, :R].float() + offset  # [G, R]
    s = stored["scale"].float()  # [G, R]
    g = group_index(stored.get("g_idx"), C, group, q.device)  # [C]
    w = (q - z[g]) * s[g]  # [C, R]
    return w.t().to(dtype)  # [R, C]


def group_index(g_idx: torch.Tensor | None, columns: int, group: int, device: torch.device) -> torch.Tensor:
    """The group [C] of each input channel: g_idx as stored, else c // group (group < 1: 0)."""
    if g_idx is not None:
        return g_idx.long()
    c = torch.arange(columns, device=device)
    return c // group if group > 0 else torch.zeros_like(c)
