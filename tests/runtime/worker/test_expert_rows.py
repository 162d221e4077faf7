"""The native element-wise passes around an expert's GEMMs (runtime/native/expert_rows.c) give
torch's passes' bits: silu_mul (bf16) that of F.silu(g) * u, scale_add_rows (fp32, bf16) that
of y.mul_(w[:, None]); out.index_add_(0, rows, y); where they do not apply they do nothing and
say so (allocating nothing); and kernels.experts / gated_mlp give the same bits with and without them,
and with packed experts gathered straight into their GEMMs' padded rows.

Legend: R = rows, I = intermediate size, H = hidden size, T = tokens, n = routed rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from moecc_runtime.native import expert_rows
from moecc_runtime.worker import kernels

pytestmark = pytest.mark.skipif(expert_rows._module() is None, reason="the native passes were not built")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, NaN made one value (a NaN's payload may differ from torch's)."""
    t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@settings(max_examples=30, deadline=None)
@given(R=st.integers(0, 70), I=st.integers(1, 40), pad=st.integers(0, 9), seed=st.integers(0, 2**16))
def test_silu_mul_is_torch_bits(R: int, I: int, pad: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(R, 2 * I + pad, generator=g) * 4).to(torch.bfloat16)  # [R, 2I + pad]: a row stride of its own
    if R:
        gu[0, 0], gu[-1, -1 - pad] = float("inf"), float("-inf")
    h = expert_rows.silu_mul(gu, I)  # [R, I]
    assert h is not None and h.shape == (R, I)
    ref = F.silu(gu[:, :I])
    ref.mul_(gu[:, I:2 * I])
    assert torch.equal(bits(h), bits(ref))


def test_silu_table_covers_every_bf16_value() -> None:
    """The table is torch's own silu of all 65,536 bf16 values, NaN and infinities included."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # [65536]
    gu = torch.stack([every, torch.ones_like(every)], dim=1)  # [65536, 2]: u = 1
    h = expert_rows.silu_mul(gu, 1)  # [65536, 1]
    assert h is not None
    assert torch.equal(bits(h[:, 0]), bits(F.silu(every)))


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 60), H=st.integers(1, 40), share=st.floats(0, 1), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), w_in_dtype=st.booleans())
def test_scale_add_rows_is_torch_bits(T, H, share, seed, dtype, w_in_dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    n = int(share * T)
    rows = torch.randperm(T, generator=g)[:n]  # [n] distinct
    out = torch.randn(T, H, generator=g).to(dtype)  # [T, H]
    y = torch.randn(n, H + 3, generator=g).to(dtype)[:, :H]  # [n, H], a row stride of H + 3
    w = torch.rand(n, generator=g).to(dtype if w_in_dtype else torch.float32)  # [n]
    ref = out.clone()
    yy = y.clone()
    yy.mul_(w[:, None])
    ref.index_add_(0, rows, yy)
    assert expert_rows.scale_add_rows(out, rows, y, w)
    assert torch.equal(bits(out), bits(ref))


def test_passes_that_do_not_apply_do_nothing() -> None:
    assert expert_rows.silu_mul(torch.ones(3, 8), 4) is None  # fp32: torch's silu
    assert expert_rows.silu_mul(torch.ones(8, 3, dtype=torch.bfloat16).t(), 4) is None  # columns strided
    out = torch.zeros(4, 5, dtype=torch.float16)
    assert not expert_rows.scale_add_rows(out, torch.tensor([0]), torch.ones(1, 5, dtype=torch.float16),
                                          torch.ones(1))
    assert not expert_rows.scale_add_rows(torch.zeros(4, 5), torch.tensor([0], dtype=torch.int32),
                                          torch.ones(1, 5), torch.ones(1))
    assert not expert_rows.scale_add_rows(torch.zeros(5, 4).t(), torch.tensor([0]), torch.ones(1, 5), torch.ones(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_same_bits_without_the_native_passes(monkeypatch, dtype) -> None:
    """kernels.experts over gate and up stored back to back: the same bits with the passes and
    with torch's."""
    g = torch.Generator().manual_seed(3)
    T, H, I, E, k = 50, 16, 24, 4, 2
    bank = []
    for _ in range(E):
        gu = (torch.randn(2 * I, H, generator=g) * 0.3).to(dtype)  # [2I, H]: gate then up, one storage
        bank.append((gu[:I], gu[I:], (torch.randn(H, I, generator=g) * 0.3).to(dtype)))
    x = torch.randn(T, H, generator=g).to(dtype)
    top_w, top_i = torch.topk(torch.randn(T, E, generator=g).softmax(-1), k)  # [T, k]

    def run() -> torch.Tensor:
        return kernels.experts(x, top_w, top_i, lambda used: (bank[e] for e in used), E, "silu", 16)[0]

    native = run()
    monkeypatch.setattr(expert_rows, "_module", lambda: None)
    assert torch.equal(native, run())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_gather_into_their_gemm_rows(monkeypatch, dtype) -> None:
    """Packed experts' rows are gathered straight into the rows their GEMMs run at (the rest
    zero, so no GEMM pads a copy): the same bits as gathering the rows alone."""
    from moecc_runtime.memory.packed_weights import PackedLinear, packing_available

    if not packing_available():
        pytest.skip("oneDNN's packed linear is not in this torch build")
    g = torch.Generator().manual_seed(4)
    T, H, I, E, k = 90, 32, 48, 4, 2  # 45 rows an expert on average: padded to 48
    bank = []
    for _ in range(E):
        gu = (torch.randn(2 * I, H, generator=g) * 0.3).to(dtype)  # [2I, H]
        down = (torch.randn(H, I, generator=g) * 0.3).to(dtype)  # [H, I]
        bank.append((PackedLinear(gu, 64, split=I, sections=(I, I)), None, PackedLinear(down, 64)))
    x = torch.randn(T, H, generator=g).to(dtype)
    top_w, top_i = torch.topk(torch.randn(T, E, generator=g).softmax(-1), k)  # [T, k]
    seen: list[int] = []
    gather = kernels._gather_rows

    def spy(x, tok, w):
        rows = gather(x, tok, w)
        seen.append(rows.shape[0] - tok.shape[0])
        return rows

    monkeypatch.setattr(kernels, "_gather_rows", spy)
    padded = kernels.experts(x, top_w, top_i, lambda used: (bank[e] for e in used), E, "silu", 64)[0]
    assert any(seen), "no expert's rows were padded: the case does not test the padding"
    monkeypatch.setattr(kernels, "_gather_rows", lambda x, tok, w: x.index_select(0, tok))
    assert torch.equal(padded, kernels.experts(x, top_w, top_i, lambda used: (bank[e] for e in used), E, "silu", 64)[0])
