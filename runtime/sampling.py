"""The sampler: next tokens for a whole step's logits, greedy, or sampling with temperature,
top-k and top-p from a per-request generator (seeded, so a seeded request is reproducible
whatever else runs).

Legend: S = sequences choosing a token this step, V = vocabulary.
"""

from __future__ import annotations

import zlib
from typing import Protocol, Sequence

import torch


class SamplingParams(Protocol):
    """What the sampler reads of a request (scheduler.sequence.GenRequest has these)."""

    temperature: float
    top_p: float
    top_k: int


class SamplingError(ValueError):
    """One row's logits cannot be sampled (not finite): that request fails, the others go on."""


def choose(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int | SamplingError]:
    """logits [S, V] -> one token per row: greedy rows in one argmax, the rest sampled per
    row with its request's parameters and generator. A row whose logits are not all finite
    gets a SamplingError in its place instead of a token."""
    finite = torch.isfinite(logits).all(dim=-1).tolist()  # [S]
    greedy = [i for i, p in enumerate(params) if p.temperature <= 0.0 and finite[i]]
    out: list[int | SamplingError] = [SamplingError("the model's logits for this request are not finite "
                                                    "(NaN or infinite)") for _ in params]
    if greedy:
        for i, t in zip(greedy, torch.argmax(logits[greedy], dim=-1).tolist()):
            out[i] = t
    for i, p in enumerate(params):
        if p.temperature > 0.0 and finite[i]:
            out[i] = next_token(logits[i], p.temperature, p.top_p, p.top_k, generators[i])
    return out


def request_generator(seed: int | None, custom_id: str) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else zlib.crc32(custom_id.encode()) | (1 << 32))
    return g


def next_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
               generator: torch.Generator | None) -> int:
    """logits: [V] (any float dtype, finite) -> token id. Safe for any temperature > 0: the
    scores are shifted so the largest is 0 before dividing, so a tiny temperature gives
    -inf (never inf - inf = NaN) to every token but the best ones."""
    logits = logits.float().cpu()
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    t = max(temperature, torch.finfo(torch.float32).tiny)  # a float32 divisor > 0: 0 / t stays 0
    scores = (logits - logits.max()) / t  # [V], max 0
    if top_k > 0 and top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=True)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        remove = cum > top_p
        remove[1:] = remove[:-1].clone()  # keep the token that crosses top_p
        remove[0] = False
        scores = scores.scatter(0, sorted_idx, sorted_scores.masked_fill(remove, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
