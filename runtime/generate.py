"""The generation loop: admit requests up to the plan's batch size B, step the engine,
choose next tokens, retire each sequence at EOS or its own max_tokens, refill freed slots
from the queue between steps, and hand every finished sequence to a callback at once."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from moecc_runtime.engine import Engine, Sequence
from moecc_runtime.sampling import next_token, request_generator


@dataclass
class GenRequest:
    key: str  # custom_id
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass
class GenResult:
    key: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) | "length" (max_tokens or context)
    logits: list[torch.Tensor] = field(default_factory=list)  # per step, when recorded


def generate(
    engine: Engine,
    requests: Iterable[GenRequest],
    on_finish: Callable[[GenResult], None],
    *,
    max_batch: int | None = None,
    max_prefill_tokens: int = 8192,
    record_logits: bool = False,
) -> None:
    """Run every request to completion; `on_finish` is called as each one finishes."""
    info = engine.info
    eos = set(info["eos_token_ids"])
    limit = int(max_batch or engine.plan["batch"]["decode"]["B"])
    queue = deque(requests)
    active: list[Sequence] = []
    next_id = 0
    while queue or active:
        budget = max_prefill_tokens
        admitted = 0
        while queue and len(active) < limit:
            req = queue[0]
            if admitted and len(req.prompt_ids) > budget:
                break
            queue.popleft()
            seq = Sequence(next_id, list(req.prompt_ids), len(req.prompt_ids), req.max_tokens,
                           meta={"req": req, "gen": request_generator(req.seed, req.key), "logits": []})
            next_id += 1
            engine.allocate(seq)
            active.append(seq)
            budget -= len(req.prompt_ids)
            admitted += 1
        logits = engine.step(active)  # [S, V]
        still: list[Sequence] = []
        for s, row in zip(active, logits):
            req: GenRequest = s.meta["req"]
            if record_logits:
                s.meta["logits"].append(row.clone())
            tok = next_token(row, req.temperature, req.top_p, req.top_k, s.meta["gen"])
            s.tokens.append(tok)
            reason = None
            if tok in eos:
                reason = "stop"
            elif len(s.generated) >= s.max_new:
                reason = "length"
            if reason is None:
                still.append(s)
            else:
                s.kv = None  # free the cache before the callback writes output
                on_finish(GenResult(req.key, req.prompt_ids, s.generated, reason, s.meta["logits"]))
        active = still
