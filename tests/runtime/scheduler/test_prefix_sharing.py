"""Shared KV blocks (issue 23, items 3 and 5): identical prompt prefixes are computed once
(content-keyed full blocks with reference counts, kept cached after their requests end), and
a request with n > 1 forks its completions off its prompt's blocks, copying a shared block
only where a completion writes into it (copy on write).

Checked without a model (the block allocator and the scheduler, by hypothesis: every plan
writes only blocks its sequence holds alone, reference counts are exact, every block comes
back) and with one (greedy output with and without sharing, and each of n greedy
completions, token-identical to transformers; seeded sampled completions reproducible)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moecc.compiler import compile_model
from moecc_runtime.engine import Engine, generate
from moecc_runtime.scheduler.blocks import BlockAllocator
from moecc_runtime.scheduler.scheduler import Scheduler
from moecc_runtime.scheduler.sequence import GenRequest, GenResult
from moecc_runtime.scheduler.step_plan import StepPlan

from tests.e2e.test_equivalence import _prompts, _reference, hf_models  # noqa: F401  (hf_models is a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- the allocator and the scheduler, no model ------------------------------------------------
def refs_exact(blocks: BlockAllocator) -> None:
    """Every block is held by exactly the tables listing it, and is free, cached or held."""
    blocks.check_invariants()


def holders(blocks: BlockAllocator, b: int) -> int:
    """How many sequences hold block `b` (its reference count, by check_invariants)."""
    return sum(table.count(b) for table in blocks.tables.values())


def drive(sched: Scheduler, pick, max_steps: int = 2000) -> tuple[list[StepPlan], dict[str, list[list[int]]]]:
    """generate's loop with a stand-in worker and sampler (`pick(seq)` -> its next token):
    forks at each prompt's end, checks every plan writes only blocks held alone."""
    plans, out = [], {}
    while sched.has_work and len(plans) < max_steps:
        plan = sched.schedule()
        if plan is None:
            continue
        refs_exact(sched.blocks)
        for c in plan.seqs:
            assert all(holders(sched.blocks, b) == 1 for b in c.slot_blocks), "a write into a shared block"
        for src, dst in plan.copies:
            assert holders(sched.blocks, dst) == 1 and src != dst
        plans.append(plan)
        finishing = sched.advance(plan)
        for s in list(finishing):
            req = s.request
            if req.n > 1 and s.choice == 0 and not s.forked and not s.generated:
                finishing += sched.fork(s, [torch.Generator() for _ in range(req.n - 1)])
        for s in finishing:
            s.tokens.append(pick(s))
            if len(s.generated) >= s.max_new:
                sched.retire(s)
                out.setdefault(s.request.key, []).append(s.generated)
    assert not sched.has_work, "the scheduler did not finish"
    return plans, out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.data())
def test_shared_blocks_are_counted_exactly_and_never_written_shared(data):
    bs = data.draw(st.integers(1, 4), label="block size")
    nb = data.draw(st.integers(24, 64), label="blocks")
    prefixes = [data.draw(st.lists(st.integers(0, 3), min_size=0, max_size=12), label="prefix") for _ in range(2)]
    reqs = []
    for i in range(data.draw(st.integers(1, 7), label="requests")):
        head = prefixes[data.draw(st.integers(0, 1))]
        tail = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=5))
        reqs.append(GenRequest(f"r{i}", head + tail, data.draw(st.integers(1, 5)), n=data.draw(st.integers(1, 3))))
    if any(bs * nb < (len(r.prompt_ids) + r.max_tokens + bs) * r.n for r in reqs):
        return  # a request the pool cannot hold with all its completions: not this test's subject
    blocks = BlockAllocator(nb, bs)
    sched = Scheduler(blocks, reqs, max_batch=data.draw(st.integers(1, 6)), prefill_tokens=data.draw(st.integers(1, 16)))
    _, out = drive(sched, lambda s: (len(s.tokens) * 7 + s.choice) % 4)
    assert sched.rejected == []
    assert {k: len(v) for k, v in out.items()} == {r.key: r.n for r in reqs}
    refs_exact(blocks)
    assert blocks.tables == {} and blocks.free_blocks == nb


def test_a_common_prefix_is_computed_once_and_stays_cached():
    blocks = BlockAllocator(64, 4)
    system = list(range(20))
    reqs = [GenRequest(f"r{i}", system + [50 + i, 60 + i], 2) for i in range(4)]
    plans, _ = drive(Scheduler(blocks, reqs, max_batch=1, prefill_tokens=64), lambda s: 1)
    first = [c for c in plans[0].seqs]
    assert first[0].start == 0 and first[0].n == 22
    later = [c for p in plans for c in p.seqs if c.start > 0 and c.n > 1]
    assert [c.start for c in later] == [20, 20, 20], "each later request starts after the 5 shared blocks"
    assert blocks.reused_tokens == 60
    assert blocks.usage().blocks_cached > 0 and blocks.usage().blocks_used == 0


def test_generated_blocks_are_reused_first_so_a_job_touches_its_peak_blocks():
    """Only prompt blocks are kept as shareable prefixes: a finished sequence's generated blocks
    go back to the free list, and the next sequence takes them (last in, first out), so a job of
    one-at-a-time requests touches about one request's blocks plus the cached prompt blocks,
    not a fresh stretch of the pool per request (every first touch a page fault on the host)."""
    blocks = BlockAllocator(256, 4)
    reqs = [GenRequest(f"r{i}", [100 * i + t for t in range(8)], 24) for i in range(6)]  # 2 prompt + 6 generated blocks
    plans, _ = drive(Scheduler(blocks, reqs, max_batch=1, prefill_tokens=64), lambda s: 1)
    touched = {b for p in plans for c in p.seqs for b in c.slot_blocks}
    assert len(touched) <= 6 * 2 + 8, f"{len(touched)} blocks touched"  # the prompts' blocks stay cached
    assert blocks.usage().blocks_cached == 6 * 2  # every prompt's full blocks still matchable


def test_the_last_prompt_token_is_always_computed():
    """A prompt that is exactly a cached prefix still computes its last token (its logits)."""
    blocks = BlockAllocator(16, 4)
    reqs = [GenRequest("a", list(range(8)), 1), GenRequest("b", list(range(8)), 1)]
    plans, _ = drive(Scheduler(blocks, reqs, max_batch=1, prefill_tokens=64), lambda s: 1)
    b = [c for p in plans for c in p.seqs if c.sid == 1]
    assert (b[0].start, b[0].n) == (4, 4), "block 0 shared; block 1 holds the last token: computed"


def test_forked_completions_copy_only_the_block_they_write():
    blocks = BlockAllocator(32, 4)
    reqs = [GenRequest("a", list(range(10)), 3, n=3)]  # 10 tokens: blocks 0, 1 full, block 2 half
    plans, out = drive(Scheduler(blocks, reqs, max_batch=3, prefill_tokens=64), lambda s: s.choice)
    assert [len(p.seqs) for p in plans] == [1, 3, 3]
    assert len(plans[1].copies) == 2, "two of the three completions copy the half block; the last owns it"
    assert sorted(out["a"]) == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]


# -- with a model -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixtral(checkpoints, hf_models):  # noqa: F811
    path = checkpoints("mixtral", "per_expert")
    model, tok = hf_models(path)
    plan, _ = compile_model(path)
    system = tok(" ".join(_prompts(6)))["input_ids"][:40]  # a 40-token "system prompt"
    questions = [tok(p)["input_ids"][1:6] for p in _prompts(12)[6:]]
    return path, model, plan, [system + q for q in questions]


def _run(plan, path, reqs, *, share=True, kv_blocks=None, block_size=4, max_batch=4, eos=None, attention=None):
    engine = Engine(plan, path, "cpu", kv_blocks=kv_blocks or 256, block_size=block_size, attention=attention)
    engine.blocks.share_prefixes = share
    if eos is not None:
        engine.info["eos_token_ids"] = [eos]
    got: dict[str, GenResult] = {}
    copies = []
    real = engine.worker.execute

    def execute(p):
        copies.extend(p.copies)
        return real(p)

    engine.worker.execute = execute
    try:
        generate(engine, reqs, lambda r: got.__setitem__(r.key, r), max_batch=max_batch)
    finally:
        engine.close()
    assert engine.blocks.tables == {} and engine.blocks.free_blocks == engine.blocks.num_blocks
    return got, engine.blocks.reused_tokens, copies


@pytest.mark.parametrize("attention", ["host", pytest.param("device", marks=pytest.mark.slow)])
def test_shared_prefixes_keep_greedy_output_identical_to_transformers(mixtral, attention):
    path, model, plan, prompts = mixtral
    reqs = [GenRequest(f"q{i}", p, 6, min_tokens=6) for i, p in enumerate(prompts)]
    shared, reused, _ = _run(plan, path, reqs, max_batch=2, attention=attention)
    alone, none, _ = _run(plan, path, reqs, share=False, max_batch=2, attention=attention)
    assert reused >= 40 * (len(reqs) - 2) // 4 * 4 and none == 0
    for r in reqs:
        ref, _ = _reference(model, r.prompt_ids, 6)
        assert shared[r.key].token_ids == alone[r.key].token_ids == ref, r.key


@pytest.mark.parametrize("attention", ["host", pytest.param("device", marks=pytest.mark.slow)])
def test_each_of_n_greedy_completions_is_transformers_output(mixtral, attention):
    path, model, plan, prompts = mixtral
    reqs = [GenRequest(f"n{i}", p, 5, min_tokens=5, n=3) for i, p in enumerate(prompts[:3])]
    got, _, copies = _run(plan, path, reqs, max_batch=9, attention=attention)
    assert copies, "completions forked off a half-filled block copy it before writing"
    for r in reqs:
        ref, _ = _reference(model, r.prompt_ids, 5)
        res = got[r.key]
        assert len(res.completions) == 3 and [c.token_ids for c in res.completions] == [ref] * 3


def test_sampled_completions_are_reproducible_and_differ(mixtral):
    path, _, plan, prompts = mixtral
    reqs = [GenRequest("s", prompts[0], 8, temperature=1.5, seed=7, n=4)]
    a, _, _ = _run(plan, path, reqs)
    b, _, _ = _run(plan, path, reqs + [GenRequest("other", prompts[1], 4, temperature=1.0, n=2)], max_batch=6)
    runs = [[c.token_ids for c in r["s"].completions] for r in (a, b)]
    assert runs[0] == runs[1], "a seeded request's completions do not depend on what else runs"
    assert len({tuple(t) for t in runs[0]}) > 1, "four sampled completions at temperature 1.5 all equal"


@pytest.mark.slow
def test_n_completions_under_preemption_in_a_tiny_pool(mixtral):
    path, model, plan, prompts = mixtral
    reqs = [GenRequest(f"t{i}", p[30:], 6, min_tokens=6, n=2) for i, p in enumerate(prompts[:4])]
    preempted, real = [], Scheduler._preempt
    with mock.patch.object(Scheduler, "_preempt", lambda sched, short: (preempted.append(1), real(sched, short))):
        got, _, _ = _run(plan, path, reqs, kv_blocks=14, max_batch=6)
    assert preempted, "the tiny pool must force preemption"
    for r in reqs:
        ref, _ = _reference(model, r.prompt_ids, 6)
        assert [c.token_ids for c in got[r.key].completions] == [ref] * 2
