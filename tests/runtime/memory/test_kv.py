"""The paged host KV cache: block allocation, growth, release and LIFO reuse, all-or-nothing
exhaustion and addressing (moecc_runtime.scheduler.blocks), and a write/gather round trip
through the pool (moecc_runtime.memory.kv).

Legend: L = layers, Hkv = key/value heads, NB = blocks in the pool, bs = block size,
D = head dim, n = positions written in one call."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moecc_runtime.memory.kv import KVPool
from moecc_runtime.scheduler.blocks import BlockAllocator, KVCacheFull, KVUsage

L, HKV, D = 3, 2, 4


def make(num_blocks: int = 8, block_size: int = 4) -> BlockAllocator:
    return BlockAllocator(num_blocks, block_size)


def pool(num_blocks: int = 8, block_size: int = 4, dtype: torch.dtype = torch.float32) -> KVPool:
    return KVPool(L, HKV, D, block_size=block_size, num_blocks=num_blocks, dtype=dtype)


def owners(kv: BlockAllocator) -> dict[int, int]:
    """block -> the sequence holding it; fails if a block is held twice or is also free."""
    held: dict[int, int] = {}
    for sid, table in kv.tables.items():
        for b in table:
            assert b not in held, f"block {b} held by sequences {held[b]} and {sid}"
            held[b] = sid
    kv.check_invariants()  # and every block is free or held: free + held == all
    assert len(held) + kv.free_blocks == kv.num_blocks
    return held


def state(kv: BlockAllocator) -> tuple[dict[int, list[int]], dict[int, int], int]:
    """What a failed or no-op call must leave unchanged: the tables, the lengths, the free count
    (with check_invariants and no prefix registered here, the free set is then the same too:
    every block not held; its order is checked by the reuse tests)."""
    kv.check_invariants()
    return {s: list(t) for s, t in kv.tables.items()}, dict(kv.lengths), kv.free_blocks


# --------------------------------------------------------------------------- construction


def test_pool_shape_and_sizes():
    kv = pool(num_blocks=5, block_size=3, dtype=torch.bfloat16)
    assert kv.k.shape == kv.v.shape == (L, HKV, 5, 3, D)  # [L, Hkv, NB, bs, D]
    assert kv.k.dtype == torch.bfloat16
    assert kv.bytes_per_token == 2 * L * HKV * D * 2  # K and V, bf16
    assert kv.bytes_per_block == 3 * kv.bytes_per_token
    blocks = make(num_blocks=5, block_size=3)
    assert blocks.free_blocks == 5
    assert blocks.usage() == KVUsage(0, 5, 0)


@pytest.mark.parametrize("bs,nb", [(0, 4), (4, 0), (-1, 1)])
def test_rejects_empty_pool(bs, nb):
    with pytest.raises(ValueError, match="block_size >= 1 and num_blocks >= 1"):
        BlockAllocator(nb, bs)


def test_zero_clears_the_listed_blocks_in_every_layer():
    kv = pool(num_blocks=4, block_size=2)
    kv.k.fill_(float("nan"))
    kv.v.fill_(float("nan"))
    kv.zero([2, 0])
    for t in (kv.k, kv.v):  # [L, Hkv, NB, bs, D]
        assert (t[:, :, [0, 2]] == 0).all() and t[:, :, [1, 3]].isnan().all()
    kv.zero([])  # nothing to do


# --------------------------------------------------------------------------- allocation


@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 8, 9, 17])
def test_reserve_takes_ceil_blocks(tokens):
    kv = make(num_blocks=8, block_size=4)
    kv.reserve(7, tokens)
    want = -(-tokens // 4)
    assert kv.blocks_for(tokens) == want
    assert len(kv.tables[7]) == want
    assert kv.free_blocks == 8 - want
    assert kv.lengths[7] == tokens
    assert kv.usage().blocks_used == want and kv.usage().tokens_live == tokens
    owners(kv)


def test_first_blocks_handed_out_in_order():
    """A fresh pool hands out block 0 first, then 1, 2, ..."""
    kv = make(num_blocks=6, block_size=2)
    kv.reserve(0, 5)  # 3 blocks
    kv.reserve(1, 2)  # 1 block
    assert kv.tables == {0: [0, 1, 2], 1: [3]}


def test_slots_map_positions_to_block_and_offset():
    kv = make(num_blocks=8, block_size=4)
    kv.reserve(0, 3)  # block 0
    kv.reserve(1, 6)  # blocks 1, 2
    kv.reserve(0, 10)  # + blocks 3, 4: table of 0 is [0, 3, 4]
    assert kv.tables[0] == [0, 3, 4]
    blocks, offsets = kv.slots(0, 0, 10)
    assert blocks == [0, 0, 0, 0, 3, 3, 3, 3, 4, 4]
    assert offsets == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    table = kv.tables[0]
    for start in range(10):
        for n in range(0, 10 - start + 1):
            b, o = kv.slots(0, start, n)
            assert b == [table[p // 4] for p in range(start, start + n)]
            assert o == [p % 4 for p in range(start, start + n)]
    assert kv.slots(1, 4, 2) == ([2, 2], [0, 1])
    # positions in the reserved blocks' unused tail are addressable, beyond them not
    assert kv.slots(0, 10, 2) == ([4, 4], [2, 3])
    with pytest.raises(IndexError, match="sequence 0"):
        kv.slots(0, 10, 3)
    with pytest.raises(KeyError):
        kv.slots(99, 0, 1)


# --------------------------------------------------------------------------- growth


def test_growth_adds_blocks_only_at_block_boundaries():
    kv = make(num_blocks=8, block_size=4)
    blocks_seen = []
    for tokens in range(1, 17):  # grow one token at a time, as decode does
        before = list(kv.tables.get(0, []))
        kv.reserve(0, tokens)
        after = kv.tables[0]
        assert after[:len(before)] == before, "growth must keep the blocks already held"
        crossed = tokens % 4 == 1  # the first position of a new block
        assert len(after) - len(before) == (1 if crossed else 0), f"tokens={tokens}"
        blocks_seen.append(len(after))
    assert blocks_seen[-1] == 4


def test_reserving_fewer_tokens_keeps_blocks_and_length():
    kv = make(num_blocks=8, block_size=4)
    kv.reserve(0, 9)
    table = list(kv.tables[0])
    kv.reserve(0, 2)
    assert kv.tables[0] == table and kv.lengths[0] == 9 and kv.free_blocks == 5


def test_at_most_one_partly_filled_block_per_sequence():
    """allocated - live < one block per sequence, as several sequences grow interleaved."""
    kv = make(num_blocks=40, block_size=4)
    lengths = {0: 0, 1: 0, 2: 0, 3: 0}
    steps = [(0, 5), (1, 1), (2, 7), (3, 4), (0, 1), (1, 9), (2, 1), (3, 1), (0, 3), (1, 2), (2, 8), (3, 3)]
    for sid, grow in steps:
        lengths[sid] += grow
        kv.reserve(sid, lengths[sid])
        u = kv.usage()
        live = [s for s in lengths if lengths[s] > 0]
        assert u.tokens_live == sum(lengths.values())
        assert 0 <= u.blocks_used * 4 - u.tokens_live < 4 * len(live)
        for s in live:
            assert 0 <= len(kv.tables[s]) * 4 - lengths[s] < 4
        owners(kv)


# --------------------------------------------------------------------------- release and reuse


def test_release_returns_blocks():
    kv = make(num_blocks=8, block_size=4)
    kv.reserve(0, 9)
    kv.reserve(1, 4)
    assert kv.free_blocks == 4
    kv.release(0)
    assert kv.free_blocks == 7 and 0 not in kv.tables and 0 not in kv.lengths
    assert kv.usage().tokens_live == 4 and kv.usage().blocks_used == 1
    kv.release(1)
    assert kv.free_blocks == 8 and kv.tables == {} and kv.lengths == {}
    assert kv.usage() == KVUsage(0, 8, 0)
    owners(kv)


def test_release_of_unknown_sequence_is_a_noop():
    kv = make(num_blocks=8, block_size=4)
    kv.reserve(0, 5)
    before = state(kv)
    kv.release(42)
    assert state(kv) == before
    kv.release(0)
    kv.release(0)  # twice: the second is a no-op too
    assert kv.free_blocks == 8 and kv.tables == {}
    kv.check_invariants()
    kv.reserve(1, 1)
    assert kv.tables == {1: [0]}


def test_freed_blocks_are_reused_lifo():
    kv = make(num_blocks=10, block_size=2)
    kv.reserve(0, 6)  # [0, 1, 2]
    kv.reserve(1, 4)  # [3, 4]
    kv.reserve(2, 2)  # [5]
    kv.release(0)
    kv.release(2)  # the most recently freed come back first: 5, then 0, 1, 2
    kv.reserve(3, 2)
    assert kv.tables[3] == [5]
    kv.reserve(4, 6)
    assert kv.tables[4] == [0, 1, 2], "a freed table comes back in its own order"
    kv.reserve(5, 2)
    assert kv.tables[5] == [6], "untouched blocks only after every freed one"
    owners(kv)


def test_reuse_keeps_the_touched_blocks_few():
    """Sequences that come and go one after another keep reusing the same blocks."""
    kv = make(num_blocks=16, block_size=4)
    touched: set[int] = set()
    for sid in range(20):
        kv.reserve(sid, 1 + sid % 12)
        touched |= set(kv.tables[sid])
        kv.release(sid)
    assert touched == {0, 1, 2}


# --------------------------------------------------------------------------- exhaustion


def test_exhaustion_message_and_fields():
    kv = make(num_blocks=5, block_size=4)
    kv.reserve(0, 12)  # 3 blocks, 2 free
    with pytest.raises(KVCacheFull) as ei:
        kv.reserve(7, 13)  # needs 4
    e = ei.value
    assert (e.sid, e.needed, e.free, e.capacity) == (7, 4, 2, 5)
    msg = str(e)
    assert "sequence 7" in msg and "needs 4 more block(s)" in msg and "2 of 5 are free" in msg
    assert isinstance(e, RuntimeError)


def test_exhaustion_of_a_growing_sequence_is_all_or_nothing():
    kv = make(num_blocks=5, block_size=4)
    kv.reserve(0, 6)  # [0, 1]
    kv.reserve(1, 4)  # [2]
    before = state(kv)
    with pytest.raises(KVCacheFull) as ei:
        kv.reserve(0, 17)  # needs 5 blocks: 3 more, 2 free
    assert (ei.value.sid, ei.value.needed, ei.value.free) == (0, 3, 2)
    assert "sequence 0 needs 3 more block(s) but 2 of 5 are free" in str(ei.value)
    assert state(kv) == before
    assert kv.usage().tokens_live == 10
    kv.reserve(0, 16)  # exactly what is free still fits afterwards
    assert kv.tables[0] == [0, 1, 3, 4] and kv.free_blocks == 0
    owners(kv)


def test_exhaustion_of_a_new_sequence_leaves_no_entry():
    kv = make(num_blocks=3, block_size=4)
    kv.reserve(0, 8)
    with pytest.raises(KVCacheFull, match="sequence 5 needs 2 more block"):
        kv.reserve(5, 5)
    assert 5 not in kv.tables and 5 not in kv.lengths
    assert kv.free_blocks == 1 and kv.usage().tokens_live == 8
    kv.release(5)  # still unknown: no-op
    assert kv.free_blocks == 1
    kv.reserve(5, 4)  # fits now that it asks for one block
    assert kv.tables[5] == [2]


def test_sequence_larger_than_whole_pool():
    kv = make(num_blocks=4, block_size=4)
    with pytest.raises(KVCacheFull) as ei:
        kv.reserve(0, 17)
    assert (ei.value.needed, ei.value.free, ei.value.capacity) == (5, 4, 4)
    assert kv.tables == {} and kv.lengths == {} and kv.free_blocks == 4
    kv.reserve(0, 16)
    assert kv.free_blocks == 0


# --------------------------------------------------------------------------- write / gather


def _values(sid: int, layer: int, pos: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct, recognisable K and V for positions `pos` of one sequence: [n, Hkv, D] each."""
    n = len(pos)
    p = torch.tensor(pos, dtype=torch.float32)[:, None, None]  # [n, 1, 1]
    h = torch.arange(HKV, dtype=torch.float32)[None, :, None]  # [1, Hkv, 1]
    d = torch.arange(D, dtype=torch.float32)[None, None, :]  # [1, 1, D]
    k = sid * 10000 + layer * 1000 + p * 10 + h * 0.5 + d * 0.01  # [n, Hkv, D]
    return k.expand(n, HKV, D).clone(), -k.expand(n, HKV, D) - 0.25


def test_write_gather_round_trip():
    """Values written for several sequences (interleaved growth, non-contiguous blocks, writes
    of several sequences in one call) read back at the right place from gathered blocks, per
    layer, with K and V kept apart."""
    bs = 4
    blocks, kv = make(num_blocks=16, block_size=bs), pool(num_blocks=16, block_size=bs)
    lengths = {0: 0, 1: 0, 2: 0}
    # steps of (sid, new positions): prefill chunks and single-token decodes, interleaved
    steps = [[(0, 6), (1, 3)], [(2, 9), (0, 1)], [(1, 1), (0, 1), (2, 1)], [(1, 7)], [(0, 5), (2, 1)]]
    blocks.reserve(99, 4)  # a bystander holding a block the others must not touch
    for layer in range(L):
        kv.write(layer, torch.tensor(blocks.slots(99, 0, 4)[0]), torch.arange(4), *_values(99, layer, [0, 1, 2, 3]))
    for step in steps:
        slots, offsets, ks, vs = [], [], {l: [] for l in range(L)}, {l: [] for l in range(L)}
        for sid, n in step:
            start = lengths[sid]
            blocks.reserve(sid, start + n)
            b, o = blocks.slots(sid, start, n)
            slots += b
            offsets += o
            for layer in range(L):
                k, v = _values(sid, layer, list(range(start, start + n)))
                ks[layer].append(k)
                vs[layer].append(v)
            lengths[sid] += n
        for layer in range(L):  # one write per layer for the whole step, like the engine
            kv.write(layer, torch.tensor(slots), torch.tensor(offsets), torch.cat(ks[layer]), torch.cat(vs[layer]))
    tables = blocks.tables
    assert len({b for t in tables.values() for b in t}) == sum(len(t) for t in tables.values())
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables.values()), "want non-contiguous tables"

    for layer in range(L):
        # one sequence at a time: its blocks in table order read as one [Hkv, positions, D] run
        for sid, n in [*lengths.items(), (99, 4)]:
            table = torch.tensor(tables[sid])
            out_k = torch.empty(HKV, len(table), bs, D)  # [Hkv, nb, bs, D]
            out_v = torch.empty_like(out_k)
            kv.gather(layer, table, out_k, out_v)
            want_k, want_v = _values(sid, layer, list(range(n)))  # [n, Hkv, D]
            assert torch.equal(out_k.reshape(HKV, -1, D)[:, :n], want_k.transpose(0, 1)), (layer, sid)
            assert torch.equal(out_v.reshape(HKV, -1, D)[:, :n], want_v.transpose(0, 1)), (layer, sid)
        # all sequences in one gather (a micro-batch), in the order listed
        sids = [2, 0, 1]
        allb = torch.tensor([b for s in sids for b in tables[s]])
        out_k = torch.empty(HKV, len(allb), bs, D)
        out_v = torch.empty_like(out_k)
        kv.gather(layer, allb, out_k, out_v)
        first = 0
        for s in sids:
            nb, n = len(tables[s]), lengths[s]
            want_k, want_v = _values(s, layer, list(range(n)))
            got_k = out_k[:, first:first + nb].reshape(HKV, -1, D)[:, :n]  # [Hkv, n, D]
            got_v = out_v[:, first:first + nb].reshape(HKV, -1, D)[:, :n]
            assert torch.equal(got_k, want_k.transpose(0, 1)) and torch.equal(got_v, want_v.transpose(0, 1))
            first += nb


def test_write_casts_to_pool_dtype():
    kv = pool(num_blocks=2, block_size=2, dtype=torch.bfloat16)
    k = torch.full((2, HKV, D), 1.5)  # [n, Hkv, D] fp32
    kv.write(1, torch.tensor([0, 0]), torch.tensor([0, 1]), k, -k)
    out_k = torch.empty(HKV, 1, 2, D, dtype=torch.bfloat16)
    out_v = torch.empty_like(out_k)
    kv.gather(1, torch.tensor([0]), out_k, out_v)
    assert (out_k == 1.5).all() and (out_v == -1.5).all()


def test_reused_block_is_overwritten_not_mixed():
    """A block freed by one sequence and handed to another reads back the new owner's values."""
    blocks, kv = make(num_blocks=2, block_size=4), pool(num_blocks=2, block_size=4)
    blocks.reserve(0, 4)
    kv.write(0, torch.tensor([0] * 4), torch.arange(4), *_values(0, 0, [0, 1, 2, 3]))
    blocks.release(0)
    assert blocks.reserve(1, 4) == [0]
    assert blocks.tables[1] == [0]
    kv.write(0, torch.tensor([0] * 4), torch.arange(4), *_values(1, 0, [0, 1, 2, 3]))
    out_k, out_v = torch.empty(HKV, 1, 4, D), torch.empty(HKV, 1, 4, D)
    kv.gather(0, torch.tensor([0]), out_k, out_v)
    want_k, want_v = _values(1, 0, [0, 1, 2, 3])
    assert torch.equal(out_k[:, 0], want_k.transpose(0, 1)) and torch.equal(out_v[:, 0], want_v.transpose(0, 1))


# --------------------------------------------------------------------------- property


ops = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.integers(0, 4), st.integers(1, 30)),
        st.tuples(st.just("grow"), st.integers(0, 4), st.integers(1, 6)),
        st.tuples(st.just("release"), st.integers(0, 5), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), st.integers(1, 5), ops)
def test_random_reserve_release_keeps_invariants(num_blocks, bs, seq):
    """Random reserve / grow / release over several sequences: no block is held twice,
    used + free == total, tokens_live is the sum of reserved lengths, each sequence holds
    exactly ceil(length / bs) blocks, and a failed reserve changes nothing."""
    kv = make(num_blocks=num_blocks, block_size=bs)
    model: dict[int, int] = {}  # sid -> reserved length
    for op, sid, n in seq:
        if op == "release":
            kv.release(sid)
            model.pop(sid, None)
        else:
            tokens = n if op == "reserve" else model.get(sid, 0) + n
            snapshot = state(kv)
            need = -(-tokens // bs) - len(kv.tables.get(sid, []))
            try:
                kv.reserve(sid, tokens)
            except KVCacheFull as e:
                assert need > kv.free_blocks
                assert (e.sid, e.needed, e.free, e.capacity) == (sid, need, kv.free_blocks, num_blocks)
                assert state(kv) == snapshot
            else:
                assert need <= snapshot[2]
                model[sid] = max(model.get(sid, 0), tokens)
        held = owners(kv)
        u = kv.usage()
        assert u.blocks_used + kv.free_blocks == u.blocks_total == num_blocks
        assert u.blocks_used == len(held)
        assert u.tokens_live == sum(model.values())
        assert set(kv.tables) == set(model) == set(kv.lengths)
        for s, length in model.items():
            assert kv.lengths[s] == length
            assert len(kv.tables[s]) == -(-length // bs)
        assert u.blocks_used * bs - u.tokens_live < bs * max(1, len(model))


def test_failed_reserve_after_zero_reservation_keeps_state():
    kv = make(num_blocks=2, block_size=4)
    kv.reserve(0, 0)  # a known sequence holding no blocks
    assert kv.tables == {0: []} and kv.lengths == {0: 0}
    with pytest.raises(KVCacheFull):
        kv.reserve(0, 100)
    assert set(kv.tables) == set(kv.lengths)


# -- the first wave's pages committed at start-up (KVPool.prefault, first_wave_blocks) --------

@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=-2, max_value=12))
def test_prefault_zeroes_the_first_blocks_of_every_plane_and_nothing_else(n: int) -> None:
    """prefault(n) zeroes blocks [0, n) (at most the pool) in every layer and head of K and V,
    leaves the rest as they were, and returns the bytes it touched."""
    kv = pool(num_blocks=8)
    kv.k.fill_(float("nan"))
    kv.v.fill_(float("nan"))
    done = kv.prefault(n)
    m = max(0, min(n, 8))
    assert done == m * kv.bytes_per_block
    for t in (kv.k, kv.v):  # [L, Hkv, NB, bs, D]
        assert bool((t[:, :, :m] == 0).all())
        assert bool(t[:, :, m:].isnan().all())


def test_first_wave_is_the_plans_batch_or_the_jobs_requests_of_the_workload_length() -> None:
    """min(B, requests) sequences (B when the count is unknown) of seq_blocks(seq_len), at most
    the pool."""
    from types import SimpleNamespace

    from moecc_runtime.contract.blocks import seq_blocks
    from moecc_runtime.memory.kv import first_wave_blocks

    plan = SimpleNamespace(decode=SimpleNamespace(B=16), workload=SimpleNamespace(seq_len=30))
    per = seq_blocks(30, 8)
    assert first_wave_blocks(plan, 10_000, 8, None) == 16 * per
    assert first_wave_blocks(plan, 10_000, 8, 3) == 3 * per
    assert first_wave_blocks(plan, 10_000, 8, 0) == 0
    assert first_wave_blocks(plan, 10_000, 8, 1000) == 16 * per
    assert first_wave_blocks(plan, 20, 8, None) == 20
