"""The host RMSNorm pass (runtime/native/rmsnorm.c) gives transformers' RMSNorm bits: fp32 and
bf16, widths below torch's sum vector, around its cascade levels and odd tails, strided rows,
per-head inputs, one thread or two; it steps aside (None, nothing done) where it does not
apply, and kernels.rmsnorm is then torch's own; the width of torch's sum it follows is found
by calibration, also under another of torch's CPU builds.

Legend: T = rows, H = the normalised width."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from moecc_runtime.native import rmsnorm as native_rmsnorm
from moecc_runtime.worker import kernels

pytestmark = pytest.mark.skipif(native_rmsnorm._module() is None, reason="the native rmsnorm was not built")

WIDTHS = [1, 3, 7, 8, 9, 31, 64, 65, 96, 128, 200, 768, 1000, 1024, 1025, 2048, 2049, 4096, 5120, 8192, 16384]


def transformers_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' own MixtralRMSNorm with weight w."""
    from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm

    norm = MixtralRMSNorm(w.shape[0], eps=eps).to(w.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        return norm(x)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def test_calibrated_here() -> None:
    assert native_rmsnorm.sum_lanes() in (8, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", WIDTHS)
def test_same_bits_as_transformers(dtype: torch.dtype, H: int) -> None:
    g = torch.Generator().manual_seed(H)
    for scale in (1e-3, 1.0, 300.0):
        x = (torch.randn(37, H, generator=g) * scale).to(dtype)
        w = torch.randn(H, generator=g).to(dtype)
        got = native_rmsnorm.rmsnorm(x, w, 1e-6)
        assert got is not None and got.dtype == dtype and got.shape == x.shape
        assert torch.equal(_bits(got), _bits(transformers_norm(x, w, 1e-6))), (dtype, H, scale)


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 700), H=st.sampled_from(WIDTHS[:-2]), heads=st.sampled_from([0, 3]),
       strided=st.booleans(), threads=st.sampled_from([1, 2]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), eps=st.sampled_from([1e-5, 1e-6, 0.1]))
def test_any_rows_views_and_threads(T: int, H: int, heads: int, strided: bool, threads: int,
                                    dtype: torch.dtype, eps: float) -> None:
    """Row counts across the thread items, per-head inputs [T, heads, H] (q/k norms), a column
    view of a wider buffer (a fused GEMM's split), one thread or two."""
    g = torch.Generator().manual_seed(T * 31 + H)
    if strided:
        x = torch.randn(T, H + 5, generator=g).to(dtype)[:, 2:2 + H]  # [T, H], row stride H + 5
        if heads:
            x = x.unsqueeze(1).expand(T, heads, H)  # rows repeat: a view reshape copies
    else:
        x = torch.randn(*((T, heads, H) if heads else (T, H)), generator=g).to(dtype)
    w = torch.randn(H, generator=g).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels.rmsnorm(x, w, eps)
        want = transformers_norm(x, w, eps)
    finally:
        torch.set_num_threads(before)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(want))


def test_special_values_as_torch() -> None:
    """Zero rows (1/sqrt(eps)), Inf and NaN inputs: what torch's passes make of them."""
    x = torch.zeros(4, 64)
    x[1, 3] = float("inf")
    x[2, 5] = float("nan")
    x[3] = 1e30
    w = torch.ones(64)
    for dtype in (torch.float32, torch.bfloat16):
        got = native_rmsnorm.rmsnorm(x.to(dtype), w.to(dtype), 1e-6)
        want = kernels._rmsnorm(x.to(dtype), w.to(dtype), 1e-6)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


def test_steps_aside(monkeypatch: pytest.MonkeyPatch) -> None:
    """None (nothing done) for fp16, a weight of another dtype, rows wider than it takes and an
    unknown sum order; kernels.rmsnorm's bits are then torch's own."""
    x, w = torch.randn(5, 64), torch.randn(64)
    assert native_rmsnorm.rmsnorm(x.half(), w.half(), 1e-6) is None
    assert native_rmsnorm.rmsnorm(x.bfloat16(), w, 1e-6) is None
    wide = torch.randn(2, native_rmsnorm.MAX_WIDTH + 1)
    assert native_rmsnorm.rmsnorm(wide, torch.ones(wide.shape[1]), 1e-6) is None
    monkeypatch.setattr(native_rmsnorm, "sum_lanes", lambda: None)
    assert native_rmsnorm.rmsnorm(x, w, 1e-6) is None
    assert torch.equal(kernels.rmsnorm(x, w, 1e-6), kernels._rmsnorm(x, w, 1e-6))


def test_other_torch_build_calibrates() -> None:
    """Under torch's default (non-vector) CPU build the calibration still finds the order, and
    the bits agree there too."""
    code = ("import torch; from moecc_runtime.native import rmsnorm as r; from moecc_runtime.worker import kernels\n"
            "assert r.sum_lanes() is not None, 'not calibrated'\n"
            "g = torch.Generator().manual_seed(1)\n"
            "for H in (5, 96, 777, 3000):\n"
            "    x, w = torch.randn(20, H, generator=g), torch.randn(H, generator=g)\n"
            "    for dt in (torch.float32, torch.bfloat16):\n"
            "        assert torch.equal(r.rmsnorm(x.to(dt), w.to(dt), 1e-6), kernels._rmsnorm(x.to(dt), w.to(dt), 1e-6)), H\n"
            "print('ok', r.sum_lanes())\n")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 700), H=st.sampled_from(WIDTHS[:-2]), strided=st.booleans(),
       threads=st.sampled_from([1, 2]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       eps=st.sampled_from([1e-5, 1e-6, 0.1]))
def test_add_then_norm_has_the_bits_of_torch_add_then_the_norm(T: int, H: int, strided: bool, threads: int,
                                                               dtype: torch.dtype, eps: float) -> None:
    """add_rmsnorm: the sum is torch's `a + b`, the norm transformers' of that sum, bit for bit;
    a, b and the sum as column views of wider buffers (row strides of their own)."""
    g = torch.Generator().manual_seed(T * 17 + H)
    pad = 3 if strided else 0
    a = (torch.randn(T, H + pad, generator=g) * 4).to(dtype)[:, pad:]  # [T, H]
    b = torch.randn(T, H + 2 * pad, generator=g).to(dtype)[:, :H]  # [T, H]
    w = torch.randn(H, generator=g).to(dtype)
    total = torch.full((T, H + pad), 7.0, dtype=dtype)  # [T, H + pad]: the columns past H untouched
    out = torch.empty(T, H, dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert native_rmsnorm.add_rmsnorm(a, b, w, eps, total[:, :H], out)
        want_sum = a + b
        want = transformers_norm(want_sum, w, eps)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(_bits(total[:, :H]), _bits(want_sum)) and bool((total[:, H:] == 7).all())
    assert torch.equal(_bits(out), _bits(want))


def test_add_then_norm_special_values_and_refusals() -> None:
    """Inf and NaN through the add as torch's add makes them; False, nothing written, for mixed
    dtypes, fp16, mismatched shapes and an output that is not contiguous."""
    a, b = torch.zeros(4, 64), torch.zeros(4, 64)
    a[1, 3], b[1, 3] = float("inf"), float("-inf")
    a[2, 5] = float("nan")
    b[3] = 1e30
    w = torch.ones(64)
    for dtype in (torch.float32, torch.bfloat16):
        x, y, v = a.to(dtype), b.to(dtype), w.to(dtype)
        s, out = torch.empty_like(x), torch.empty_like(x)
        assert native_rmsnorm.add_rmsnorm(x, y, v, 1e-6, s, out)
        want_s = x + y
        assert torch.equal(s.isnan(), want_s.isnan()) and torch.equal(torch.nan_to_num(s), torch.nan_to_num(want_s))
        want = kernels._rmsnorm(want_s, v, 1e-6)
        assert torch.equal(out.isnan(), want.isnan()) and torch.equal(torch.nan_to_num(out), torch.nan_to_num(want))
    x = torch.randn(4, 64)
    s, out = torch.zeros(4, 64), torch.zeros(4, 64)
    assert not native_rmsnorm.add_rmsnorm(x, x.bfloat16(), w, 1e-6, s, out)
    assert not native_rmsnorm.add_rmsnorm(x.half(), x.half(), w.half(), 1e-6, s.half(), out.half())
    assert not native_rmsnorm.add_rmsnorm(x, x[:3], w, 1e-6, s, out)
    assert not native_rmsnorm.add_rmsnorm(x, x, w, 1e-6, s, torch.zeros(64, 4).t())
    assert not bool(s.any()) and not bool(out.any())
