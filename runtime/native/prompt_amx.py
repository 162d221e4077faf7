"""Causal attention of fresh prompts on a CPU with AMX (prompt_amx.c,
`moecc_runtime.native._prompt_amx`): every prompt of a prefill step whose rows are its whole
context, in one native call, bf16 in and out. torch's SDPA runs such prompts at 230-430 GFLOP/s
on two cores of an AMX Xeon (300-600 tokens, head dim 96), the kernel at 630-930, 2.2-2.7x: the
products on the tiles, the softmax in AVX-512 (`python bench/attention.py --prompts 300,450,600
--seqs 16 --dtypes bfloat16`).

Its bits are not SDPA's (prompt_amx.c: one pass over a row block's keys, its own exp), so the
runtime takes it only for prompts of at least `min_rows` rows (host_attention.py), leaving the
short prompts on SDPA, which in bf16 rounds as transformers' own prefill does.

`attend` returns False, having done nothing, where it does not apply: not built, no AMX here (or
MOECC_NO_NATIVE / MOECC_PROMPT_AMX=0), not bf16, head dims not multiples of 16, query heads not a
multiple of the KV heads, rows not contiguous in the last dim.
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.native import prompt_call, ready_extension


def _module() -> Any:
    """The extension, or None: not built, turned off, or no AMX on this CPU/OS."""
    return ready_extension("_prompt_amx", "moecc_prompt_amx", "MOECC_PROMPT_AMX")


def available() -> bool:
    """The kernel runs here (built, AMX, not turned off)."""
    return _module() is not None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]], scale: float,
           out: torch.Tensor) -> bool:
    """out[lo:hi] = causal attention of each fresh prompt's rows [lo, hi) over its own K/V (GQA:
    query head g reads KV head g // (Hq // Hkv)). q: [t, Hq, D]  k: [t, Hkv, D]  v: [t, Hkv, Dv]
    out: [t, Hq, Dv], all bf16 on the CPU, heads and dims contiguous in a row. False: not done,
    nothing written (module docstring)."""
    return prompt_call.attend(_module(), torch.bfloat16, "prompt_amx", q, k, v, spans, scale, out)
