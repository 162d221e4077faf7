"""The sampler's greedy pass (native.greedy_rows, sampler.greedy): every row's first index of its
largest logit, -1 where the row is not finite, as torch's max and isfinite give, for fp32 and
bf16 logits read in their own dtype."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moecc_runtime import native
from moecc_runtime.sampling.params import SamplingParams
from moecc_runtime.sampling.sampler import greedy, sample

needs_pass = pytest.mark.skipif(not native.sampling_available(), reason="the sampler's host pass was not built")


def _reference(x: torch.Tensor) -> torch.Tensor:
    best = x.float().amax(dim=-1)
    first = (x.float() == best[:, None]).int().argmax(dim=-1)  # the first index holding the largest
    return torch.where(torch.isfinite(best) & ~x.float().isnan().any(dim=-1), first, torch.full_like(first, -1))


@st.composite
def logit_rows(draw):
    R, V = draw(st.integers(1, 12)), draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**16))
    x = torch.randn(R, V, generator=torch.Generator().manual_seed(seed))
    x = x.round(decimals=draw(st.integers(0, 2)))  # coarse values: ties
    for r in range(R):  # each row maybe given a NaN, +-inf, all -inf, a tie at the top
        kind = draw(st.sampled_from(["plain", "nan", "inf", "-inf", "all-inf", "tie"]))
        i = draw(st.integers(0, V - 1))
        if kind == "nan":
            x[r, i] = float("nan")
        elif kind == "inf":
            x[r, i] = float("inf")
        elif kind == "-inf":
            x[r, i] = float("-inf")
        elif kind == "all-inf":
            x[r] = float("-inf")
        elif kind == "tie":
            x[r, i] = x[r, -1] = x[r].max() + 1
    return x.to(draw(st.sampled_from([torch.float32, torch.bfloat16])))


@needs_pass
@settings(max_examples=300, deadline=None, derandomize=True)
@given(x=logit_rows())
def test_native_greedy_is_torchs_first_argmax_or_minus_one(x):
    assert torch.equal(native.greedy_rows(x), _reference(x))


@needs_pass
def test_row_stride_and_threads():
    x = torch.randn(64, 9000)[:, :8193]  # rows 9000 apart
    want = _reference(x)
    before = torch.get_num_threads()
    for n in (1, 2):
        torch.set_num_threads(n)
        try:
            assert torch.equal(native.greedy_rows(x), want)
        finally:
            torch.set_num_threads(before)


def test_greedy_without_the_pass_gives_the_same_tokens(monkeypatch):
    x = torch.randn(9, 500).to(torch.bfloat16)
    x[2, 3] = float("nan")
    want = greedy(x)
    monkeypatch.setattr(native, "greedy_rows", lambda t: None)
    assert torch.equal(greedy(x), want)


def test_plain_greedy_sample_of_bf16_logits_equals_fp32():
    x = torch.randn(16, 700).to(torch.bfloat16)
    params = [SamplingParams(max_tokens=4)] * 16
    assert torch.equal(sample(x, params, [None] * 16), sample(x.float(), params, [None] * 16))
