"""The sampler: the next token of every row of a step at once, on the device the logits are on.

In this order, each one op (or a few) over all the rows that need it:
  1. a row whose raw logits are not finite (NaN, +inf, or nothing above -inf) is marked: its
     request fails alone (SamplingError), the others go on;
  2. grammar masks (structured outputs): every token the row's grammar forbids set to -inf;
  3. penalties, logit_bias and min_tokens (penalties.adjust_rows) for the rows that set any:
     where the reshaping leaves no token finite (min_tokens against a finished grammar's EOS),
     the grammar wins over the reshaping;
  4. greedy rows (temperature 0): argmax; the others drawn (draw_rows.py) from one uniform of
     their own request's stream each.
Each row's parameters are its request's SamplingParams (params.py). The tokens come back to
the host in one copy (`choose`; with the logprobs of the rows that asked: logprobs.py), the
only host read of a step's sampling (syncs.py, site "sample"). Index and parameter tensors go to the device through
`syncs.to_device`, which never waits for it.

Legend: S = rows choosing a token this step, R = rows of one kind, V = vocabulary.
"""

from __future__ import annotations

from typing import Collection, Sequence

import torch

from moecc_runtime import native
from moecc_runtime.sampling.draw_rows import DrawParams, draw, workspace
from moecc_runtime.sampling.params import SamplingParams
from moecc_runtime.sampling.penalties import adjust_rows, is_neutral
from moecc_runtime.sampling.random import uniforms
from moecc_runtime.syncs import to_device, to_list


class SamplingError(ValueError):
    """One row's logits cannot be sampled (not finite): that request fails, the others go on."""


#: a step's grammar masks: the rows that have one, and their allowed tokens bool [R, V]
Masks = tuple[list[int], torch.Tensor]

#: what a row gets when its logits cannot be sampled
NOT_FINITE = "the model's logits for this request are not finite (NaN or infinite)"


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           tokens: Sequence[Sequence[int]] | None = None, prompt_lens: Sequence[int] | None = None,
           eos: Collection[int] = (), masks: Masks | None = None) -> torch.Tensor:
    """logits [S, V] -> tokens [S] int64 on the logits' device, -1 where the row's raw logits
    are not finite. Rows with penalties, a logit_bias or min_tokens need their `tokens`
    (prompt + generated so far) and `prompt_lens` (ValueError otherwise). Queues device work
    only: no host read of a device tensor."""
    if masks is None and all(p.temperature <= 0.0 and is_neutral(p) for p in params):
        return greedy(logits)
    logits = logits.float()  # every other path reads fp32 logits
    S, V = logits.shape
    dev = logits.device
    raw_max = logits.amax(dim=-1)  # [S]: NaN where any is NaN, +inf, or -inf when none is finite
    finite = torch.isfinite(raw_max)  # [S]
    x = _masked(logits, masks)
    shaped = [i for i, p in enumerate(params) if not is_neutral(p)]
    if shaped and (tokens is None or prompt_lens is None):
        raise ValueError("requests with penalties, logit_bias or min_tokens need their tokens and prompt lengths")
    adjusted = None  # [R, V] float32: the shaped rows, reshaped
    if shaped:
        assert tokens is not None and prompt_lens is not None
        adjusted = _reshaped(x, shaped, [params[i] for i in shaped], [tokens[i] for i in shaped],
                             [prompt_lens[i] for i in shaped], eos)
    at = {i: n for n, i in enumerate(shaped)}  # row -> its row in `adjusted`
    out = _greedy(x, adjusted, at, [i for i, p in enumerate(params) if p.temperature <= 0.0])
    drawn = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if drawn:
        out[to_device(drawn, dev, torch.long)] = draw(_drawn_rows(x, drawn, adjusted, at), DrawParams.of(
            [params[i] for i in drawn]), uniforms([generators[i] for i in drawn], dev))
    return torch.where(finite, out, torch.full_like(out, -1))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Plain greedy rows: logits [S, V] (fp32 or bf16) -> tokens [S] int64 on their device, -1 where
    a row is not finite; the first index of a row's largest value (torch.argmax's choice). On the host
    the native pass reads each row once in its own dtype (native.greedy_rows: 2-3x torch's max over
    fp32, and no fp32 copy of a bf16 step's logits); elsewhere torch's max."""
    tok = native.greedy_rows(logits) if logits.device.type == "cpu" else None
    if tok is not None:
        return tok
    best, tok = logits.max(dim=-1)  # the finiteness check and the argmax in one pass
    return torch.where(torch.isfinite(best), tok, torch.full_like(tok, -1))


def _drawn_rows(x: torch.Tensor, drawn: list[int], adjusted: torch.Tensor | None, at: dict[int, int]) -> torch.Tensor:
    """The drawn rows' logits [R, V] float32: x itself when every row is drawn as it is, else
    a copy with the reshaped rows from `adjusted`. A non-finite row goes through as it is
    (the draw stays in range; its token is discarded)."""
    if len(drawn) == x.shape[0] and not at and x.dtype == torch.float32:
        return x
    if adjusted is not None and [at.get(i) for i in drawn] == list(range(len(drawn))) and len(at) == len(drawn):
        return adjusted  # every drawn row reshaped, in order: they are the reshaped rows
    rows = x[to_device(drawn, x.device, torch.long)].float()  # [R, V]
    mine = [n for n, i in enumerate(drawn) if i in at]
    if mine:
        assert adjusted is not None
        rows[to_device(mine, x.device, torch.long)] = adjusted[to_device([at[drawn[n]] for n in mine], x.device,
                                                                          torch.long)]
    return rows


def _greedy(x: torch.Tensor, adjusted: torch.Tensor | None, at: dict[int, int], greedy: list[int]) -> torch.Tensor:
    """tokens [S] int64 with the greedy rows' argmax filled in (the others unset): a row that
    was reshaped from `adjusted` (its row at[i]), the others from x."""
    S = x.shape[0]
    if len(greedy) == S and not at:
        return x.argmax(dim=-1)
    out = torch.zeros(S, dtype=torch.long, device=x.device)
    plain = [i for i in greedy if i not in at]
    if plain:
        p = to_device(plain, x.device, torch.long)
        out[p] = x[p].argmax(dim=-1)
    mine = [i for i in greedy if i in at]
    if mine:
        assert adjusted is not None
        out[to_device(mine, x.device, torch.long)] = adjusted[to_device([at[i] for i in mine], x.device,
                                                                        torch.long)].argmax(dim=-1)
    return out


def _masked(logits: torch.Tensor, masks: Masks | None) -> torch.Tensor:
    """logits [S, V], with the masked rows' forbidden tokens at -inf (a copy when any row is masked)."""
    if masks is None or not masks[0]:
        return logits
    rows, allowed = masks
    x = logits.clone()
    r = to_device(rows, x.device, torch.long)
    x[r] = x[r].masked_fill(~to_device(allowed, x.device), float("-inf"))  # [R, V]
    return x


def _reshaped(x: torch.Tensor, shaped: list[int], params: list[SamplingParams], tokens: list[Sequence[int]],
              prompt_lens: list[int], eos: Collection[int]) -> torch.Tensor:
    """The `shaped` rows of x [S, V], reshaped (penalties.adjust_rows) -> [R, V] float32; a
    row left with no finite token keeps its masked logits (the grammar wins)."""
    idx = to_device(shaped, x.device, torch.long)
    R, V = len(shaped), x.shape[1]
    rows = workspace(R * V, x.device, "reshaped")[:R * V].view(R, V)  # kept between steps: no page faults
    if shaped == list(range(x.shape[0])):
        rows.copy_(x)
    elif x.is_cuda:
        rows.copy_(x[idx])
    else:
        for n, i in enumerate(shaped):  # row by row: a gather into an out= buffer is serial on the host
            rows[n].copy_(x[i])
    after = adjust_rows(rows, params, tokens, prompt_lens, eos)  # [R, V], reshaped in place
    dead = ~torch.isfinite(after.amax(dim=-1))  # [R] e.g. min_tokens holds off the EOS the grammar needs
    if after.is_cuda:
        return torch.where(dead[:, None], x[idx].float(), after)
    rows = dead.nonzero()[:, 0]  # host tensors: no sync; usually none
    if rows.numel():
        after[rows] = x[idx[rows]].float()
    return after


def choose(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           tokens: Sequence[Sequence[int]] | None = None, prompt_lens: Sequence[int] | None = None,
           eos: Collection[int] = (), masks: Masks | None = None) -> list[int | SamplingError]:
    """`sample`, read back: one token per row, a SamplingError in place of a row whose logits
    are not finite. One host read."""
    got = to_list(sample(logits, params, generators, tokens, prompt_lens, eos, masks), "sample")
    return [t if t >= 0 else SamplingError(NOT_FINITE) for t in got]


def next_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
               generator: torch.Generator | None, min_p: float = 0.0) -> int:
    """One row: logits [V] (finite) -> token id, as `sample` draws it."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    row = logits.float().clone()[None]  # [1, V]
    u = uniforms([generator], row.device)
    return int(draw(row, DrawParams([temperature], [top_k], [top_p], [min_p]), u)[0])
