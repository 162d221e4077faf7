"""Continuous batching keeps greedy output token-identical to transformers: more requests than
the batch limit (freed slots refilled), prompts of different lengths, different max_tokens,
an early EOS; a tiny KV pool with small prefill chunks (chunked prefill, preemption and
recompute); and a request too long for the whole pool failing alone through on_error.

Each request is compared with transformers' generate on its prompt alone (batch of one,
do_sample=False, max_new_tokens = its max_tokens, the same EOS); both return the EOS token
as the last token when a sequence stops on it."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from moecc.compiler import compile_model
from moecc_runtime.engine import Engine, generate
from moecc_runtime.scheduler.blocks import KVCacheFull
from moecc_runtime.scheduler.scheduler import Scheduler
from moecc_runtime.scheduler.sequence import GenRequest, GenResult

from tests.e2e.test_equivalence import _prompts, _reference, hf_models  # noqa: F401  (hf_models is a fixture)

LIMIT = 3  # max_batch: fewer than the requests, so slots are refilled
# (index into _prompts(18), max_tokens): prompt lengths 4..49 tokens, max_tokens 3..12
REQUESTS = [(0, 12), (16, 3), (2, 9), (11, 5), (1, 12), (17, 7), (6, 4), (7, 10), (12, 6)]
EOS_REQUEST = 0  # the request whose greedy output supplies the EOS token
TINY_BLOCKS, TINY_BS, TINY_PREFILL = 16, 4, 8  # a 64-position pool, prefill 8 tokens per step
# What never-written pool positions hold in these tests: finite and large, so a position read
# that should not be (a wrong mask, a stale block) changes the output visibly. (New blocks are
# zeroed on reserve; test_unwritten_kv_positions_do_not_poison_attention checks NaN there.)
GARBAGE = 1e3


@pytest.fixture(scope="module")
def mixtral(checkpoints, hf_models):  # noqa: F811
    path = checkpoints("mixtral", "per_expert")
    model, tok = hf_models(path)
    prompts = [tok(p)["input_ids"] for p in _prompts(18)]
    return path, model, prompts


@pytest.fixture(scope="module")
def eos(mixtral) -> int:
    """A token greedy decoding of request EOS_REQUEST first emits at its 3rd step."""
    _, model, prompts = mixtral
    i, n = REQUESTS[EOS_REQUEST]
    free_run, _ = _reference(model, prompts[i], n)
    tok = free_run[2]
    assert tok not in free_run[:2], free_run
    return tok


@pytest.fixture(scope="module")
def reference(mixtral, eos):
    """(prompt ids, max_tokens) -> (token ids, per-step logits) from transformers, cached."""
    _, model, _ = mixtral
    cache: dict[tuple[tuple[int, ...], int], tuple[list[int], list[torch.Tensor]]] = {}

    def get(ids: list[int], max_tokens: int):
        key = (tuple(ids), max_tokens)
        if key not in cache:
            cache[key] = _reference(model, ids, max_tokens, eos=eos)
        return cache[key]

    return get


@pytest.fixture
def plan(mixtral):
    """A fresh plan per test (the test overrides its eos ids through engine.info)."""
    plan, _ = compile_model(mixtral[0])
    return plan


def requests(prompts: list[list[int]], spec=REQUESTS) -> list[GenRequest]:
    return [GenRequest(f"r{j}", prompts[i], n) for j, (i, n) in enumerate(spec)]


class Run:
    """One generate() over a fresh engine, recording each step's work and every preemption."""

    def __init__(self, plan, path, reqs, eos, *, kv_blocks=None, block_size=None, fill=GARBAGE,
                 sizes=(3, 2), **kw):
        b_e, b_a = sizes if sizes is not None else (None, None)  # None: the plan's own, per phase
        self.engine = engine = Engine(plan, path, "cpu", expert_chunk=b_e, attn_micro_batch=b_a,
                                      kv_blocks=kv_blocks, block_size=block_size, record_steps=True)
        engine.info["eos_token_ids"] = [eos]
        # The pool is torch.empty: make its never-written contents deterministic (see GARBAGE)
        worker = engine.worker
        worker.kv.k.fill_(fill)
        worker.kv.v.fill_(fill)
        self.steps: list[list[tuple[int, int, int]]] = []  # per step: (sid, cached, n)
        self.full = 0  # preemptions by the scheduler (each one recomputes or fails a sequence)
        self.results: dict[str, GenResult] = {}
        self.errors: dict[str, str] = {}
        real_execute, real_preempt = worker.execute, Scheduler._preempt

        self.sizes: list[tuple[int, int, int]] = []  # per step: (prompt rows, b_a, b_e) it ran with

        def execute(plan):
            out = real_execute(plan)
            self.steps.append([(c.sid, c.start, c.n) for c in plan.seqs])
            self.sizes.append((plan.prefill_tokens, worker.b_a, worker.b_e))
            return out

        def preempt(sched, short):
            self.full += 1
            return real_preempt(sched, short)

        worker.execute = execute
        try:
            with mock.patch.object(Scheduler, "_preempt", preempt):
                generate(engine, reqs, lambda r: self.results.__setitem__(r.key, r), max_batch=LIMIT,
                         record_logits=True, on_error=lambda r, m: self.errors.__setitem__(r.key, m), **kw)
        finally:
            engine.close()
        blocks = engine.blocks
        assert blocks.free_blocks == blocks.num_blocks and blocks.tables == {} and blocks.lengths == {}, \
            "KV blocks leaked"


def check_against_transformers(run: Run, reqs: list[GenRequest], reference, eos: int) -> None:
    worst = 0.0
    for r in reqs:
        ref_ids, ref_logits = reference(r.prompt_ids, r.max_tokens)
        assert eos not in ref_ids[:-1], "transformers (batch of one) ends its output at the EOS token"
        got = run.results[r.key]
        assert got.token_ids == ref_ids, f"{r.key}: {len(r.prompt_ids)}-token prompt, max_tokens {r.max_tokens}"
        assert got.prompt_ids == r.prompt_ids
        if ref_ids[-1] == eos:
            assert got.finish_reason == "stop", r.key
        else:
            assert got.finish_reason == "length" and len(ref_ids) == r.max_tokens, r.key
        assert len(got.logits) == len(ref_logits)
        worst = max([worst, *((a - b).abs().max().item() for a, b in zip(got.logits, ref_logits))])
    assert worst < 1e-4, f"max logit difference {worst}"


def test_refill_matches_transformers(plan, mixtral, reference, eos):
    """9 requests through 3 slots: every request matches transformers alone, one stops at EOS
    early, and the batch stays full (3 sequences per step) until the queue is drained."""
    path, _, prompts = mixtral
    reqs = requests(prompts)
    assert len({len(r.prompt_ids) for r in reqs}) == len(reqs), "prompts must differ in length"
    run = Run(plan, path, reqs, eos, kv_blocks=64)  # 1024 positions: room for any 3 at once
    assert set(run.results) == {r.key for r in reqs} and run.errors == {}
    check_against_transformers(run, reqs, reference, eos)
    early = [r.key for r in reqs if run.results[r.key].finish_reason == "stop"
             and len(run.results[r.key].token_ids) < r.max_tokens]
    assert f"r{EOS_REQUEST}" in early and len(run.results[f"r{EOS_REQUEST}"].token_ids) == 3
    assert run.full == 0, "a pool this size must not preempt"
    seen: set[int] = set()
    for i, work in enumerate(run.steps):
        assert len(work) <= LIMIT
        seen |= {sid for sid, *_ in work}
        if len(seen) < len(reqs):  # requests still queued: every slot is in use
            assert len(work) == LIMIT, f"step {i} ran {len(work)} sequences with requests waiting"
    assert seen == set(range(len(reqs)))
    assert run.engine.stats.steps == len(run.steps)


def test_prefill_steps_run_with_the_plans_prefill_sizes(plan, mixtral, reference, eos):
    """The plan's per-phase sizes reach the runtime: a step that is mostly prompt tokens runs
    attention micro-batches and expert chunks of the prefill b_a / b_e, any other step the
    decode ones, and the output still matches transformers."""
    path, _, prompts = mixtral
    plan["batch"]["prefill"].update(b_a=1, b_e=5)
    plan["batch"]["decode"].update(b_a=2, b_e=3)
    reqs = requests(prompts)
    run = Run(plan, path, reqs, eos, kv_blocks=64, sizes=None)
    check_against_transformers(run, reqs, reference, eos)
    total = [sum(n for _, _, n in w) for w in run.steps]
    phases = {(2 * pre > t, b_a, b_e) for (pre, b_a, b_e), t in zip(run.sizes, total)}
    assert phases == {(True, 1, 5), (False, 2, 3)}, phases


def test_tiny_pool_chunked_prefill_and_preemption(plan, mixtral, reference, eos):
    """A 16-block pool of 4 positions and 8 prefill tokens per step: long prompts are
    prefilled in chunks across steps, sequences are preempted and recomputed, and the
    output is still identical to transformers."""
    path, _, prompts = mixtral
    reqs = requests(prompts)
    assert max(len(r.prompt_ids) + r.max_tokens for r in reqs) <= TINY_BLOCKS * TINY_BS
    run = Run(plan, path, reqs, eos, kv_blocks=TINY_BLOCKS, block_size=TINY_BS,
              max_prefill_tokens=TINY_PREFILL)
    assert set(run.results) == {r.key for r in reqs} and run.errors == {}
    check_against_transformers(run, reqs, reference, eos)

    assert run.full > 0, "the tiny pool must force preemption"
    cont = [(sid, c, n) for w in run.steps for sid, c, n in w if n > 1 and c > 0]
    assert cont, "some prompt must be prefilled over several steps"
    reached: dict[int, int] = {}  # sid -> positions it has run so far
    recomputed = set()
    for w in run.steps:
        assert sum(n for sid, c, n in w if n > 1) <= TINY_PREFILL, "prefill budget exceeded"
        for sid, c, n in w:
            if c < reached.get(sid, 0):  # from 0, or from the end of its blocks found shared
                recomputed.add(sid)
                assert n <= TINY_PREFILL
            reached[sid] = max(reached.get(sid, 0), c + n)
    assert recomputed, "a preempted sequence must be recomputed (from 0 or its shared prefix)"
    # a recomputed sequence re-runs its generated tokens too: more tokens run than exist
    total = sum(len(r.prompt_ids) + len(run.results[r.key].token_ids) - 1 for r in reqs)
    assert run.engine.stats.tokens > total
    assert max(rec.kv_blocks_used for rec in run.engine.stats.records) <= TINY_BLOCKS


def test_request_too_long_for_pool_fails_alone(plan, mixtral, reference, eos):
    """One prompt longer than the whole pool and one prompt that fits but cannot finish its
    max_tokens go to on_error; every other request still finishes, identical to transformers."""
    path, _, prompts = mixtral
    too_long_prompt, too_long_run = len(prompts[8]), len(prompts[3]) + 12
    assert too_long_prompt > TINY_BLOCKS * TINY_BS >= len(prompts[3]) + 1
    assert too_long_run > TINY_BLOCKS * TINY_BS
    spec = REQUESTS[:4] + [(8, 4)] + REQUESTS[4:7] + [(3, 12)] + REQUESTS[7:]
    reqs = requests(prompts, spec)
    bad = {"r4", "r8"}
    run = Run(plan, path, reqs, eos, kv_blocks=TINY_BLOCKS, block_size=TINY_BS,
              max_prefill_tokens=TINY_PREFILL)
    assert set(run.errors) == bad
    for key, msg in run.errors.items():
        assert f"request {key!r}" in msg and f"the whole pool has {TINY_BLOCKS}" in msg
        assert f"KV blocks of {TINY_BS} tokens" in msg
    assert set(run.results) == {r.key for r in reqs} - bad
    check_against_transformers(run, [r for r in reqs if r.key not in bad], reference, eos)


def test_request_too_long_raises_without_on_error(plan, mixtral, eos):
    path, _, prompts = mixtral
    engine = Engine(plan, path, "cpu", kv_blocks=TINY_BLOCKS, block_size=TINY_BS)
    done = []
    try:
        with pytest.raises(KVCacheFull, match="KV cache full"):
            generate(engine, [GenRequest("short", prompts[16], 2), GenRequest("long", prompts[8], 2)],
                     done.append, max_batch=LIMIT, max_prefill_tokens=TINY_PREFILL)
    finally:
        engine.close()


def test_unwritten_kv_positions_do_not_poison_attention(plan, mixtral, reference, eos):
    """Whatever the pool held before (torch.empty: here NaN) must not reach the output: only
    written positions may influence attention."""
    path, _, prompts = mixtral
    reqs = requests(prompts, REQUESTS[:3])
    run = Run(plan, path, reqs, eos, kv_blocks=16, fill=float("nan"))
    check_against_transformers(run, reqs, reference, eos)
