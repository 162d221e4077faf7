"""The sampler: next tokens for a whole step's logits, greedy, or sampling with temperature,
top-k and top-p from a per-request generator (seeded, so a seeded request is reproducible
whatever else runs). A request's logit_bias, min_tokens, repetition_penalty and
presence/frequency penalties reshape its row first (`adjust_logits`); a request with none of
them takes exactly the path it took before they existed.

Legend: S = sequences choosing a token this step, V = vocabulary.
"""

from __future__ import annotations

import zlib
from typing import Collection, Protocol, Sequence

import torch


class SamplingParams(Protocol):
    """What the sampler reads of a request (scheduler.sequence.GenRequest has these)."""

    temperature: float
    top_p: float
    top_k: int


def is_neutral(p: object) -> bool:
    """Whether `p` sets none of the penalties, biases and floors (its logits go unchanged)."""
    return (getattr(p, "presence_penalty", 0.0) == 0.0 and getattr(p, "frequency_penalty", 0.0) == 0.0
            and getattr(p, "repetition_penalty", 1.0) == 1.0 and not getattr(p, "logit_bias", ())
            and getattr(p, "min_tokens", 0) <= 0)


def adjust_logits(logits: torch.Tensor, p: object, tokens: Sequence[int], prompt_len: int,
                  eos: Collection[int] = ()) -> torch.Tensor:
    """logits [V] of one request -> a new float32 row [V] with, in this order:
    logit_bias added (`p.logit_bias`: (token id, bias) pairs); EOS set to -inf while fewer than
    `p.min_tokens` tokens were generated; repetition_penalty (vLLM/HF) over the tokens of
    prompt + generated (`tokens`): a logit > 0 divided by it, any other multiplied by it;
    then OpenAI's presence and frequency penalties over the generated tokens
    (`tokens[prompt_len:]`): logit[t] -= presence * (count[t] > 0) + frequency * count[t]."""
    x = logits.float().clone()
    dev, V = x.device, x.numel()
    bias = getattr(p, "logit_bias", ())
    if bias:
        ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=dev)
        x.index_add_(0, ids, torch.tensor([b for _, b in bias], dtype=torch.float32, device=dev))
    generated = tokens[prompt_len:]
    floor = getattr(p, "min_tokens", 0)
    if floor > 0 and len(generated) < floor and eos:
        x[torch.tensor(sorted(eos), dtype=torch.long, device=dev)] = float("-inf")
    rep = getattr(p, "repetition_penalty", 1.0)
    if rep != 1.0 and len(tokens):
        seen = torch.tensor(sorted(set(tokens)), dtype=torch.long, device=dev)
        v = x[seen]
        x[seen] = torch.where(v > 0, v / rep, v * rep)
    presence, frequency = getattr(p, "presence_penalty", 0.0), getattr(p, "frequency_penalty", 0.0)
    if (presence != 0.0 or frequency != 0.0) and len(generated):
        counts = torch.bincount(torch.tensor(list(generated), dtype=torch.long, device=dev), minlength=V)[:V].float()
        x -= frequency * counts + presence * (counts > 0).float()
    return x


class SamplingError(ValueError):
    """One row's logits cannot be sampled (not finite): that request fails, the others go on."""


#: a step's grammar masks: the rows that have one, and their allowed tokens bool [R, V]
Masks = tuple[list[int], torch.Tensor]


def choose(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None], tokens: Sequence[Sequence[int]] | None = None,
           prompt_lens: Sequence[int] | None = None, eos: Collection[int] = (),
           masks: Masks | None = None) -> list[int | SamplingError]:
    """logits [S, V] -> one token per row: greedy rows in one argmax, the rest sampled per
    row with its request's parameters and generator. A row whose logits are not all finite
    gets a SamplingError in its place instead of a token. The rows in `masks` (a grammar's
    allowed tokens) have every other token at -inf, all in one op. A row whose request sets
    penalties, a logit_bias or min_tokens is then reshaped by `adjust_logits` from its
    `tokens` (prompt + generated so far), `prompt_lens` and the model's `eos` ids; the others
    are untouched. Where the reshaping leaves no allowed token finite (min_tokens against a
    finished grammar's EOS), the grammar wins over the reshaping."""
    finite = torch.isfinite(logits).all(dim=-1).tolist()  # [S], of the raw logits
    if masks is not None and masks[0]:
        rows, allowed = masks
        logits = logits.clone()
        logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))  # [R, V]
    shaped = {i for i, p in enumerate(params) if finite[i] and not is_neutral(p)}
    if shaped and (tokens is None or prompt_lens is None):
        raise ValueError("requests with penalties, logit_bias or min_tokens need their tokens and prompt lengths")
    greedy = [i for i, p in enumerate(params) if p.temperature <= 0.0 and finite[i] and i not in shaped]
    out: list[int | SamplingError] = [SamplingError("the model's logits for this request are not finite "
                                                    "(NaN or infinite)") for _ in params]
    if greedy:
        for i, t in zip(greedy, torch.argmax(logits[greedy], dim=-1).tolist()):
            out[i] = t
    for i, p in enumerate(params):
        if i in shaped:
            assert tokens is not None and prompt_lens is not None
            row = adjust_logits(logits[i], p, tokens[i], prompt_lens[i], eos)  # a masked token stays -inf
            if not bool(torch.isfinite(row).any()):  # e.g. min_tokens holds off the EOS the grammar needs
                row = logits[i].float()  # the grammar wins
            out[i] = next_token(row, p.temperature, p.top_p, p.top_k, generators[i])
        elif p.temperature > 0.0 and finite[i]:
            out[i] = next_token(logits[i], p.temperature, p.top_p, p.top_k, generators[i])
    return out


def request_generator(seed: int | None, custom_id: str, choice: int = 0) -> torch.Generator:
    """The random state of completion `choice` of a request: from its seed (choice j > 0:
    seed + j), else from its custom_id (and j); reproducible whatever else runs."""
    g = torch.Generator(device="cpu")
    if seed is not None:
        g.manual_seed((seed + choice) % 2**64)
    else:
        g.manual_seed(zlib.crc32((custom_id if choice == 0 else f"{custom_id}#{choice}").encode()) | (1 << 32))
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
