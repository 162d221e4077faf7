"""The AMX prompt-attention kernel (native/prompt_amx.py): causal attention of fresh prompts,
bf16 in and out, as close to the exact (fp64) attention as torch's bf16 SDPA is; the rows it
does not own untouched; declines (nothing written) what it does not take; and host attention
takes it only for prompts of AMX_PROMPT_ROWS rows or more (shorter ones keep SDPA's bits)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pytest
from moecc_runtime.native import prompt_amx
from moecc_runtime.worker import host_attention
from tests.runtime.worker.prompt_cases import assert_as_close_as_sdpa, case

needs_amx = pytest.mark.skipif(not prompt_amx.available(), reason="the AMX prompt kernel does not run here")


def _bf16(*a, **kw):
    """prompt_cases.case in bf16."""
    return case(*a, dtype=torch.bfloat16, **kw)


@needs_amx
@settings(max_examples=40, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=5), heads=st.sampled_from([(1, 1), (4, 2), (6, 3), (8, 1)]),
       dims=st.sampled_from([(16, 16), (32, 32), (48, 48), (64, 64), (96, 96), (128, 128), (32, 64)]),
       gap=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_attention_is_as_close_to_exact_as_bf16_sdpa(lengths, heads, dims, gap, seed):
    (Hq, Hkv), (D, Dv) = heads, dims
    q, k, v, spans = _bf16(lengths, Hq, Hkv, D, Dv, seed, gap)
    out = torch.full((q.shape[0], Hq, Dv), 3.0, dtype=torch.bfloat16)
    assert prompt_amx.attend(q, k, v, spans, D ** -0.5, out)
    assert_as_close_as_sdpa(q, k, v, spans, out, torch.bfloat16, factor=1.5, slack=2e-3, untouched=3.0)


@needs_amx
def test_threads_agree_bitwise():
    q, k, v, spans = _bf16([300, 77, 450, 1, 129], 8, 2, 96, 96, seed=3)
    outs = []
    for n in (1, 2):
        out = torch.empty(q.shape[0], 8, 96, dtype=torch.bfloat16)
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            assert prompt_amx.attend(q, k, v, spans, 0.1, out)
        finally:
            torch.set_num_threads(before)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@needs_amx
@pytest.mark.parametrize("Hq, Hkv", [(8, 2), (8, 1), (12, 4), (6, 2), (4, 4)])
def test_a_prompt_alone_has_its_bits_among_many(Hq, Hkv):
    """A work item is a KV head's query heads, split when prompts are too few for the threads:
    either way a prompt's rows get the same bits."""
    q, k, v, spans = _bf16([300, 77, 450, 129, 64, 33, 200, 90, 301], Hq, Hkv, 96, 96, seed=7)
    together = torch.empty(q.shape[0], Hq, 96, dtype=torch.bfloat16)
    assert prompt_amx.attend(q, k, v, spans, 0.1, together)
    for lo, hi in spans[:3]:
        alone = torch.empty(hi - lo, Hq, 96, dtype=torch.bfloat16)
        assert prompt_amx.attend(q[lo:hi], k[lo:hi], v[lo:hi], [(0, hi - lo)], 0.1, alone)
        assert torch.equal(alone.view(torch.int16), together[lo:hi].view(torch.int16))


@pytest.mark.parametrize("what", ["fp32", "dim", "heads", "span", "off"])
def test_declines_what_it_does_not_take(what, monkeypatch):
    q, k, v, spans = _bf16([40, 20], 4, 2, 32, 32)
    if what == "fp32":
        q, k, v = q.float(), k.float(), v.float()
    elif what == "dim":
        q, k, v = q[..., :8].contiguous(), k[..., :8].contiguous(), v[..., :8].contiguous()
    elif what == "heads":
        q = q[:, :3].contiguous()
    elif what == "span":
        spans = [(0, q.shape[0] + 1)]
    else:
        monkeypatch.setenv("MOECC_PROMPT_AMX", "0")
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), 5.0, dtype=q.dtype)
    assert not prompt_amx.attend(q, k, v, spans, 0.1, out)
    assert torch.all(out == 5.0)


@needs_amx
def test_host_attention_takes_it_for_long_prompts_only(monkeypatch):
    """Prompts of AMX_PROMPT_ROWS rows or more go through the kernel; shorter ones keep the
    batched SDPA path's bits exactly."""
    q, k, v, spans = _bf16([40, 40, 12, 12], 8, 2, 64, 64, seed=5)
    got = {}
    for rows in (None, 40):
        monkeypatch.setattr(host_attention, "AMX_PROMPT_ROWS", rows)
        out = torch.empty(q.shape[0], 8, 64, dtype=torch.bfloat16)
        done = host_attention.HostAttention._attend_fresh(q, k, v, spans, 64 ** -0.5, out)
        assert done == set(spans)
        got[rows] = out
    short = slice(80, 104)
    assert torch.equal(got[40][short], got[None][short])  # SDPA either way
    assert not torch.equal(got[40][:80], got[None][:80])  # the kernel's own rounding
    torch.testing.assert_close(got[40][:80].float(), got[None][:80].float(), rtol=2e-2, atol=2e-2)
