"""Fresh prompts attended in padded batches (kernels.prompt_batches / attend_prompts): every
prompt in exactly one batch, padding bounded, and the same outputs as one causal SDPA call per
prompt (kernels.attend over its own K/V)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moecc_runtime.worker import kernels


def _spans(lengths: list[int]) -> list[tuple[int, int]]:
    out, at = [], 0
    for n in lengths:
        out.append((at, at + n))
        at += n
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(2, 700), min_size=1, max_size=60))
def test_every_prompt_in_one_batch_with_bounded_padding(lengths):
    spans = _spans(lengths)
    groups = kernels.prompt_batches(spans)
    assert sorted(s for g in groups for s in g) == sorted(spans)
    for g in groups:
        longest = max(hi - lo for lo, hi in g)
        assert g[0][1] - g[0][0] == longest  # the padded length leads
        assert all((hi - lo) * kernels.PROMPT_PAD_RATIO >= longest for lo, hi in g)
        assert len(g) == 1 or len(g) * longest <= kernels.PROMPT_BATCH_ROWS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_prompts_attend_as_one_call_each(dtype, monkeypatch):
    monkeypatch.setattr(kernels, "PROMPT_PAD_RATIO", 1.25)  # padded batches: within rounding
    g = torch.Generator().manual_seed(0)
    lengths = [5, 40, 33, 7, 36, 2, 64, 51]
    t, Hq, Hkv, D = sum(lengths), 8, 2, 16
    q, k, v = (torch.randn(t, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    spans = _spans(lengths)
    out = torch.empty(t, Hq, D, dtype=torch.float32)
    kernels.attend_prompts(q, k, v, spans, 0.25, out)
    for lo, hi in spans:
        want = kernels.attend(q[lo:hi], k[lo:hi].transpose(0, 1), v[lo:hi].transpose(0, 1), 0, {"scaling": 0.25})
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[lo:hi].reshape(hi - lo, -1), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_length_prompts_attend_bit_for_bit_as_one_call_each(dtype):
    g = torch.Generator().manual_seed(1)
    lengths = [24, 24, 24, 9, 9]
    t, Hq, Hkv, D = sum(lengths), 8, 2, 16
    q, k, v = (torch.randn(t, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    spans = _spans(lengths)
    assert sorted(len(b) for b in kernels.prompt_batches(spans)) == [2, 3]
    out = torch.empty(t, Hq, D, dtype=torch.float32)
    kernels.attend_prompts(q, k, v, spans, 0.25, out)
    for lo, hi in spans:
        want = kernels.attend(q[lo:hi], k[lo:hi].transpose(0, 1), v[lo:hi].transpose(0, 1), 0, {"scaling": 0.25})
        assert torch.equal(out[lo:hi].reshape(hi - lo, -1), want.float())
