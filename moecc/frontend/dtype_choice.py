"""The compute dtype of a compile (`moecc compile --dtype auto|fastest|bfloat16|float16|float32`)
and why: auto is what transformers' dtype="auto" loads (moecc/frontend/config.py compute_dtype);
fastest is auto, or bfloat16 in place of an fp32 auto where the target hardware's profile
computes a GEMM at decode's row counts (FASTEST_ROWS) at least FASTEST_MARGIN faster in
bfloat16 (a CPU with AVX512-BF16, a GPU with bf16 tensor cores): outputs then differ from
fp32 as any bf16 run does (the demo model's held-out perplexity: docs/cli.md);
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

DTYPE_CHOICES = ("auto", "fastest", "bfloat16", "float16", "float32")
FASTEST_ROWS = 256  # rows of the GEMM `fastest` compares at (an expert's rows in a decode step)
FASTEST_MARGIN = 1.1  # bfloat16 must be this much faster to replace fp32


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


def _fastest(auto: str, hardware: str | None) -> tuple[str, str]:
    """--dtype fastest: (dtype, why) from the hardware profile's GEMM rates."""
    from moecc.planner.hardware import resolve_hardware

    if auto != "float32":
        return auto, f"--dtype fastest: the weights' {auto} (only an fp32 model is computed in bfloat16 instead)"
    hw = resolve_hardware(hardware)
    fp32, bf16 = (hw.gemm_rate(d, FASTEST_ROWS) for d in ("float32", "bfloat16"))
    rates = (f"{hw.name}'s GEMM at {FASTEST_ROWS} rows: bfloat16 {bf16 / 1e9:.0f} GFLOP/s, "
             f"float32 {fp32 / 1e9:.0f}")
    if bf16 >= FASTEST_MARGIN * fp32:
        return "bfloat16", f"--dtype fastest: bfloat16 for an fp32 model ({rates}); weights cast once when read"
    return "float32", f"--dtype fastest: the weights' float32 ({rates}: bfloat16 not {FASTEST_MARGIN}x faster)"


def choose_dtype(ckpt: Checkpoint, config: Any, requested: str = "auto", hardware: str | None = None
                 ) -> tuple[str, str]:
    """(the compute dtype, why), for --dtype `requested`; `hardware` (--hardware) is the
    profile `fastest` reads (None: this machine's preset)."""
    check_dtype(requested)
    auto = compute_dtype(ckpt, config)
    if requested == "auto":
        return auto, f"--dtype auto: {_auto_why(ckpt, config, auto)}"
    if requested == "fastest":
        return _fastest(auto, hardware)
    if requested == auto:
        return auto, f"--dtype {requested}, which is also what auto picks"
    return requested, (f"--dtype {requested} (auto would be {auto}): weights stored in another dtype are cast to "
                       f"{requested} when read, activations and the KV cache are {requested}")
