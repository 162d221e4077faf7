"""The fp32 prompt-attention kernel (native/prompt_fp32.py): causal attention of fresh prompts,
fp32 in and out, as close to the exact (fp64) attention as torch's fp32 SDPA is; the rows it does
not own untouched; a prompt's bits its own whatever else is in the call or how many threads run;
declines (nothing written) what it does not take; and host attention sends every fresh fp32
prompt through it."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pytest
from moecc_runtime.native import prompt_fp32
from moecc_runtime.worker import host_attention
from tests.runtime.worker.prompt_cases import assert_as_close_as_sdpa, case

needs_kernel = pytest.mark.skipif(not prompt_fp32.available(), reason="the fp32 prompt kernel does not run here")


@needs_kernel
@settings(max_examples=40, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=5), heads=st.sampled_from([(1, 1), (4, 2), (6, 3), (8, 1)]),
       dims=st.sampled_from([(16, 16), (32, 32), (48, 48), (64, 64), (96, 96), (128, 128), (32, 64), (16, 80)]),
       gap=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_attention_is_as_close_to_exact_as_fp32_sdpa(lengths, heads, dims, gap, seed):
    (Hq, Hkv), (D, Dv) = heads, dims
    q, k, v, spans = case(lengths, Hq, Hkv, D, Dv, seed, gap)
    out = torch.full((q.shape[0], Hq, Dv), 3.0)
    assert prompt_fp32.attend(q, k, v, spans, D ** -0.5, out)
    assert_as_close_as_sdpa(q, k, v, spans, out, torch.float32, factor=2, slack=1e-6, untouched=3.0)


@needs_kernel
def test_a_prompt_has_its_own_bits_alone_among_many_and_on_any_threads():
    q, k, v, spans = case([300, 77, 450, 1, 129, 48, 49], 8, 2, 96, 96, seed=3)
    together = torch.empty(q.shape[0], 8, 96)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert prompt_fp32.attend(q, k, v, spans, 0.1, together)
    finally:
        torch.set_num_threads(before)
    for lo, hi in spans:
        alone = torch.empty(hi - lo, 8, 96)
        assert prompt_fp32.attend(q[lo:hi], k[lo:hi], v[lo:hi], [(0, hi - lo)], 0.1, alone)
        assert torch.equal(alone, together[lo:hi])


@pytest.mark.parametrize("what", ["bf16", "dim", "heads", "span", "out", "off"])
def test_declines_what_it_does_not_take(what, monkeypatch):
    q, k, v, spans = case([40, 20], 4, 2, 32, 32)
    if what == "bf16":
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    elif what == "dim":
        q, k, v = q[..., :8].contiguous(), k[..., :8].contiguous(), v[..., :8].contiguous()
    elif what == "heads":
        q = q[:, :3].contiguous()
    elif what == "span":
        spans = [(0, q.shape[0] + 1)]
    elif what != "out":
        monkeypatch.setenv("MOECC_PROMPT_FP32", "0")
    rows = q.shape[0] - (what == "out")  # "out": one row short of q's
    out = torch.full((rows, q.shape[1], v.shape[2]), 5.0, dtype=q.dtype)
    assert not prompt_fp32.attend(q, k, v, spans, 0.1, out)
    assert torch.all(out == 5.0)


@needs_kernel
def test_host_attention_sends_every_fresh_fp32_prompt_through_it(monkeypatch):
    """With the kernel every fresh prompt is done by it, one alone included (SDPA's batch path
    takes two or more); without it (FP32_PROMPT_ROWS None) the same outputs within fp32 rounding."""
    q, k, v, spans = case([40, 40, 12, 7], 8, 2, 64, 64, seed=5)
    calls = []
    attend = prompt_fp32.attend
    monkeypatch.setattr(prompt_fp32, "attend", lambda *a: calls.append(a[3]) or attend(*a))
    got = {}
    for rows in (None, 2):
        monkeypatch.setattr(host_attention, "FP32_PROMPT_ROWS", rows)
        out = torch.empty(q.shape[0], 8, 64)
        assert host_attention.HostAttention._attend_fresh(q, k, v, spans, 64 ** -0.5, out) == set(spans)
        got[rows] = out
    assert calls == [spans]
    torch.testing.assert_close(got[2], got[None], rtol=1e-5, atol=1e-6)
    one = torch.empty(q.shape[0], 8, 64)
    assert host_attention.HostAttention._attend_fresh(q, k, v, spans[3:], 64 ** -0.5, one) == {spans[3]}
    assert calls == [spans, spans[3:]]
