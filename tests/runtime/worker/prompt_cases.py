"""Cases the fresh-prompt kernels' tests share (test_prompt_amx.py, test_prompt_fp32.py): prompts'
q/k/v rows, causal SDPA of one prompt as the reference, and the check that a kernel's output is as
close to the exact attention as SDPA's in the kernel's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def case(lengths: list[int], Hq: int, Hkv: int, D: int, Dv: int, seed: int = 0, gap: int = 0,
         dtype: torch.dtype = torch.float32):
    """q/k/v [t, H, D|Dv] of `dtype` for prompts of `lengths` rows, `gap` foreign rows between
    them (drawn in fp32, then cast), and their spans."""
    g = torch.Generator().manual_seed(seed)
    spans, at = [], gap
    for n in lengths:
        spans.append((at, at + n))
        at += n + gap
    q, k = (torch.randn(at, h, D, generator=g).to(dtype) for h in (Hq, Hkv))
    v = torch.randn(at, Hkv, Dv, generator=g).to(dtype)
    return q, k, v, spans


def sdpa(q, k, v, lo, hi, dtype):
    """[n, Hq, Dv]: causal SDPA of rows [lo, hi) in `dtype` (GQA by repeating the KV heads)."""
    rep = q.shape[1] // k.shape[1]
    qs, ks, vs = (x[lo:hi].to(dtype).transpose(0, 1) for x in (q, k, v))
    o = F.scaled_dot_product_attention(qs, ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0),
                                       is_causal=True, scale=q.shape[2] ** -0.5)
    return o.transpose(0, 1)


def assert_as_close_as_sdpa(q, k, v, spans, out, dtype, factor: float, slack: float, untouched: float):
    """Each span of `out` within factor x SDPA's error (in `dtype`) + slack of the fp64 attention,
    and every row of no span still `untouched`."""
    owned = torch.zeros(q.shape[0], dtype=torch.bool)
    for lo, hi in spans:
        owned[lo:hi] = True
        exact = sdpa(q, k, v, lo, hi, torch.float64)
        sdpa_err = (sdpa(q, k, v, lo, hi, dtype).double() - exact).abs().max().item()
        err = (out[lo:hi].double() - exact).abs().max().item()
        assert err <= factor * sdpa_err + slack, (lo, hi, err, sdpa_err)
    assert torch.all(out[~owned] == untouched)  # rows of no prompt: untouched
