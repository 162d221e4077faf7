"""The engine: one plan's model on one device, and `generate`, the loop that runs requests
through it (continuous batching over module-based steps).

Each step of `generate`:
  1. the scheduler admits requests, reserves the step's KV blocks (preempting when they do
     not fit) and emits a step plan (scheduler/);
  2. the worker runs the plan's rows module by module (worker/);
  3. the sampler picks the next token of every sequence whose known tokens are all cached
     (sampling/; the logprobs of the rows that asked: sampling/logprobs.py); a sequence retires at EOS, a stop string (`stop_check`) or its own
     max_tokens, its KV blocks are freed and its result goes to `on_finish` at once.
`control()` is asked before every step: "run", "drain" (admit nothing new, finish what is
in flight) or "stop" (return now; in-flight requests are dropped unfinished).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from moecc_runtime.contract.plan_types import PlanView
from moecc_runtime.memory.kv import first_wave_blocks, pool_geometry
from moecc_runtime.sampling import NOT_FINITE, Masks, SamplingError, request_generator, sample
from moecc_runtime.sampling.logprobs import LogprobEntry, prompt_logprobs, step_logprobs
from moecc_runtime.scheduler.blocks import BlockAllocator
from moecc_runtime.scheduler.scheduler import DEFAULT_PREFILL_TOKENS, Scheduler
from moecc_runtime.scheduler.sequence import GenRequest, GenResult, Sequence
from moecc_runtime.scheduler.step_plan import StepPlan
from moecc_runtime.worker.stats import EngineStats
from moecc_runtime.worker.worker import Worker


class Engine:
    """The worker that runs steps and the KV block allocator the scheduler reserves from,
    both sized from one KV geometry (the plan's, or `kv_blocks` blocks of `block_size`)."""

    def __init__(self, plan: dict[str, Any], model_dir: Path, device: torch.device | str = "cpu",
                 expert_chunk: int | None = None, attn_micro_batch: int | None = None,
                 kv_blocks: int | None = None, block_size: int | None = None, record_steps: bool = False,
                 plan_path: Path | str | None = None, attention: str | None = None,
                 keep_on_device: bool | None = None, share_prefixes: bool = True):
        """`plan_path`: where the plan was read from (its quantized weights, if any, are beside it);
        `attention` ("host" / "device"): overrides the plan's attention placement;
        `keep_on_device`: values between device modules stay in the arena (default: on CUDA;
        see Worker); `share_prefixes`: KV blocks of prompt prefixes computed once are shared
        (scheduler/blocks.py). On CUDA the plan must have a device arena (compiled with --gpu-mem):
        PlanError otherwise."""
        self.view = PlanView.of(plan)  # the plan typed, once: what the worker, streaming and KV code read
        geo = pool_geometry(self.view, kv_blocks, block_size)
        self.blocks = BlockAllocator(geo.num_blocks, geo.block_size, share_prefixes)
        self.worker = Worker(plan, model_dir, device, expert_chunk=expert_chunk, attn_micro_batch=attn_micro_batch,
                             kv=geo, record_steps=record_steps, plan_path=plan_path, attention=attention,
                             keep_on_device=keep_on_device, view=self.view)

    def prefault_kv(self, requests: int | None) -> int:
        """Commit the KV pool's pages for the job's first wave (memory/kv.py first_wave_blocks:
        `requests` the job will run, None if unknown) before its first step, as part of start-up;
        MOECC_KV_PREFAULT=0 leaves them to the steps' first touch. Returns the bytes touched."""
        if os.environ.get("MOECC_KV_PREFAULT", "1").strip() == "0":
            return 0
        start = time.perf_counter()
        kv = self.worker.kv
        done = kv.prefault(first_wave_blocks(self.view, kv.num_blocks, kv.block_size, requests))
        self.stats.kv_prefault_bytes, self.stats.kv_prefault_seconds = done, time.perf_counter() - start
        return done

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
    grammar: Callable[[GenRequest], Any] | None = None,
) -> str:
    """Run every request to completion; `on_finish` is called as each one finishes (a
    request with n > 1 once, when all its completions have, with them in `choices`).
    A request that cannot fit the KV pool even alone, or whose logits cannot be sampled, goes
    to `on_error` (raised without it); the others go on.
    `stop_check(req, generated ids)` says whether a request with stop strings hit one;
    `grammar(req)`: a fresh structured.Matcher for a request with a response_format;
    `on_step(tokens generated, sequences in flight)` is called after every step.
    Returns "done", or "drained" / "stopped" when `control` ended the run early."""
    eos = set(engine.info["eos_token_ids"])
    limit = int(max_batch or engine.view.decode.B)
    budget = int(max_prefill_tokens or engine.view.prefill.tokens_per_step or DEFAULT_PREFILL_TOKENS)
    sched = Scheduler(engine.blocks, requests, limit, budget)
    out = _Choices(on_finish, on_error)
    while sched.has_work:
        mode = control() if control is not None else "run"
        if mode == "stop" or (mode == "drain" and not sched.in_flight):
            return "stopped" if mode == "stop" else "drained"
        plan = sched.schedule(admit_new=mode == "run")
        for r in sched.rejected:
            out.fail(r.request, r.message, r.error)
        sched.rejected.clear()
        if plan is None:
            continue
        logits = _score_prompts(plan, sched, engine.worker.execute(plan).raw)  # [S', V] in the model's dtype
        finishing, logits = _fork(sched, sched.advance(plan), logits)
        finishing, logits = _end_unsampled(sched, finishing, logits, out)
        chosen, entries = _sample(finishing, logits, eos, grammar)
        for i, (s, tok) in enumerate(zip(finishing, chosen)):  # (rows of `logits` viewed only when recorded)
            if isinstance(tok, SamplingError):  # this request fails alone
                sched.retire(s)
                out.fail(_request(s), f"request {_request(s).key!r}: {tok}", tok)
                continue
            if record_logits:
                s.logits.append(logits[i].to(torch.float32, copy=True))
            if i in entries:
                s.logprobs.append(entries[i])
            s.tokens.append(tok)
            if s.constraint is not None:
                s.constraint.accept(tok)
            reason = _finish_reason(s, tok, eos, stop_check)
            if reason is not None:
                sched.retire(s)
                out.finish(s, _result(s, reason))
        if on_step is not None:
            on_step(len(finishing), len(sched.running))
    return "drained" if sched.queue else "done"


def _result(s: Sequence, reason: str) -> GenResult:
    req = _request(s)
    return GenResult(req.key, req.prompt_ids, s.generated, reason, s.logits,
                     s.logprobs if req.logprobs is not None else None,
                     prompt_logprobs=s.prompt_logprobs if req.prompt_logprobs is not None else None)


def _score_prompts(plan: StepPlan, sched: Scheduler, logits: torch.Tensor) -> torch.Tensor:
    """The step's head rows [R, V] -> the finishing chunks' last rows [S', V]; on the way, each
    scoring chunk's rows give its prompt tokens' logprobs (row j of a chunk at `start`: the
    token at position start + j + 1), recorded once per position (a recomputed chunk adds none)."""
    if not any(c.score for c in plan.seqs):
        return logits
    by_sid = {s.sid: s for s in sched.running}
    keep, score = [], []  # head row indexes: finishing rows; (row, sequence, position) to record
    r = 0
    for c in plan.seqs:
        rows = c.head_rows()
        if c.score:
            s = by_sid[c.sid]
            if not s.prompt_logprobs:
                s.prompt_logprobs.append(None)  # the first token: nothing before it
            score += [(r + j, s, c.start + j + 1) for j in rows if c.start + j + 1 < s.prompt_len]
        if c.finishes:
            keep.append(r + len(rows) - 1)
        r += len(rows)
    if score:
        _record_prompt_logprobs(score, logits)
    return logits[keep]


def _record_prompt_logprobs(score: list[tuple[int, Sequence, int]], logits: torch.Tensor) -> None:
    """For each (head row, sequence, position): the logprob of the sequence's token at that
    position under the row's fp32 log-softmax, and its request's top N; appended when it is
    the next position the sequence lacks."""
    got = prompt_logprobs(logits, [i for i, _, _ in score], [s.tokens[p] for _, s, p in score],
                          [_request(s).prompt_logprobs or 0 for _, s, _ in score])  # logits [P, V] scored
    for (_, s, p), e in zip(score, got):
        if p == len(s.prompt_logprobs):
            s.prompt_logprobs.append(e)


def _end_unsampled(sched: Scheduler, finishing: list[Sequence], logits: torch.Tensor,
                   out: "_Choices") -> tuple[list[Sequence], torch.Tensor]:
    """Sequences asked for no new token (max_tokens 0: an echoed prompt, scored) end here,
    with "length"; the others and their logits rows go on."""
    ended = [i for i, s in enumerate(finishing) if s.max_new == 0]
    if not ended:
        return finishing, logits
    for i in ended:
        sched.retire(finishing[i])
        out.finish(finishing[i], _result(finishing[i], "length"))
    rest = [i for i in range(len(finishing)) if finishing[i].max_new != 0]
    return [finishing[i] for i in rest], logits[rest]


def _fork(sched: Scheduler, finishing: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
    """A request with n > 1 whose prompt is cached now gets its other completions: they join
    the step right after it, choosing from its logits row. Returns the rows and logits [S', V]."""
    rows, seqs = [], []
    for i, s in enumerate(finishing):
        rows.append(i)
        seqs.append(s)
        req = _request(s)
        if req.n > 1 and s.choice == 0 and not s.forked and not s.generated:
            kids = sched.fork(s, [request_generator(req.seed, req.key, j) for j in range(1, req.n)])
            rows.extend([i] * len(kids))
            seqs.extend(kids)
    return (seqs, logits) if len(seqs) == len(finishing) else (seqs, logits[rows])


def _sample(finishing: list[Sequence], logits: torch.Tensor, eos: set[int],
            grammar: Callable[[GenRequest], Any] | None) -> tuple[list[Any], dict[int, LogprobEntry]]:
    """The step's next tokens (or SamplingErrors) and the logprob entries of the rows that
    asked, computed from the raw logits before the sampler reshapes them; all of it comes to
    the host in one copy."""
    reqs = [_request(s) for s in finishing]
    asked = [i for i, r in enumerate(reqs) if r.logprobs is not None]
    masks = _grammar_masks(finishing, grammar, logits.shape[-1])
    tokens = sample(logits, reqs, [s.generator for s in finishing], [s.tokens for s in finishing],
                    [s.prompt_len for s in finishing], eos, masks)  # [S'] on the device, -1: not finite
    got, entries = step_logprobs(tokens, logits, asked, [reqs[i].logprobs or 0 for i in asked])
    chosen: list[Any] = [t if t >= 0 else SamplingError(NOT_FINITE) for t in got]
    return chosen, {asked[j]: e for j, e in enumerate(entries) if isinstance(chosen[asked[j]], int)}


def _grammar_masks(finishing: list[Sequence], grammar: Callable[[GenRequest], Any] | None,
                   vocab: int) -> Masks | None:
    """The rows with a response_format and their allowed tokens bool [R, V], all computed at once."""
    rows = [i for i, s in enumerate(finishing) if _request(s).response_format is not None]
    if not rows:
        return None
    if grammar is None:
        raise ValueError("requests with a response_format need generate(..., grammar=...)")
    from moecc_runtime.structured import fill_masks

    for i in rows:
        if finishing[i].constraint is None:
            finishing[i].constraint = grammar(_request(finishing[i]))
    return rows, fill_masks([finishing[i].constraint for i in rows], vocab)  # [R, V]


class _Choices:
    """Results and failures as the caller sees them: one per request, a request with n > 1
    reported when all its completions finished, or once, at its first failure (its other
    completions' ends are then dropped)."""

    def __init__(self, on_finish: Callable[[GenResult], None], on_error: Callable[[GenRequest, str], None] | None):
        self.on_finish, self.on_error = on_finish, on_error
        self.parts: dict[str, dict[int, GenResult]] = {}  # key -> choice -> result, for n > 1
        self.failed: set[str] = set()  # keys of failed requests with n > 1

    def finish(self, s: Sequence, r: GenResult) -> None:
        n = _request(s).n
        if n == 1:
            self.on_finish(r)
            return
        if r.key in self.failed:
            return
        got = self.parts.setdefault(r.key, {})
        got[s.choice] = r
        if len(got) == n:
            del self.parts[r.key]
            first = got[0]
            self.on_finish(GenResult(first.key, first.prompt_ids, first.token_ids, first.finish_reason,
                                     first.logits, first.logprobs, [got[j] for j in range(n)],
                                     first.prompt_logprobs))

    def fail(self, req: GenRequest, message: str, error: Exception) -> None:
        if req.key in self.failed:
            return
        if req.n > 1:
            self.failed.add(req.key)
            self.parts.pop(req.key, None)
        if self.on_error is None:
            raise error
        self.on_error(req, message)


def _request(s: Sequence) -> GenRequest:
    assert s.request is not None, f"sequence {s.sid} runs no request"
    return s.request


def _finish_reason(s: Sequence, tok: int, eos: set[int],
                   stop_check: Callable[[GenRequest, list[int]], bool] | None) -> str | None:
    """Why `s` ends with its new token `tok` ("stop": EOS or a stop string; "length": its
    max_tokens), or None while it goes on."""
    req = _request(s)
    made = len(s.tokens) - s.prompt_len  # len(s.generated), without its copy
    reason = "stop" if tok in eos else "length" if made >= s.max_new else None
    if req.stop and stop_check is not None and made >= req.min_tokens and stop_check(req, s.generated):
        reason = "stop"
    return reason
