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


def choose(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """logits [S, V] -> one token per row: greedy rows in one argmax, the rest sampled per
    row with its request's parameters and generator."""
    greedy = [i for i, p in enumerate(params) if p.temperature <= 0.0]
    out = [0] * len(params)
    if greedy:
        for i, t in zip(greedy, torch.argmax(logits[greedy], dim=-1).tolist()):
            out[i] = t
    for i, p in enumerate(params):
        if p.temperature > 0.0:
            out[i] = next_token(logits[i], p.temperature, p.top_p, p.top_k, generators[i])
    return out


def request_generator(seed: int | None, custom_id: str) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else zlib.crc32(custom_id.encode()) | (1 << 32))
    return g


def next_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
               generator: torch.Generator | None) -> int:
    """logits: [V] (any float dtype) -> token id."""
    logits = logits.float().cpu()
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    scores = logits / temperature  # [V]
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
