"""Logprobs: what a request that asked for them is told of each token, computed from the raw
logits (before the grammar masks and penalties reshape them), in fp32 log-softmax.

A step's chosen tokens and the logprob entries of the rows that asked come to the host in
one copy (`read_back`, syncs.py site "sample"), so asking for logprobs adds no host read.

Legend: S = rows choosing a token this step, R = rows whose request asked, V = vocabulary.
"""

from __future__ import annotations

import torch

from moecc_runtime.syncs import to_device, to_list

#: one token's logprob entry: (its logprob, [(token id, logprob), ...] the top N, best first)
LogprobEntry = tuple[float, list[tuple[int, float]]]


def step_logprobs(tokens: torch.Tensor, logits: torch.Tensor, asked: list[int],
                  tops: list[int]) -> tuple[list[int], list[LogprobEntry]]:
    """A step's tokens [S] (on the device, -1 where not finite) and raw logits [S, V] -> the
    tokens as host ints and, for each row in `asked` (with tops[j] most likely wanted), the
    logprob entry of its chosen token. One host read."""
    lps = _log_softmax(logits, asked)  # [R, V] or None
    ids = tokens[to_device(asked, tokens.device, torch.long)].clamp_min(0) if asked else None  # [R]
    return read_back(tokens, lps, ids, tops)


def prompt_logprobs(logits: torch.Tensor, rows: list[int], ids: list[int], tops: list[int]) -> list[LogprobEntry]:
    """Head rows `rows` of logits [R', V] scoring the prompt tokens `ids` (one per row) -> each
    one's logprob entry with its tops[j] most likely. One host read."""
    return read_back(None, _log_softmax(logits, rows), ids, tops)[1]


def _log_softmax(logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """The fp32 log-softmax [R, V] of the raw logits' `rows`, or None when there are none."""
    if not rows:
        return None
    return torch.log_softmax(logits[rows].float(), dim=-1)


def read_back(tokens: torch.Tensor | None, lps: torch.Tensor | None, ids: torch.Tensor | list[int] | None,
              tops: list[int]) -> tuple[list[int], list[LogprobEntry]]:
    """One host read for a step: the tokens [S] (when given) and, for each row of lps [R, V]
    (log-softmax rows), (the logprob of its token ids[r], its tops[r] most likely [(id,
    logprob)], best first): one gather, one top-k and one copy of them all."""
    parts: list[torch.Tensor] = [] if tokens is None else [tokens.double()]
    R = 0 if lps is None else lps.shape[0]
    k = 0
    if lps is not None and R:
        idx = ids if isinstance(ids, torch.Tensor) else to_device(list(ids or []), lps.device, torch.long)
        k = min(max(tops), lps.shape[-1])
        parts.append(lps.gather(1, idx[:, None])[:, 0].double())  # [R]
        if k > 0:
            top_v, top_i = lps.topk(k, dim=-1)  # [R, k]
            parts += [top_v.flatten().double(), top_i.flatten().double()]
    if not parts:
        return [], []
    flat = to_list(torch.cat(parts), "sample")
    S = 0 if tokens is None else tokens.shape[0]
    got = [int(t) for t in flat[:S]]
    picked = flat[S:S + R]
    vals, ids_ = flat[S + R:S + R + R * k], flat[S + R + R * k:]
    return got, [(picked[r], [(int(ids_[r * k + j]), vals[r * k + j]) for j in range(t)]) for r, t in enumerate(tops)]
