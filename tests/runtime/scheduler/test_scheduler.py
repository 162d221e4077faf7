"""The scheduler without a model (moecc_runtime.scheduler): every step plan it emits addresses
only reserved KV slots, it preempts (and recomputes) rather than letting a step overflow the
pool, it rejects a request the whole pool cannot hold, and each plan names its phase."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from moecc_runtime.scheduler.blocks import BlockAllocator
from moecc_runtime.scheduler.scheduler import Scheduler, reserve_step
from moecc_runtime.scheduler.sequence import GenRequest, Sequence
from moecc_runtime.scheduler.step_plan import StepPlan

TOKEN = 7  # what the stand-in sampler always picks


def drive(sched: Scheduler, max_steps: int = 500) -> list[StepPlan]:
    """Run the scheduler to the end as generate does, with a stand-in worker and sampler:
    every finishing sequence gets TOKEN and retires at its max_tokens."""
    plans = []
    while sched.has_work and len(plans) < max_steps:
        plan = sched.schedule()
        if plan is None:
            continue
        check_reserved(sched.blocks, plan)
        plans.append(plan)
        for s in sched.advance(plan):
            s.tokens.append(TOKEN)
            if len(s.generated) >= s.max_new:
                sched.retire(s)
    assert not sched.has_work, "the scheduler did not finish"
    return plans


def check_reserved(blocks: BlockAllocator, plan: StepPlan) -> None:
    """Every slot of the plan is its sequence's, and the plan's new blocks are held."""
    held = {b for t in blocks.tables.values() for b in t}
    assert set(plan.new_blocks) <= held
    for c in plan.seqs:
        table = blocks.tables[c.sid]
        assert c.block_table == table
        assert len(table) * blocks.block_size >= c.start + c.n
        for i, (b, o) in enumerate(zip(c.slot_blocks, c.slot_offsets)):
            p = c.start + i
            assert (b, o) == (table[p // blocks.block_size], p % blocks.block_size)
    assert plan.kv == blocks.usage()
    blocks.check_invariants()


def test_plans_address_only_reserved_slots_and_blocks_come_back():
    blocks = BlockAllocator(64, 4)
    reqs = [GenRequest(f"r{i}", list(range(3 + 5 * i)), 4) for i in range(6)]
    plans = drive(Scheduler(blocks, reqs, max_batch=3, prefill_tokens=16))
    assert max(len(p.seqs) for p in plans) == 3
    assert all(sum(c.n for c in p.seqs if c.n > 1) <= 16 for p in plans)
    assert blocks.free_blocks == 64 and blocks.tables == {}


def test_a_full_pool_preempts_the_newest_and_recomputes_it():
    """Two sequences that fit when admitted outgrow an 8-block pool: the most recently
    admitted is preempted before the step is emitted and later recomputed from position 0
    (prefix sharing off: with it, its computed blocks would be found again)."""
    blocks = BlockAllocator(8, 2, share_prefixes=False)
    reqs = [GenRequest("a", [1] * 5, 8), GenRequest("b", [2] * 5, 8)]
    sched = Scheduler(blocks, reqs, max_batch=2, prefill_tokens=64)
    preempted = []
    real = sched._preempt
    sched._preempt = lambda short: (preempted.append(sched.running[-1].sid), real(short))[1]
    plans = drive(sched)
    assert preempted and set(preempted) == {1}, "the newest sequence is the one preempted"
    starts = [c.start for p in plans for c in p.seqs if c.sid == 1]
    assert starts.count(0) == 2, "preempted: run again from its first position"
    assert sched.rejected == [] and blocks.free_blocks == 8


def test_a_request_larger_than_the_pool_is_rejected_alone():
    blocks = BlockAllocator(4, 2)
    reqs = [GenRequest("big", [1] * 9, 2), GenRequest("ok", [1] * 3, 2)]
    sched = Scheduler(blocks, reqs, max_batch=2, prefill_tokens=64)
    plans = drive(sched)
    assert [r.request.key for r in sched.rejected] == ["big"]
    r = sched.rejected[0]
    assert "request 'big' needs 5 KV blocks of 2 tokens but the whole pool has 4" in r.message
    assert (r.error.needed, r.error.capacity) == (5, 4)
    assert {c.sid for p in plans for c in p.seqs} == {1} and blocks.free_blocks == 4


def test_phase_follows_the_prompt_share_and_new_blocks_are_listed_once():
    blocks = BlockAllocator(16, 4)
    seq = Sequence(0, list(range(10)), 10, 0)
    plan = reserve_step(blocks, [(seq, 10)])
    assert plan.phase == "prefill" and plan.prefill_tokens == plan.tokens == 10
    assert plan.new_blocks == blocks.tables[0] == [0, 1, 2]
    seq.cached, seq.tokens = 10, seq.tokens + [TOKEN]
    plan = reserve_step(blocks, [(seq, 1)])
    assert plan.phase == "decode" and plan.prefill_tokens == 0 and plan.new_blocks == []
    assert plan.seqs[0].finishes and (plan.seqs[0].slot_blocks, plan.seqs[0].slot_offsets) == ([2], [2])


def _state(blocks: BlockAllocator) -> tuple:
    return (blocks.tables, blocks.lengths, blocks._refs, blocks._free, list(blocks._cached), blocks.usage())


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_decode_fast_path_does_what_the_general_path_does(data):
    """extend_in_place (the scheduler's decode fast path) says yes only where the general
    path (needs, writable, reserve) would take no block and copy none, and leaves the
    allocator exactly as that path does; where it says no, it changed nothing."""
    bs = data.draw(st.integers(1, 4), label="block size")
    blocks = BlockAllocator(64, bs)
    sids = []
    for sid in range(data.draw(st.integers(1, 5), label="sequences")):
        if sids and data.draw(st.booleans(), label="fork"):
            blocks.fork(data.draw(st.sampled_from(sids)), sid)  # shares every block of its parent
        else:
            blocks.reserve(sid, data.draw(st.integers(1, 12), label="positions"))
        sids.append(sid)
    for sid in sids:
        pos = data.draw(st.integers(0, blocks.lengths[sid] + bs), label="position")
        fast, slow = copy.deepcopy(blocks), copy.deepcopy(blocks)
        if not fast.extend_in_place(sid, pos):
            assert _state(fast) == _state(blocks)
            continue
        assert slow.needs(sid, pos + 1, pos) == 0 and slow.writable(sid, pos) == [] and slow.reserve(sid, pos + 1) == []
        assert _state(fast) == _state(slow)
        fast.check_invariants()
