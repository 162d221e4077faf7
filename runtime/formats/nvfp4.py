"""nvfp4: NVIDIA ModelOpt's NVFP4 (`quant_algo: NVFP4`, in hf_quant_config.json or
config.json's `quantization_config` with `quant_method: modelopt`), one Linear `X` as
`X.weight` uint8, `X.weight_scale` float8_e4m3fn, `X.weight_scale_2` float32 (and
`X.input_scale`, unread: moecc computes with activations in the compute dtype).

Stored: "data" [R, C / 2] uint8, two E2M1 values a byte (column 2j in the low nibble, 2j + 1
in the high one; sign bit 3, magnitude [0, 0.5, 1, 1.5, 2, 3, 4, 6] by bits 2-0); "scale"
[R, C / 16] float8_e4m3fn, one per 16 columns; "scale_2" [] (or [1]) float32, the tensor's
global scale (amax / (6 x 448)). The value is

    W[r, c] = FP4(q[r, c]) * (float(scale[r, c // 16]) * scale_2)

with the block's scale made first in fp32, as ModelOpt's NVFP4QTensor.dequantize does.

Source: TensorRT-Model-Optimizer modelopt/torch/quantization/qtensor/nvfp4_tensor.py
(NVFP4QTensor.quantize: the packing `(q[..., 1::2] << 4) | q[..., 0::2]`; dequantize).

Legend: R = output channels, C = input channels, G = C / 16 blocks per row.
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.formats._grouped import Grouped, as_bytes, run
from moecc_runtime.formats.mxfp4 import FP4_VALUES

NAME = "nvfp4"
BLOCK = 16


def materialize(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The Linear weight [R, C] in `dtype` (into `out` when given): `reference`'s bits."""
    data = stored["data"]
    R, G = stored["scale"].shape
    # the block scales [R, G] are made by dequant.c (or _grouped's torch path) as reference makes them
    g = Grouped(as_bytes(data, R), "nibble", stored["scale"], R, G * BLOCK, BLOCK, lut=FP4_VALUES,
                scale_mul=stored["scale_2"])
    return run(g, dtype, out, lambda: reference(stored, entry, dtype))


def reference(stored: dict[str, torch.Tensor], entry: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The Linear weight [R, C] in `dtype` (computed in fp32)."""
    data = stored["data"]
    R, G = stored["scale"].shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=data.device)
    vals = torch.stack((lut[(data & 0x0F).long()], lut[(data >> 4).long()]), dim=-1)  # [R, C/2, 2]
    block = stored["scale"].float() * stored["scale_2"].float().reshape(())  # [R, G]
    w = vals.reshape(R, G, BLOCK) * block.unsqueeze(-1)  # [R, G, 16]
    return w.reshape(R, G * BLOCK).to(dtype)  # [R, C]
