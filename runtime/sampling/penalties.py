"""A request's logit reshaping, for all of a step's rows that ask for one at once:
logit_bias, min_tokens, repetition_penalty, presence and frequency penalties. A request that
sets none of them (`is_neutral`) is never reshaped: its logits reach the draw as the model
made them.

Legend: R = rows reshaped this step, V = vocabulary.
"""

from __future__ import annotations

from itertools import chain
from typing import Collection, Sequence

import torch

from moecc_runtime.sampling.params import SamplingParams
from moecc_runtime.syncs import to_device


def is_neutral(p: SamplingParams) -> bool:
    """Whether `p` sets none of the penalties, biases and floors (its logits go unchanged)."""
    return (p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
            and not p.logit_bias and p.min_tokens <= 0)


def adjust_rows(x: torch.Tensor, params: Sequence[SamplingParams], tokens: Sequence[Sequence[int]],
                prompt_lens: Sequence[int], eos: Collection[int] = ()) -> torch.Tensor:
    """x [R, V] float32, reshaped in place and returned, row r by params[r] in this order:
    logit_bias added (`logit_bias`: (token id, bias) pairs); EOS set to -inf while fewer than
    `min_tokens` tokens were generated; repetition_penalty (vLLM/HF) over prompt + generated
    (`tokens[r]`): a logit > 0 divided by it, any other multiplied by it; then OpenAI's
    presence and frequency penalties over the generated tokens (`tokens[r][prompt_lens[r]:]`):
    logit[t] -= presence * (count[t] > 0) + frequency * count[t]. Each kind is one op over all
    the rows that ask for it."""
    R, V = x.shape
    flat = x.view(-1)  # [R*V]
    dev = x.device
    _bias(flat, params, V, dev)
    _floor(x, params, tokens, prompt_lens, eos)
    _repetition(flat, params, tokens, V, dev)
    _presence_frequency(flat, params, tokens, prompt_lens, V, dev)
    return x


def _long(xs: list[int], dev: torch.device) -> torch.Tensor:
    return to_device(xs, dev, torch.long)


def _bias(flat: torch.Tensor, params: Sequence[SamplingParams], V: int, dev: torch.device) -> None:
    idx, val = [], []
    for r, p in enumerate(params):
        for t, b in p.logit_bias:
            idx.append(r * V + t)
            val.append(b)
    if idx:
        flat.index_add_(0, _long(idx, dev), to_device(val, dev, torch.float32))


def _floor(x: torch.Tensor, params: Sequence[SamplingParams], tokens: Sequence[Sequence[int]],
           prompt_lens: Sequence[int], eos: Collection[int]) -> None:
    rows = [r for r, p in enumerate(params)
            if p.min_tokens > len(tokens[r]) - prompt_lens[r]]
    if rows and eos:
        x[_long(rows, x.device)[:, None], _long(sorted(eos), x.device)[None, :]] = float("-inf")


def _flat(rows: list[int], seqs: list[Sequence[int]], V: int) -> torch.Tensor:
    """The tokens of each listed row as flat indexes r * V + t into [R, V], concatenated (host)."""
    lens = torch.tensor([len(q) for q in seqs], dtype=torch.long)
    toks = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)
    return torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lens) * V + toks


def _repetition(flat: torch.Tensor, params: Sequence[SamplingParams], tokens: Sequence[Sequence[int]], V: int,
                dev: torch.device) -> None:
    rows = [r for r, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return
    seen = torch.unique(_flat(rows, [tokens[r] for r in rows], V))  # each (row, token) once
    if not seen.numel():
        return
    pen = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)[seen // V]
    i, pen = to_device(seen, dev), to_device(pen, dev)
    v = flat[i]
    flat[i] = torch.where(v > 0, v / pen, v * pen)


def _presence_frequency(flat: torch.Tensor, params: Sequence[SamplingParams], tokens: Sequence[Sequence[int]],
                        prompt_lens: Sequence[int], V: int, dev: torch.device) -> None:
    rows = [r for r, p in enumerate(params)
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if not rows:
        return
    uniq, counts = torch.unique(_flat(rows, [tokens[r][prompt_lens[r]:] for r in rows], V), return_counts=True)
    if not uniq.numel():
        return
    pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float64)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float64)
    r = uniq // V
    sub = (freq[r] * counts.double() + pres[r]).float()  # in float64 then rounded once, as a Python float would be
    flat.index_add_(0, to_device(uniq, dev), -to_device(sub, dev))


def adjust_logits(logits: torch.Tensor, p: SamplingParams, tokens: Sequence[int], prompt_len: int,
                  eos: Collection[int] = ()) -> torch.Tensor:
    """One request's row: logits [V] -> a new float32 row [V] reshaped as `adjust_rows` does."""
    return adjust_rows(logits.float().clone()[None], [p], [tokens], [prompt_len], eos)[0]
