"""Big n on a small pool and the scheduler's fairness (issue 32, item 5), a shared prefix
computed once when its requests are admitted in the same step, and per-completion seeds
independent across seeds (item 6)."""

from __future__ import annotations


import pytest
import torch

from tests.demo_jobs import demo_plan, read_jsonl, write_jsonl
from moecc_runtime.job.exec import run_job
from moecc_runtime.plan import load_plan, save_plan
from moecc_runtime.scheduler.blocks import BlockAllocator
from moecc_runtime.scheduler.scheduler import Scheduler
from moecc_runtime.scheduler.sequence import GenRequest
from moecc_runtime.sampling.random import completion_seed

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def drive(sched: Scheduler, max_steps: int = 400) -> tuple[dict[str, int], dict[str, str], list]:
    """generate's loop with a stand-in worker and sampler (token 7, to max_tokens): the step
    each request's last completion finished at, the rejected requests' messages, the plans."""
    done, rejected, plans, left = {}, {}, [], {}
    while sched.has_work and len(plans) < max_steps:
        plan = sched.schedule()
        for r in sched.rejected:
            rejected[r.request.key] = r.message
        sched.rejected.clear()
        if plan is None:
            continue
        plans.append(plan)
        finishing = sched.advance(plan)
        for s in list(finishing):
            req = s.request
            left.setdefault(req.key, req.n)
            if req.n > 1 and s.choice == 0 and not s.forked and not s.generated:
                finishing += sched.fork(s, [torch.Generator() for _ in range(req.n - 1)])
        for s in finishing:
            s.tokens.append(7)
            if len(s.generated) >= s.max_new:
                sched.retire(s)
                left[s.request.key] -= 1
                if left[s.request.key] == 0:
                    done[s.request.key] = len(plans)
    assert not sched.has_work, f"the scheduler did not finish in {max_steps} steps"
    return done, rejected, plans


def test_n_128_on_a_pool_of_one_sequence_fails_alone_at_once():
    blocks = BlockAllocator(40, 8)  # one sequence of 8 + 300 tokens takes 39 blocks
    big = GenRequest("big", list(range(8)), 300, temperature=1.0, n=128)
    other = GenRequest("other", list(range(100, 110)), 20)
    done, rejected, plans = drive(Scheduler(blocks, [big, other], max_batch=256, prefill_tokens=64))
    assert rejected == {"big": (
        "request 'big' asks for n=128 completions of up to 300 tokens: holding them at once takes 4865 KV blocks of "
        "8 tokens, but the whole pool has 40 (it holds 1 such completions at once); lower n to at most 1 or "
        "max_tokens, or compile with more --host-mem")}
    assert done == {"other": 20}  # its 20 tokens in 20 steps: never starved
    assert blocks.free_blocks == 40 and blocks.tables == {}


def test_big_n_that_fits_alone_does_not_starve_the_others():
    """n = 6 completions of 40 tokens take 31 of the 32 blocks: they run, and the requests on
    either side of it in the file still finish, each within a bounded number of steps."""
    blocks = BlockAllocator(32, 8)
    reqs = [GenRequest("before", list(range(5)), 10), GenRequest("big", list(range(20, 28)), 40, n=6),
            GenRequest("after", list(range(50, 55)), 10)]
    done, rejected, plans = drive(Scheduler(blocks, reqs, max_batch=16, prefill_tokens=64))
    assert rejected == {} and set(done) == {"before", "big", "after"}
    assert done["before"] <= 12 and max(done.values()) <= 150, done
    assert blocks.free_blocks == 32


@pytest.mark.slow
def test_the_end_to_end_job_fails_the_big_request_alone(tmp_path):
    plan = load_plan(demo_plan())
    plan["batch"]["kv"]["num_blocks"] = 12  # a pool of 96 positions
    p = tmp_path / "small.pt"
    save_plan(plan, p)
    prompts = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "big", "prompt": "A class definition", "max_tokens": 60, "n": 128, "temperature": 1.0},
        {"custom_id": "ok", "prompt": "The for statement", "max_tokens": 4}])
    s = run_job(p, prompts, tmp_path / "out.jsonl", errors_path=tmp_path / "out.errors.jsonl", log=None,
                device="cpu")
    assert (s.succeeded, s.failed) == (1, 1)
    assert [r["custom_id"] for r in read_jsonl(tmp_path / "out.jsonl")] == ["ok"]
    err = read_jsonl(tmp_path / "out.errors.jsonl")[0]
    assert (err["custom_id"], err["error"]["line"], err["error"]["field"]) == ("big", 1, "n")
    assert err["error"]["message"].startswith("request 'big' asks for n=128 completions of up to 60 tokens: ")
    assert "but the whole pool has 12 (it holds 1 such completions at once); lower n to at most 1" in (
        err["error"]["message"])


def test_a_prefix_admitted_in_one_step_is_computed_once():
    """78 requests sharing a 100-token prefix, all admissible at once: the first step computes
    it for one of them; the others wait a step and share its 12 full blocks."""
    blocks = BlockAllocator(4096, 8)
    prefix = list(range(1000, 1100))
    reqs = [GenRequest(f"r{i}", prefix + [i, i + 1], 2) for i in range(78)]
    done, _, plans = drive(Scheduler(blocks, reqs, max_batch=128, prefill_tokens=10_000))
    assert [c.n for c in plans[0].seqs] == [102]
    computed = sum(c.n for p in plans for c in p.seqs if c.prefill)
    assert blocks.reused_tokens == 77 * 96  # 12 blocks of 8 each
    assert computed == 102 + 77 * (102 - 96)
    assert len(done) == 78


def test_completion_seeds_are_independent_across_seeds():
    assert completion_seed(5, "a", 0) == 5 and completion_seed(None, "a", 0) == 3904355907 | (1 << 32)
    seeds = {completion_seed(s, "x", j) for s in range(50) for j in range(50)}
    assert len(seeds) == 2500  # the old seed + j gave 99 distinct streams for these 2500
    assert completion_seed(7, "x", 3) != completion_seed(8, "x", 2)
    assert completion_seed(7, "x", 3) == completion_seed(7, "another id", 3)  # a seed names the stream
    assert completion_seed(None, "x", 3) != completion_seed(None, "y", 3)
    assert completion_seed(7, "x", 3) == 0x7FDEAAC9EEFF845A  # sha256, the same on every machine
    with pytest.raises(ValueError):
        completion_seed(1, "x", -1)
