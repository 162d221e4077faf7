"""Causal attention of fresh prompts in fp32 on a CPU with AVX-512 (prompt_fp32.c,
`moecc_runtime.native._prompt_fp32`): every prompt of a prefill step whose rows are its whole
context, in one native call, fp32 in and out. torch's SDPA runs such prompts in fp32 at ~100-140
GFLOP/s on two cores of an AMX Xeon (300-600 tokens, head dim 96); the kernel keeps a block's
scores transposed so its products are register tiles of FMAs and its softmax runs down the
rows' lanes (bench/results/README.md, thirteenth pass, has the figures: `python
bench/attention.py --prompts 300,450,600 --seqs 16 --dtypes float32`).

Its bits are not SDPA's (one pass over a block's keys, its own exp), but they part only by fp32
rounding, so the runtime takes it for every fresh prompt (host_attention.FP32_PROMPT_ROWS), where
the bf16 AMX kernel, whose rounding shows, waits for AMX_PROMPT_ROWS rows.

`attend` returns False, having done nothing, where it does not apply: not built, no AVX-512 here
(or MOECC_NO_NATIVE / MOECC_PROMPT_FP32=0), not fp32, head dims not multiples of 16, query heads
not a multiple of the KV heads, rows not contiguous in the last dim.
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.native import prompt_call, ready_extension


def _module() -> Any:
    """The extension, or None: not built, turned off, or no AVX-512 on this CPU."""
    return ready_extension("_prompt_fp32", "moecc_prompt_fp32", "MOECC_PROMPT_FP32")


def available() -> bool:
    """The kernel runs here (built, AVX-512, not turned off)."""
    return _module() is not None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]], scale: float,
           out: torch.Tensor) -> bool:
    """out[lo:hi] = causal attention of each fresh prompt's rows [lo, hi) over its own K/V (GQA:
    query head g reads KV head g // (Hq // Hkv)). q: [t, Hq, D]  k: [t, Hkv, D]  v: [t, Hkv, Dv]
    out: [t, Hq, Dv], all fp32 on the CPU, heads and dims contiguous in a row. False: not done,
    nothing written (module docstring)."""
    return prompt_call.attend(_module(), torch.float32, "prompt_fp32", q, k, v, spans, scale, out)
