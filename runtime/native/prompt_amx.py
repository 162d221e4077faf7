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

from moecc_runtime.native import ready_extension


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
    mod = _module()
    if mod is None or not spans:
        return False
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.dim() != 3 for t in (q, k, v, out)):
        return False
    Hq, D, Hkv, Dv = q.shape[1], q.shape[2], k.shape[1], v.shape[2]
    if (D % 16 or Dv % 16 or Hq % Hkv or k.shape[2] != D or v.shape[1] != Hkv or out.shape[1:] != (Hq, Dv)
            or any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (q, k, v, out))):
        return False
    if any(hi <= lo or lo < 0 or hi > q.shape[0] for lo, hi in spans) or k.shape[0] < q.shape[0] or v.shape[0] < q.shape[0]:
        return False
    sp = torch.tensor(spans, dtype=torch.int64)  # [ns, 2]
    rc = mod.attend(q.data_ptr(), q.shape[0], q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), sp.data_ptr(),
                    len(spans), Hq, Hkv, D, Dv, float(scale), out.data_ptr(), out.stride(0),
                    torch.get_num_threads())
    if rc == 3:
        raise MemoryError("prompt_amx: no thread got memory for its scratch (the K/V tiles of the longest prompt, its scores)")
    return rc == 0
