"""Dtype tables both sides read: safetensors' dtype codes, moecc's dtype names and their
sizes, the torch dtype of each name, and the dtypes a model may compute in."""

from __future__ import annotations

import torch

#: safetensors dtype -> (moecc's dtype name, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
}
#: moecc's dtype name -> bytes per element
ITEMSIZE: dict[str, int] = dict(DTYPES.values())
#: the floating dtypes a model may compute in (float8 is a stored format, never a compute dtype)
FLOAT_DTYPES: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")
#: moecc's dtype name -> torch dtype
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}
