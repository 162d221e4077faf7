"""The generation loop (continuous batching over module-based steps).

Each step:
  1. admit: while fewer than B sequences are in flight, take the next request (preempted
     sequences first) if the KV pool can hold its prompt plus the running sequences'
     expected growth, and the step's prefill budget is not spent;
  2. build the step's work: one token for every decoding sequence, and prompt chunks of
     at most the remaining prefill budget for sequences still prefilling (long prompts
     are prefilled over several steps, interleaved with the decode of the others);
  3. run the engine; if the KV pool runs out, preempt the most recently admitted
     sequence (free its blocks, recompute it later) and retry;
  4. pick next tokens (greedy rows in one argmax), retire each sequence at EOS, a stop
     string (`stop_check`) or its own max_tokens, free its KV blocks and hand its result to
     `on_finish` at once.
`control()` is asked before every step: "run", "drain" (admit nothing new, finish what is
in flight) or "stop" (return now; in-flight requests are dropped unfinished).
Freed slots are refilled from the queue at the next step, so the batch stays full until
the queue drains.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from moecc_runtime.engine import Engine, Sequence
from moecc_runtime.kv import KVCacheFull
from moecc_runtime.sampling import next_token, request_generator

DEFAULT_PREFILL_TOKENS = 2048


@dataclass
class GenRequest:
    key: str  # custom_id
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings (checked by generate's stop_check)


@dataclass
class GenResult:
    key: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (max_tokens or context)
    logits: list[torch.Tensor] = field(default_factory=list)  # per step, when recorded


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
    A request that cannot fit the KV pool even alone goes to `on_error` (raised without it).
    `stop_check(req, generated ids)` says whether a request with stop strings hit one;
    `on_step(tokens generated, sequences in flight)` is called after every step.
    Returns "done", or "drained" / "stopped" when `control` ended the run early."""
    eos = set(engine.info["eos_token_ids"])
    limit = int(max_batch or engine.plan["batch"]["decode"]["B"])
    budget_per_step = int(max_prefill_tokens or engine.plan["batch"]["prefill"].get("tokens_per_step")
                          or DEFAULT_PREFILL_TOKENS)
    kv = engine.kv
    queue = deque(requests)
    preempted: deque[Sequence] = deque()
    running: list[Sequence] = []
    next_id = 0

    def new_sequence(req: GenRequest) -> Sequence:
        nonlocal next_id
        next_id += 1
        return Sequence(next_id - 1, list(req.prompt_ids), len(req.prompt_ids), req.max_tokens,
                        meta={"req": req, "gen": request_generator(req.seed, req.key), "logits": []})

    mode = "run"
    while queue or preempted or running:
        mode = control() if control is not None else "run"
        if mode == "stop" or (mode == "drain" and not running and not preempted):
            return "stopped" if mode == "stop" else "drained"
        # 1. admit (when draining, only the preempted: they are in-flight work)
        budget = budget_per_step - sum(min(s.pending, budget_per_step) for s in running if s.pending > 1)
        while (preempted or (queue and mode == "run")) and len(running) < limit and budget > 0:
            tokens = len(preempted[0].tokens) if preempted else len(queue[0].prompt_ids)
            growth = len(running) // kv.block_size + 1  # blocks the running ones may take next step
            if running and kv.blocks_for(tokens + 1) + growth > kv.free_blocks:
                break
            seq = preempted.popleft() if preempted else new_sequence(queue.popleft())
            running.append(seq)
            budget -= min(seq.pending, budget)
        # 2. work: every decoding sequence, prompt chunks within the prefill budget
        while True:
            work = _plan_work(running, budget_per_step)
            if not work:
                finishing, logits = [], None
                break
            try:
                finishing, logits = engine.step(work)
                break
            except KVCacheFull as e:
                victim = running.pop()  # the most recently admitted
                engine.release(victim)
                if running:
                    victim.cached = 0  # recomputed from its tokens when re-admitted
                    preempted.appendleft(victim)
                    continue
                req = victim.meta["req"]
                msg = (f"request {req.key!r} needs {kv.blocks_for(len(victim.tokens))} KV blocks of "
                       f"{kv.block_size} tokens but the whole pool has {kv.num_blocks}; compile with more "
                       f"--host-mem or lower its max_tokens")
                if on_error is None:
                    raise KVCacheFull(victim.sid, e.needed, e.free, e.capacity) from e
                on_error(req, msg)
        if logits is None:
            continue
        # 3. next tokens
        chosen = _choose(finishing, logits)
        done: set[int] = set()
        for s, row, tok in zip(finishing, logits, chosen):
            req = s.meta["req"]
            if record_logits:
                s.meta["logits"].append(row.clone())
            s.tokens.append(tok)
            reason = "stop" if tok in eos else "length" if len(s.generated) >= s.max_new else None
            if req.stop and stop_check is not None and stop_check(req, s.generated):
                reason = "stop"
            if reason is not None:
                engine.release(s)
                done.add(s.sid)
                on_finish(GenResult(req.key, req.prompt_ids, s.generated, reason, s.meta["logits"]))
        if done:
            running = [s for s in running if s.sid not in done]
        if on_step is not None:
            on_step(len(finishing), len(running))
    return "drained" if queue else "done"


def _plan_work(running: list[Sequence], budget: int) -> list[tuple[Sequence, int]]:
    work = []
    for s in running:
        if s.pending == 1:
            work.append((s, 1))
        elif budget > 0:
            n = min(s.pending, budget)
            budget -= n
            work.append((s, n))
    return work


def _choose(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """Next token per sequence: greedy rows in one argmax, the rest sampled per request."""
    greedy = [i for i, s in enumerate(seqs) if s.meta["req"].temperature <= 0.0]
    out = [0] * len(seqs)
    if greedy:
        for i, t in zip(greedy, torch.argmax(logits[greedy], dim=-1).tolist()):
            out[i] = t
    for i, s in enumerate(seqs):
        if s.meta["req"].temperature > 0.0:
            r = s.meta["req"]
            out[i] = next_token(logits[i], r.temperature, r.top_p, r.top_k, s.meta["gen"])
    return out
