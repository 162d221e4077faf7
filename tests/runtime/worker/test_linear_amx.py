"""The dense bf16 projection on AMX tiles (runtime/native/linear_amx.c) computes what oneDNN's
GEMM over the same packed weight does (PackedLinear with the kernel switched off): the same bits
where oneDNN sums the inputs in order (up to 224 inputs here, at any row count: one chunk with
its outputs split, or chunks split between the threads), as close to the exact product where
oneDNN splits the inputs between its threads; streaming and plain stores give the same bits; it
writes nothing outside its output and its scratch; where it does not apply it does nothing and says so.

Legend: M rows, K inputs, N outputs. Skipped where the kernel does not run (not built, or a CPU
without AMX)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moecc_runtime.memory.packed_weights import PackedLinear, packing_available
from moecc_runtime.native import linear_amx
from moecc_runtime.native.amx_gemm import layout, scratch_rows
from moecc_runtime.native.packed_layout import raw

pytestmark = pytest.mark.skipif(linear_amx._module() is None or not packing_available(),
                                reason="the AMX linear kernel does not run here (not built, or no AMX)")

BF16 = torch.bfloat16


def weight(N: int, K: int, seed: int) -> tuple[torch.Tensor, PackedLinear]:
    """A bf16 weight [N, K] and its packed copy as the runtime holds it."""
    w = (torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) / 8).to(BF16)
    return w, PackedLinear(w, 128)


def rows(M: int, K: int, seed: int) -> torch.Tensor:
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed + 1)).to(BF16)  # [M, K]


def onednn(pl: PackedLinear, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product through oneDNN's GEMM (the kernel switched off)."""
    with monkeypatch.context() as m:
        m.setenv("MOECC_LINEAR_AMX", "0")
        return pl(x, bias)


def run_raw(x: torch.Tensor, pl: PackedLinear, y: torch.Tensor, scratch: torch.Tensor, threads: int) -> int:
    """linear_amx.c's entry on the caller's output and scratch (views the test places)."""
    M, K = x.shape
    return linear_amx._module().linear(x.data_ptr(), x.stride(0), M, K, pl.out_features, raw(pl.packed),
                                       layout(pl.out_features, K, pl.rows_hint), scratch.data_ptr(), y.data_ptr(),
                                       y.stride(0), threads)


@contextmanager
def two_threads():
    """torch (and so the kernel) on two threads: the rows split needs two (more rows than a chunk)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, 1300), N=st.sampled_from([32, 64, 96, 448]), K=st.sampled_from([32, 64, 128, 224]),
       seed=st.integers(0, 2**16))
@example(M=1100, N=448, K=224, seed=0)  # four chunks of 275 rows, two a thread
@example(M=17, N=32, K=32, seed=1)  # a last row tile of one row
def test_same_bits_as_onednn_where_it_sums_in_order(M: int, N: int, K: int, seed: int) -> None:
    w, pl = weight(N, K, seed)
    x = rows(M, K, seed)
    with pytest.MonkeyPatch.context() as mp, two_threads():
        ref = onednn(pl, x, mp)
        y = linear_amx.linear(x, pl)
    assert y is not None and y.shape == (M, N)
    assert torch.equal(y.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("M", [16, 512, 2100])
def test_as_close_as_onednn_where_it_splits_the_sum(M: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the bench model's 768 inputs oneDNN may split the sum between threads (another fp32
    order): against the exact product (fp64 from the same bf16 values) the kernel's error is
    oneDNN's, mean and max."""
    w, pl = weight(1152, 768, 3)
    x = rows(M, 768, 3)
    exact = x.double() @ w.double().T  # [M, N]
    with two_threads():
        y, ref = linear_amx.linear(x, pl), onednn(pl, x, monkeypatch)
    err, ref_err = (y.double() - exact).abs(), (ref.double() - exact).abs()
    assert err.mean() <= 1.05 * ref_err.mean() and err.max() <= 1.25 * ref_err.max()


@pytest.mark.parametrize("M", [40, 1100])
def test_streaming_and_plain_stores_give_the_same_bits_and_nothing_else_is_written(M: int) -> None:
    """An output aligned for streaming stores and one a row element off (plain stores) hold the
    same bits; the guard elements around the output and past the scratch keep their values."""
    N, K = 96, 128
    _, pl = weight(N, K, 5)
    x = rows(M, K, 5)
    guard = -7.0
    want = scratch_rows(M, 2)
    outs = []
    for off in (0, 1):  # 0: aligned (streams), 1: one element on (no stream)
        buf = torch.full((M * N + 64,), guard, dtype=BF16)
        y = buf[off:off + M * N].view(M, N)
        scratch = torch.full((want + 1, K), guard, dtype=BF16)  # [rows + a guard row, K]
        with two_threads():
            assert run_raw(x, pl, y, scratch, 2) == 0
        assert bool((buf[:off] == guard).all()) and bool((buf[off + M * N:] == guard).all())
        assert bool((scratch[want] == guard).all())
        outs.append(y.clone())
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


@pytest.mark.parametrize("M", [300, 1100])
def test_rows_in_blocks_have_the_bits_of_rows_run_alone(M: int) -> None:
    """Past amx_gemm.h's ROWS_L2 (3,584 inputs: more than 176 rows) a chunk's rows run in blocks:
    each row has the bits it has in a run of its own 16 rows, so the blocks change no sum."""
    _, pl = weight(64, 3584, 13)
    x = rows(M, 3584, 13)
    with two_threads():
        y = linear_amx.linear(x, pl)
        alone = torch.cat([linear_amx.linear(x[r:r + 16], pl) for r in range(0, M, 16)])
    assert torch.equal(y.view(torch.int16), alone.view(torch.int16))


def test_rows_of_a_wider_tensor_and_leading_dims(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows spaced wider than K (a column slice) and a [B, T, K] input: oneDNN's values and shapes."""
    _, pl = weight(64, 96, 7)
    wide = rows(30, 160, 7)
    x = wide[:, 32:128]  # [30, 96], rows 160 apart
    assert torch.equal(linear_amx.linear(x, pl), onednn(pl, x.contiguous(), monkeypatch))
    x3 = rows(24, 96, 8).view(2, 12, 96)  # [B, T, K]
    y3 = linear_amx.linear(x3, pl)
    assert y3.shape == (2, 12, 64)
    assert torch.equal(y3.view(24, 64), linear_amx.linear(x3.view(24, 96), pl))


def test_declines_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32, inputs not a multiple of 32, rows of another width, the switch off: None. A bias
    goes to oneDNN's GEMM from PackedLinear, with its values."""
    _, pl = weight(64, 96, 9)
    x = rows(8, 96, 9)
    assert linear_amx.linear(x.float(), pl) is None
    assert linear_amx.linear(x, PackedLinear(torch.zeros(64, 40, dtype=BF16), 128)) is None
    assert linear_amx.linear(rows(8, 64, 9), pl) is None
    bias = torch.randn(64).to(BF16)
    assert torch.equal(pl(x, bias).view(torch.int16), onednn(pl, x, monkeypatch, bias).view(torch.int16))
    monkeypatch.setenv("MOECC_LINEAR_AMX", "0")
    assert linear_amx.linear(x, pl) is None
