"""The engine: one plan's model on one device, and `generate`, the loop that runs requests
through it (continuous batching over module-based steps).

Each step of `generate`:
  1. the scheduler admits requests, reserves the step's KV blocks (preempting when they do
     not fit) and emits a step plan (scheduler/);
  2. the worker runs the plan's rows module by module (worker/);
  3. the sampler picks the next token of every sequence whose known tokens are all cached
     (sampling.py); a sequence retires at EOS, a stop string (`stop_check`) or its own
     max_tokens, its KV blocks are freed and its result goes to `on_finish` at once.
`control()` is asked before every step: "run", "drain" (admit nothing new, finish what is
in flight) or "stop" (return now; in-flight requests are dropped unfinished).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from moecc_runtime.memory.kv import KVGeometry
from moecc_runtime.sampling import SamplingError, choose
from moecc_runtime.scheduler.blocks import BlockAllocator
from moecc_runtime.scheduler.scheduler import DEFAULT_PREFILL_TOKENS, Scheduler
from moecc_runtime.scheduler.sequence import GenRequest, GenResult, LogprobEntry, Sequence
from moecc_runtime.worker.stats import EngineStats
from moecc_runtime.worker.worker import Worker


class Engine:
    """The worker that runs steps and the KV block allocator the scheduler reserves from,
    both sized from one KV geometry (the plan's, or `kv_blocks` blocks of `block_size`)."""

    def __init__(self, plan: dict[str, Any], model_dir: Path, device: torch.device | str = "cpu",
                 expert_chunk: int | None = None, attn_micro_batch: int | None = None,
                 kv_blocks: int | None = None, block_size: int | None = None, record_steps: bool = False,
                 plan_path: Path | str | None = None, attention: str | None = None,
                 keep_on_device: bool | None = None):
        """`plan_path`: where the plan was read from (its quantized weights, if any, are beside it);
        `attention` ("host" / "device"): overrides the plan's attention placement;
        `keep_on_device`: values between device modules stay in the arena (default: on CUDA;
        see Worker). On CUDA the plan must have a device arena (compiled with --gpu-mem):
        PlanError otherwise."""
        geo = KVGeometry.from_plan(plan, kv_blocks, block_size)
        self.blocks = BlockAllocator(geo.num_blocks, geo.block_size)
        self.worker = Worker(plan, model_dir, device, expert_chunk=expert_chunk, attn_micro_batch=attn_micro_batch,
                             kv=geo, record_steps=record_steps, plan_path=plan_path, attention=attention,
                             keep_on_device=keep_on_device)

    @property
    def plan(self) -> dict[str, Any]:
        return self.worker.plan

    @property
    def info(self) -> dict[str, Any]:
        return self.worker.info

    @property
    def stats(self) -> EngineStats:
        return self.worker.stats

    def close(self) -> None:
        self.worker.close()


def generate(
    engine: Engine,
    requests: Iterable[GenRequest],
    on_finish: Callable[[GenResult], None],
    *,
    max_batch: int | None = None,
    max_prefill_tokens: int | None = None,
    record_logits: bool = False,
    on_error: Callable[[GenRequest, str], None] | None = None,
    stop_check: Callable[[GenRequest, list[int]], bool] | None = None,
    control: Callable[[], str] | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> str:
    """Run every request to completion; `on_finish` is called as each one finishes.
    A request that cannot fit the KV pool even alone, or whose logits cannot be sampled, goes
    to `on_error` (raised without it); the others go on.
    `stop_check(req, generated ids)` says whether a request with stop strings hit one;
    `on_step(tokens generated, sequences in flight)` is called after every step.
    Returns "done", or "drained" / "stopped" when `control` ended the run early."""
    eos = set(engine.info["eos_token_ids"])
    limit = int(max_batch or engine.plan["batch"]["decode"]["B"])
    budget = int(max_prefill_tokens or engine.plan["batch"]["prefill"].get("tokens_per_step")
                 or DEFAULT_PREFILL_TOKENS)
    sched = Scheduler(engine.blocks, requests, limit, budget)
    while sched.has_work:
        mode = control() if control is not None else "run"
        if mode == "stop" or (mode == "drain" and not sched.in_flight):
            return "stopped" if mode == "stop" else "drained"
        plan = sched.schedule(admit_new=mode == "run")
        for r in sched.rejected:
            if on_error is None:
                raise r.error
            on_error(r.request, r.message)
        sched.rejected.clear()
        if plan is None:
            continue
        logits = engine.worker.execute(plan).logits  # [S', V]
        finishing = sched.advance(plan)
        asked = [i for i, s in enumerate(finishing) if _request(s).logprobs is not None]
        lps = _log_softmax(logits, asked)  # before choose: of the raw logits, whatever the sampler does
        chosen = choose(logits, [_request(s) for s in finishing], [s.generator for s in finishing],
                        [s.tokens for s in finishing], [s.prompt_len for s in finishing], eos)
        entries = _entries(lps, asked, chosen, [_request(finishing[i]).logprobs or 0 for i in asked])
        for i, (s, row, tok) in enumerate(zip(finishing, logits, chosen)):
            if isinstance(tok, SamplingError):  # this request fails alone
                sched.retire(s)
                if on_error is None:
                    raise tok
                on_error(_request(s), f"request {_request(s).key!r}: {tok}")
                continue
            if record_logits:
                s.logits.append(row.clone())
            if i in entries:
                s.logprobs.append(entries[i])
            s.tokens.append(tok)
            reason = _finish_reason(s, tok, eos, stop_check)
            if reason is not None:
                sched.retire(s)
                req = _request(s)
                on_finish(GenResult(req.key, req.prompt_ids, s.generated, reason, s.logits,
                                    s.logprobs if req.logprobs is not None else None))
        if on_step is not None:
            on_step(len(finishing), len(sched.running))
    return "drained" if sched.queue else "done"


def _log_softmax(logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """The fp32 log-softmax of the step's raw logits for `rows` (those whose request asked
    for logprobs), or None when none did."""
    if not rows:
        return None
    return torch.log_softmax(logits[rows].float(), dim=-1)


def _entries(lps: torch.Tensor | None, rows: list[int], chosen: list[Any],
             tops: list[int]) -> dict[int, LogprobEntry]:
    """Row index -> (the chosen token's logprob, its request's top-N [(id, logprob)], best
    first) for each row in `rows` that got a token; one top-k and one host copy per step."""
    if lps is None:
        return {}
    ok = [j for j, i in enumerate(rows) if isinstance(chosen[i], int)]
    if not ok:
        return {}
    ids = torch.tensor([chosen[rows[j]] for j in ok], dtype=torch.long, device=lps.device)
    sub = lps[ok]
    picked = sub.gather(1, ids[:, None])[:, 0].cpu().tolist()
    k = min(max(tops[j] for j in ok), sub.shape[-1])
    top_v, top_i = (sub.topk(k, dim=-1) if k > 0 else (sub[:, :0], sub[:, :0].long()))
    top_v, top_i = top_v.cpu().tolist(), top_i.cpu().tolist()
    out: dict[int, LogprobEntry] = {}
    for n, j in enumerate(ok):
        n_top = tops[j]
        out[rows[j]] = (picked[n], list(zip(top_i[n][:n_top], top_v[n][:n_top])))
    return out


def _request(s: Sequence) -> GenRequest:
    assert s.request is not None, f"sequence {s.sid} runs no request"
    return s.request


def _finish_reason(s: Sequence, tok: int, eos: set[int],
                   stop_check: Callable[[GenRequest, list[int]], bool] | None) -> str | None:
    """Why `s` ends with its new token `tok` ("stop": EOS or a stop string; "length": its
    max_tokens), or None while it goes on."""
    req = _request(s)
    reason = "stop" if tok in eos else "length" if len(s.generated) >= s.max_new else None
    if req.stop and stop_check is not None and len(s.generated) >= req.min_tokens and stop_check(req, s.generated):
        reason = "stop"
    return reason
