"""kernels.rmsnorm on a CPU normalises NORM_ROWS rows at a time (twice as many up to a width of
NORM_WIDE_H): the same bits as the whole
tensor at once (each row's reduction is its own), in every dtype and shape it is called with."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from moecc_runtime.worker import kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("w_fp32", [False, True])
def test_row_chunks_equal_the_whole(dtype: torch.dtype, w_fp32: bool) -> None:
    g = torch.Generator().manual_seed(0)
    for shape in ((8192, 768), (2 * kernels.NORM_ROWS + 1, 64), (1000, 8, 96), (300, 2, 1, 128),
                  (kernels.NORM_ROWS + 1, 2 * kernels.NORM_WIDE_H)):
        x = (torch.randn(*shape, generator=g) * 3).to(dtype)
        w = torch.randn(shape[-1], generator=g).to(torch.float32 if w_fp32 else dtype)
        whole, rows = kernels._rmsnorm(x, w, 1e-6), kernels.rmsnorm(x, w, 1e-6)
        assert rows.dtype == whole.dtype and rows.shape == whole.shape
        assert torch.equal(rows, whole), (dtype, shape)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 6 * kernels.NORM_ROWS + 5), H=st.sampled_from([8, 96, 768, 2048]),
       heads=st.sampled_from([0, 3]), threads=st.sampled_from([1, 2]))
@example(T=260, H=768, heads=0, threads=1)  # a column-major view chunked once summed in another order
def test_any_row_count_and_threads(T: int, H: int, heads: int, threads: int) -> None:
    """Row counts around the chunk edges, per-head inputs [T, heads, D] (q/k norms) and a
    non-contiguous view; one thread or two."""
    g = torch.Generator().manual_seed(T * 31 + H)
    shape = (T, heads, H) if heads else (T, H)
    x = torch.randn(*shape, generator=g).to(torch.bfloat16)
    w = torch.randn(H, generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for v in (x, x.transpose(0, 1).contiguous().transpose(0, 1)):
            assert torch.equal(kernels.rmsnorm(v, w, 1e-5), kernels._rmsnorm(v, w, 1e-5))
    finally:
        torch.set_num_threads(before)
