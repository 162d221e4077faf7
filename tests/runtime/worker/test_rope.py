"""kernels.apply_rope computes transformers' x * cos + rotate_half(x) * sin by halves, with the
same bits, in every dtype and on strided views (fp32 and bf16 on the host through the native
pass, runtime/native/rope.c, where it was built); attention_qkv rotates a packed q|k|v GEMM's q
and k as one, with the same bits as each alone.

Legend: T = tokens, Hq / Hkv = query / key-value heads, D = head dim."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from moecc_runtime.native import rope as native_rope
from moecc_runtime.worker import kernels


def transformers_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' own apply_rotary_pos_emb (Mixtral's) for one tensor: x [n, heads, D],
    cos/sin [n, D] unsqueezed over the heads."""
    from transformers.models.mixtral.modeling_mixtral import apply_rotary_pos_emb

    return apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=1)[0]


def _table(T: int, D: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, D] as rope_table makes them (halves equal) at random positions."""
    pos = torch.randint(0, 4096, (T,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    t = kernels.rope_table(pos, inv, 1.0, dtype)  # [T, 2D]
    return t[:, :D], t[:, D:]


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 300), heads=st.integers(1, 9), D=st.sampled_from([2, 32, 64, 96, 128]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       strided=st.booleans(), table=st.booleans())
def test_same_bits_as_transformers(T: int, heads: int, D: int, dtype: torch.dtype, strided: bool,
                                   table: bool) -> None:
    g = torch.Generator().manual_seed(T * 131 + heads * 7 + D)
    if strided:  # a column view of a wider buffer, as a GEMM output's split gives
        x = (torch.randn(T, heads * D + 3 * D, generator=g) * 4).to(dtype)[:, D:D + heads * D].view(T, heads, D)
    else:
        x = (torch.randn(T, heads, D, generator=g) * 4).to(dtype)
    if table:
        cos, sin = _table(T, D, dtype, g)
    else:  # halves not equal: nothing assumed of the table
        cos, sin = torch.randn(T, D, generator=g).to(dtype), torch.randn(T, D, generator=g).to(dtype)
    got, want = kernels.apply_rope(x, cos, sin), transformers_rope(x, cos, sin)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 7, 512])
def test_packed_qkv_rotated_as_one(dtype: torch.dtype, T: int) -> None:
    """q and k side by side in one buffer (the packed GEMM's output): the same q, k and v as
    three separate projections rotated each alone."""
    from moecc_runtime.memory.packed_weights import PackedLinear, packing_available

    if not packing_available():
        pytest.skip("oneDNN's packed linear is not in this torch build")
    Hq, Hkv, D, H = 8, 2, 96, 256
    g = torch.Generator().manual_seed(T)
    ws = [torch.randn(n * D, H, generator=g).to(dtype) / 16 for n in (Hq, Hkv, Hkv)]
    x = torch.randn(T, H, generator=g).to(dtype)
    a = {"head_dim": D, "num_heads": Hq, "num_kv_heads": Hkv}
    rope = torch.cat(_table(T, D, dtype, g), dim=-1)  # [T, 2D]
    sections = tuple(int(w.shape[0]) for w in ws)
    packed = {"q": PackedLinear(torch.cat(ws), T, split=sections[0], sections=sections), "k": None, "v": None}
    q, k, v = kernels.attention_qkv(x, packed, a, rope)
    y = packed["q"](x)  # [T, (Hq + 2 Hkv) D]: the same GEMM, then each part alone
    cos, sin = rope[:, :D], rope[:, D:]
    qs, ks, vs = y.split(sections, dim=-1)
    assert torch.equal(q, transformers_rope(qs.reshape(T, Hq, D), cos, sin))
    assert torch.equal(k, transformers_rope(ks.reshape(T, Hkv, D), cos, sin))
    assert torch.equal(v, vs.reshape(T, Hkv, D))


def test_side_by_side_needs_one_buffer() -> None:
    """q and k are rotated as one only when they are column slices of one buffer; separate
    tensors (separate projections, a clone) never, even when their memory happens to touch."""
    buf = torch.randn(3, 10 * 4)  # [T, (Hq + 2 Hkv) D] with Hq 6, Hkv 2, D 4
    q, k, v = buf.split((24, 8, 8), dim=-1)
    assert kernels._side_by_side(q, k)
    assert not kernels._side_by_side(q, v)  # v follows k, not q
    assert not kernels._side_by_side(q, k.clone())
    one = torch.randn(2, 8)  # T = 1, MHA: q's only row and k's could be neighbours in memory
    assert not kernels._side_by_side(one[0:1].clone(), one[1:2].clone())


@pytest.mark.skipif(native_rope._module() is None, reason="the native rope was not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_pass_taken_with_torch_bits(monkeypatch, dtype: torch.dtype) -> None:
    """The host pass runs for fp32 and bf16 (a packed q|k view, the table's halves) and gives the
    bits of torch's passes; float16 and a non-contiguous head dimension are left to torch."""
    g = torch.Generator().manual_seed(5)
    T, Hq, Hkv, D = 37, 4, 2, 64
    qkv = (torch.randn(T, (Hq + 2 * Hkv) * D, generator=g) * 4).to(dtype)  # [T, (Hq + 2 Hkv) D]
    x = qkv.as_strided((T, Hq + Hkv, D), (qkv.stride(0), D, 1))  # [T, Hq + Hkv, D]: q and k
    cos, sin = _table(T, D, dtype, g)
    native = native_rope.rope(x, cos, sin)
    assert native is not None and native.is_contiguous()
    monkeypatch.setattr(native_rope, "_module", lambda: None)
    assert torch.equal(native, kernels.apply_rope(x, cos, sin))
    monkeypatch.undo()
    assert native_rope.rope(x.half(), cos.half(), sin.half()) is None
    assert native_rope.rope(x.transpose(1, 2)[:, :, :Hq + Hkv].contiguous().transpose(1, 2), cos, sin) is None


@pytest.mark.skipif(native_rope._module() is None, reason="the native rope was not built")
@pytest.mark.parametrize("D", [2, 32, 80, 96, 200])
def test_native_bf16_bits_with_subnormal_nan_and_inf_lanes(monkeypatch, D: int) -> None:
    """bf16 rows rounded 16 lanes at a time (AVX512-BF16's conversion where the CPU has it) give
    torch's bits where a lane is subnormal, NaN or infinite too (those blocks take the integer
    rounding), and in the lanes past the last block of 16 (D / 2 of 1, 40, 100); NaN where torch
    has NaN."""
    g = torch.Generator().manual_seed(D)
    T, heads = 41, 5
    x = torch.randn(T, heads, D, generator=g) * 4  # [T, heads, D]
    cos, sin = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)  # [T, D]
    m = torch.rand(T, heads, D, generator=g)
    x[m < 0.01], x[(m >= 0.01) & (m < 0.03)], x[(m >= 0.03) & (m < 0.04)] = float("nan"), 1e-39, float("inf")
    x[3], x[4] = 1e-38, 3e-39  # whole rows whose products are subnormal
    mc = torch.rand(T, D, generator=g)
    cos[mc < 0.03], sin[mc > 0.97] = 1e-20, -2e-20
    x, cos, sin = x.bfloat16(), cos.bfloat16(), sin.bfloat16()
    got = native_rope.rope(x, cos, sin)
    monkeypatch.setattr(native_rope, "_module", lambda: None)
    want = kernels.apply_rope(x, cos, sin)
    nan = torch.isnan(want)
    assert got is not None and torch.equal(torch.isnan(got), nan)
    assert torch.equal(got.masked_fill(nan, 0).view(torch.int16), want.masked_fill(nan, 0).view(torch.int16))
