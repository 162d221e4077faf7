"""The compute dtype of a compile (`moecc compile --dtype auto|bfloat16|float16|float32`) and
why: auto is what transformers' dtype="auto" loads (moecc/frontend/config.py compute_dtype);
any other value is computed in whatever the weights are stored in: the runtime casts every
floating weight slice of another dtype when it reads it (moecc_runtime/memory/weights.py) and
dequantizes quantized ones into it; activations, attention and the KV cache are in it.

Needs: a read checkpoint and its parsed config. Guarantees: (dtype, why) with dtype one of
DTYPE_CHOICES[1:], or a ValueError naming --dtype.
"""

from __future__ import annotations

from typing import Any

from moecc.frontend.checkpoint import Checkpoint
from moecc.frontend.config import compute_dtype

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


def check_dtype(dtype: str) -> None:
    """Refuse a --dtype value moecc does not compute in, naming the option."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, not {dtype!r}")


def _auto_why(ckpt: Checkpoint, config: Any, dtype: str) -> str:
    configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if ckpt.config.get("quantization_config") is not None:
        return f"config.json's dtype of a quantized checkpoint (its weights are dequantized into {dtype})"
    floats = {loc.dtype for loc in ckpt.tensors.values()}
    if ckpt.tensors and floats == {dtype}:
        return f"every weight is stored in {dtype} (read in place)"
    if configured is not None:
        return "config.json's torch_dtype (weights of another dtype cast to it when read)"
    return "the first floating weight's dtype (config.json names none)"


def choose_dtype(ckpt: Checkpoint, config: Any, requested: str = "auto") -> tuple[str, str]:
    """(the compute dtype, why), for --dtype `requested`."""
    check_dtype(requested)
    auto = compute_dtype(ckpt, config)
    if requested == "auto":
        return auto, f"--dtype auto: {_auto_why(ckpt, config, auto)}"
    if requested == auto:
        return auto, f"--dtype {requested}, which is also what auto picks"
    return requested, (f"--dtype {requested} (auto would be {auto}): weights stored in another dtype are cast to "
                       f"{requested} when read, activations and the KV cache are {requested}")
