"""Prefix sharing in the planner: a job's shared-prefix share (leading full KV blocks before
a prompt's last token that an earlier request computed), the cost model's prefill of only
the rest, and `moecc compile --prompts` / `moecc explain` carrying and showing it."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from moecc.planner.cost_model import Choice, CostModel, Workload, shared_prefix_of, workload_of
from moecc.planner.hardware import resolve_hardware
from moecc.planner.shared_prefix import PrefixCounter, shared_prefix
from moecc_runtime.contract.blocks import KV_BLOCK_SIZE

from tests.compiler.planner.test_solve import cost

# -- the share of hand-made token lists ----------------------------------------------------


def _reference(prompts: list[list[int]], bs: int) -> int:
    """Brute force: a prompt reuses its first k full blocks (k <= (L - 1) // bs) when an
    earlier prompt offered as many full blocks (k <= its L // bs) and began with the same k * bs tokens."""
    total = 0
    for i, p in enumerate(prompts):
        best = 0
        for k in range(1, (len(p) - 1) // bs + 1 if p else 1):
            if any(len(q) // bs >= k and q[:k * bs] == p[:k * bs] for q in prompts[:i]):
                best = k
        total += best * bs
    return total


prompt_lists = st.lists(st.lists(st.integers(0, 2), max_size=14), max_size=8)


@settings(max_examples=100, deadline=None)
@given(prompt_lists, st.integers(1, 5))
def test_the_planner_counts_what_the_runtime_allocator_reuses(prompts, bs):
    """One walk (moecc_runtime/contract/prefix.py) on both sides: with a pool that never evicts,
    prompts run one after another reuse in the runtime's allocator exactly the tokens the
    planner's counter says (both register every full block of a prompt, its last one too)."""
    from moecc_runtime.scheduler.blocks import BlockAllocator

    alloc = BlockAllocator(num_blocks=1 + sum(len(p) // bs + 1 for p in prompts), block_size=bs)
    counter = PrefixCounter(bs)
    for sid, ids in enumerate(prompts):
        reused, counted = alloc.match(sid, alloc.probe(ids)), counter.add(ids)
        assert reused == counted
        alloc.reserve(sid, len(ids))
        alloc.register(sid, ids, len(ids))
        alloc.release(sid)


@settings(max_examples=150, deadline=None)
@given(prompt_lists, st.integers(1, 5))
def test_share_is_in_0_1_and_matches_brute_force(prompts, bs):
    c = shared_prefix(prompts, bs)
    assert 0.0 <= c.share < 1.0 or c.prompt_tokens == 0
    assert c.prompt_tokens == sum(map(len, prompts))
    assert c.shared_tokens == _reference(prompts, bs)
    assert c.unique_tokens == c.prompt_tokens - c.shared_tokens
    assert c.unique_tokens >= sum(1 for p in prompts if p)  # every prompt computes its last token


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=40), st.integers(1, 40), st.integers(1, 9))
def test_identical_prompts_share_n_minus_1_of_their_full_blocks_before_the_last_token(p, n, bs):
    c = shared_prefix([p] * n, bs)
    blocks = (len(p) - 1) // bs
    assert c.shared_tokens == (n - 1) * blocks * bs
    assert c.share == pytest.approx((n - 1) / n * blocks * bs / len(p))


@given(st.lists(st.lists(st.integers(0, 9), max_size=30), max_size=10), st.integers(1, 8))
def test_distinct_first_tokens_share_nothing(tails, bs):
    prompts = [[100 + i, *t] for i, t in enumerate(tails)]
    assert shared_prefix(prompts, bs).shared_tokens == 0


@pytest.mark.parametrize("L, shared", [(0, 0), (1, 0), (7, 0), (8, 0), (9, 8), (15, 8), (16, 8), (17, 16),
                                       (24, 16), (25, 24)])
def test_block_boundaries_the_block_holding_the_last_token_is_never_shared(L, shared):
    p = list(range(L))
    assert shared_prefix([p, p], 8).shared_tokens == shared


def test_a_chain_stops_at_the_first_block_that_differs():
    a = list(range(40))
    b = a[:8] + [99] + a[9:]  # block 1 differs: blocks 2.. hold the same tokens but another chain
    c = PrefixCounter(8)
    assert (c.add(a), c.add(b)) == (0, 8)
    assert c.add(b) == 32  # b's own blocks are cached now: all 4 full blocks before its last token


def test_shorter_and_longer_prompts_reuse_what_the_other_offered():
    long, short = list(range(40)), list(range(17))  # short offers 2 blocks (token 16 is its last)
    c = PrefixCounter(8)
    assert (c.add(short), c.add(long)) == (0, 16)
    c = PrefixCounter(8)
    assert (c.add(long), c.add(short)) == (0, 16)
    assert c.add(list(range(16))) == 8  # 16 tokens: only block 0 lies before the last token


def test_the_default_block_size_is_the_planners():
    from moecc.planner import solve as S

    assert PrefixCounter().block_size == KV_BLOCK_SIZE == S.KV_BLOCK
    with pytest.raises(ValueError):
        PrefixCounter(0)


def test_many_prompts_are_counted_quickly():
    import time

    sys_prompt = list(range(64))
    prompts = [sys_prompt + [i % 251, i // 251, 7, 7, 7] for i in range(20_000)]
    t = time.perf_counter()
    c = shared_prefix(prompts)
    assert time.perf_counter() - t < 10.0  # generous: a shared machine (about 0.1 s here)
    assert c.shared_tokens == (len(prompts) - 1) * 64


# -- the cost model -------------------------------------------------------------------------


def test_a_shared_prefix_shrinks_the_prefill_work_not_its_context_or_decode():
    w0, w = Workload(100.0, 20.0), Workload(100.0, 20.0, 0.75)
    assert w.prefill_tokens == 25.0 and w0.prefill_tokens == 100.0
    assert w.decode_shape(16) == w0.decode_shape(16)
    s = w.prefill_shape(256)
    assert (s.T, s.S, s.head_rows) == (256, math.ceil(256 / 25), math.ceil(256 / 25))
    assert s.context == 75.0 + 12.5  # the shared 75 before a computed token, and half the rest
    assert w0.prefill_shape(256).context == 50.0


def test_the_predicted_job_rate_goes_up_with_a_shared_prefix():
    cm = CostModel(cost(), resolve_hardware("a5000"), streams=False)
    ch = Choice(B=16, b_a=16, b_e=32, prefill=(256, 16, 256), prefetch=1, resident=frozenset(), attention=(0.0, 0.0))
    p0, p = cm.predict(Workload(100.0, 20.0), ch), cm.predict(Workload(100.0, 20.0, 0.5), ch)
    assert p.decode_tokens_per_s == p0.decode_tokens_per_s
    assert p.job_tokens_per_s > p0.job_tokens_per_s
    per_request = 20.0 / p.decode_tokens_per_s + 50.0 / p.prefill_tokens_per_s
    assert p.job_tokens_per_s == pytest.approx(20.0 / per_request)


def test_the_problem_refuses_a_share_outside_0_1():
    from moecc.planner import solve as S

    with pytest.raises(ValueError, match="shared_prefix"):
        S.Problem(cost(), resolve_hardware("a5000"), 100.0, 20.0, shared_prefix=1.0)


def test_the_workload_record_is_the_one_place_the_share_is_read():
    """Schema v5: batch.workload.shared_prefix (None: no sharing); predicted holds no copy."""
    plan = {"batch": {"workload": {"prompt_tokens": 10.0, "output_tokens": 4.0, "seq_len": 14, "shared_prefix": None}}}
    assert shared_prefix_of(plan) == 0.0 and workload_of(plan) == Workload(10.0, 4.0)
    plan["predicted"] = {"shared_prefix": {"share": 0.25}}  # a v4 plan's place: not read
    assert workload_of(plan) == Workload(10.0, 4.0)
    plan["batch"]["workload"]["shared_prefix"] = {"share": 0.25}
    assert workload_of(plan) == Workload(10.0, 4.0, 0.25)


# -- compile --prompts and explain ------------------------------------------------------------

PREFIX = [(i * 7) % 200 + 10 for i in range(64)]  # 8 full blocks of 8


def _prompts(tmp_path):
    """10 requests: one 64-token prefix and 8 tokens of their own each (72 tokens; the 8
    blocks before the last token are the prefix): 9 x 64 of 720 prompt tokens shared."""
    path = tmp_path / "shared.jsonl"
    path.write_text("\n".join(json.dumps({"custom_id": f"r{i}", "prompt": PREFIX + [300 + i] * 8, "max_tokens": 12})
                              for i in range(10)) + "\n")
    return path


def test_compile_with_prompts_puts_the_share_in_the_plan_and_explain_shows_it(checkpoints, tmp_path):
    from moecc.compiler import compile_model
    from moecc_runtime.plan import load_plan

    from moecc.cli import app

    ckpt = checkpoints("mixtral", "per_expert")
    prompts, out = _prompts(tmp_path), tmp_path / "plan.pt"
    res = CliRunner().invoke(app, ["compile", str(ckpt), "-o", str(out), "--prompts", str(prompts),
                                   "--hardware", "a5000", "--max-batch", "64"])
    assert res.exit_code == 0, res.output
    assert "80% of prompt tokens in shared prefixes" in res.output
    plan = load_plan(out)  # validates against the runtime's schema
    wl = plan["batch"]["workload"]
    assert (wl["prompt_tokens"], wl["output_tokens"]) == (72, 12)
    sp = wl["shared_prefix"]
    assert sp["share"] == pytest.approx(0.8) and sp["block_size"] == plan["batch"]["kv"]["block_size"]
    assert sp["shared_tokens"] == pytest.approx(57.6) and sp["prefill_work"] == pytest.approx(0.2)
    assert workload_of(plan).shared_prefix == pytest.approx(0.8)

    text = CliRunner().invoke(app, ["explain", str(out)])
    assert text.exit_code == 0, text.output
    assert ("shared prefix: 80% of prompt tokens (58 of 72 per request) computed once; prefill work 0.20x"
            in text.output)

    res = CliRunner().invoke(app, ["explain", str(out), "--prompts", str(prompts), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    eta = rep["eta"]
    assert (eta["prompt_tokens"], eta["shared_prefix_tokens"], eta["unique_prompt_tokens"]) == (720, 576, 144)
    want = 144 / rep["prefill_tokens_per_s"] + 120 / rep["decode_tokens_per_s"]
    assert eta["seconds"] == pytest.approx(want)
    assert rep["shared_prefix"]["share"] == pytest.approx(0.8)

    # the same job shape without sharing: a lower predicted job rate, and no shared-prefix line
    plain, _ = compile_model(ckpt, prompt_tokens=72, output_tokens=12, hardware="a5000", max_batch=64)
    assert "shared_prefix" not in plain["predicted"]
    assert plan["predicted"]["job_tokens_per_s"] > plain["predicted"]["job_tokens_per_s"]
