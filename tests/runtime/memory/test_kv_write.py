"""The host scatter of a step's K/V rows into the paged pool (runtime/native/kv_write.c) writes
the bytes torch's advanced-index assignment writes, from any row and head strides of the
source; where it does not apply it does nothing and says so, and an index outside the pool is
declined before anything is written.

Legend: Hkv = KV heads, NB = pool blocks, bs = block size, D = head dim, n = positions written.
Skipped where the kernel was not built."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moecc_runtime.native import kv_write

pytestmark = pytest.mark.skipif(kv_write._module() is None, reason="the host KV scatter was not built")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@settings(max_examples=40, deadline=None)
@given(Hkv=st.integers(1, 4), NB=st.integers(1, 9), bs=st.sampled_from([1, 4, 16]), D=st.sampled_from([1, 8, 96]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), strided=st.booleans(), seed=st.integers(0, 2**16))
def test_same_bytes_as_torch_assignment(Hkv: int, NB: int, bs: int, D: int, dtype: torch.dtype, strided: bool,
                                        seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NB * bs, generator=g)[:int(torch.randint(0, NB * bs + 1, (1,), generator=g))]  # [n] distinct
    blocks, offsets = slots // bs, slots % bs  # [n] int64 each
    n = slots.shape[0]
    if strided:  # k as the runtime gets it: a column slice of a wider projection
        src = torch.randn(n, Hkv + 3, D, generator=g).to(dtype)[:, 1:Hkv + 1]  # [n, Hkv, D], rows (Hkv+3)*D apart
    else:
        src = torch.randn(n, Hkv, D, generator=g).to(dtype)  # [n, Hkv, D]
    pool = torch.randn(Hkv, NB, bs, D, generator=g).to(dtype)  # [Hkv, NB, bs, D]
    ref = pool.clone()
    ref[:, blocks, offsets] = src.transpose(0, 1)
    assert kv_write.write(pool, blocks, offsets, src)
    assert torch.equal(bits(pool), bits(ref))


def test_a_layer_of_the_pool_as_kv_passes_it() -> None:
    """KVPool's layers are views [Hkv, NB, bs, D] of one [L, Hkv, NB, bs, D] tensor."""
    full = torch.zeros(3, 2, 5, 4, 8, dtype=torch.bfloat16)  # [L, Hkv, NB, bs, D]
    src = torch.randn(6, 2, 8).to(torch.bfloat16)
    blocks, offsets = torch.tensor([0, 4, 4, 2, 1, 3]), torch.tensor([0, 3, 2, 1, 1, 0])
    ref = full.clone()
    ref[1][:, blocks, offsets] = src.transpose(0, 1)
    assert kv_write.write(full[1], blocks, offsets, src)
    assert torch.equal(bits(full), bits(ref))  # layers 0 and 2 untouched


@pytest.mark.parametrize("block,offset", [(5, 0), (-1, 0), (0, 4), (0, -1)])
def test_an_index_outside_the_pool_is_declined_before_any_write(block: int, offset: int) -> None:
    pool = torch.zeros(2, 5, 4, 8)
    before = pool.clone()
    src = torch.ones(3, 2, 8)
    assert not kv_write.write(pool, torch.tensor([1, 2, block]), torch.tensor([0, 1, offset]), src)
    assert torch.equal(pool, before)


def test_declines_what_it_does_not_take() -> None:
    pool = torch.zeros(2, 5, 4, 8, dtype=torch.bfloat16)
    src = torch.ones(1, 2, 8)  # fp32 into a bf16 pool: torch's assignment rounds it
    assert not kv_write.write(pool, torch.tensor([0]), torch.tensor([0]), src)
    assert not kv_write.write(pool, torch.tensor([0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                              src.to(torch.bfloat16))
    assert not pool.any()
