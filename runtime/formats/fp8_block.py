"""fp8_block: fine-grained FP8 as DeepSeek-V3/R1 and the Qwen3 FP8 releases publish it
(`quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]}`).

Stored: "data" [R, C] float8_e4m3fn and "scale" [ceil(R0/bR), ceil(C/bC)] (fp32 or bf16,
`weight_scale_inv` in the checkpoint: the factor that takes the fp8 value back to the
real one) over the whole tensor the slice came from. A slice of rows [r0, r0 + R) (the
gate or up half of a fused gate_up) names the scale rows its blocks fall in and
`row0 = r0 % bR`, the offset of its first row into its first block. The last block of a
dimension that is not a multiple of the block is partial (e.g. [576, 7168] has a [5, 56]
grid): its scale covers the rows or columns that exist.

Legend: R, C = rows and columns of the weight; bR, bC = block size.
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.formats._grouped import Grouped, as_bytes, run

NAME = "fp8_block"
FP8_MAX = 448.0  # the largest float8_e4m3fn value


def materialize(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """data [R, C] fp8 times its block's scale, in `dtype` (into `out` when given): `reference`'s bits."""
    data, scale = stored["data"], stored["scale"]
    a = entry.get("format_attrs", {})
    b_r, b_c = (int(x) for x in a.get("block", (128, 128)))
    kind = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(data.dtype)
    g = None
    if data.dim() == 2 and scale.dim() == 2 and kind is not None:
        g = Grouped(as_bytes(data, data.shape[0]), kind, scale, data.shape[0], data.shape[1], b_c, b_r,
                    int(a.get("row0", 0)))
    return run(g, dtype, out, lambda: reference(stored, entry, dtype))


def reference(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """data [R, C] fp8 times its block's scale, in `dtype` (computed in fp32)."""
    data, scale = stored["data"], stored["scale"]
    a = entry.get("format_attrs", {})
    b_r, b_c = (int(x) for x in a.get("block", (128, 128)))
    r0 = int(a.get("row0", 0))
    R, C = data.shape[-2], data.shape[-1]
    # per element scale: scale rows repeat bR times (from the slice's offset into its block),
    # columns bC times, cropped to the partial last block
    s = scale.float().repeat_interleave(b_r, dim=-2)[..., r0:r0 + R, :]  # [R, ceil(C/bC)]
    s = s.repeat_interleave(b_c, dim=-1)[..., :C]  # [R, C]
    return (data.float() * s).to(dtype)  # [R, C]


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128), scale_dtype: torch.dtype = torch.float32
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(data [R, C] float8_e4m3fn, scale_inv [ceil(R/bR), ceil(C/bC)] in `scale_dtype`) of
    `w` [R, C] in the published layout (for tests and tools): each block's amax maps to
    e4m3's largest value, 448, through a scale rounded to `scale_dtype` first, so data times
    scale is exactly what dequantizing gives."""
    R, C = w.shape
    b_r, b_c = block
    gr, gc = -(-R // b_r), -(-C // b_c)
    pad = torch.zeros(gr * b_r, gc * b_c, dtype=torch.float32)  # [gR*bR, gC*bC]
    pad[:R, :C] = w.float()
    amax = pad.view(gr, b_r, gc, b_c).abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [gR, gC]
    scale = (amax / FP8_MAX).to(scale_dtype)  # [gR, gC]
    per = scale.float().repeat_interleave(b_r, 0).repeat_interleave(b_c, 1)[:R, :C]  # [R, C]
    q = (w.float() / per).clamp(-FP8_MAX, FP8_MAX)  # [R, C]
    return q.to(torch.float8_e4m3fn), scale
