"""Drawing tokens for many rows at once: temperature, top-k, top-p (nucleus) and min-p, each
row from one uniform number of its own (`u`), so a row's token depends on its logits and its
request's random stream only, never on the other rows of the step.

A row's distribution is softmax(logits / temperature) truncated to its kept tokens; its token
is the inverse CDF of `u` over the kept tokens, best first. No row is sorted whole unless it
must be: the rows' probabilities are made in one workspace (scaled, then softmax in place), and
the rows take their K best tokens in tiers (`TIERS`: 256, then 1,024, then 4,096 for the rows the tier
before could not settle), and a row is drawn in the first tier that settles
it: a truncated row when its kept set provably ends inside the tier (top-k <= K, the nucleus
closing inside, min-p cutting inside); an untruncated row when `u` falls inside the tier's
mass. Past the last tier, an untruncated row draws in the rest of the vocabulary in index
order (the same distribution) and a truncated one sorts its whole row. Exact in distribution.

Legend: R = rows drawn, V = vocabulary, K = a tier's candidates per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from moecc_runtime import native
from moecc_runtime.sampling.params import SamplingParams
from moecc_runtime.syncs import to_device

#: candidates per row of each tier; a row goes to the next tier only when this one cannot settle it
TIERS = (256, 1024, 4096)
#: below this temperature a row subtracts its max before scaling (x / t would overflow)
SAFE_T = 1e-2


@dataclass
class DrawParams:
    """The drawn rows' parameters, as host lists (one entry per row)."""

    temperature: list[float]
    top_k: list[int]  # 0: off
    top_p: list[float]  # 1.0: off
    min_p: list[float]  # 0.0: off

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> "DrawParams":
        """The draw's columns of the rows' SamplingParams, in row order."""
        return cls([float(p.temperature) for p in params], [int(p.top_k) for p in params],
                   [float(p.top_p) for p in params], [float(p.min_p) for p in params])


@dataclass
class _Rows:
    """The drawn rows' state on the device: x [R, V] their probabilities (softmax(logits / t)
    truncated to nothing yet), and as [R, 1] tensors the truncation and each row's uniform."""

    x: torch.Tensor | None  # made only when a tier past the native one runs
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    u: torch.Tensor
    truncated: torch.Tensor  # [R, 1] bool: any of top-k, top-p, min-p set


_workspace: dict[tuple[torch.device, str], torch.Tensor] = {}


def workspace(numel: int, device: torch.device, use: str = "probabilities") -> torch.Tensor:
    """A float32 buffer of at least `numel` elements on `device` for `use` ("probabilities":
    the draw's; "reshaped": the sampler's reshaped rows), kept between steps (a fresh [R, V]
    allocation every step costs page faults on the host). Not shared across threads."""
    key = (device, use)
    ws = _workspace.get(key)
    if ws is None or ws.numel() < numel:
        _workspace.pop(key, None)
        ws = _workspace[key] = torch.empty(numel, dtype=torch.float32, device=device)
    return ws


def draw(x: torch.Tensor, p: DrawParams, u: torch.Tensor) -> torch.Tensor:
    """x [R, V] float32 logits, each row's max finite (not modified); u [R] in [0, 1) ->
    tokens [R] int64 on x's device. On a GPU it queues device work only (no host read); on
    the host each tier runs over the rows left to it, the first in the native kernel when it
    was built (moecc_runtime.native.sample_rows: the softmax and the K best in one read of
    each row; each tier over the rows the one before left; an untruncated row is always settled
    by the first, its tail drawn there too), the rows no tier settles through the tensor path's
    sorted rows."""
    if not _native_first(x):
        return _draw_tensors(x, p, u, TIERS)
    R, V = x.shape
    s = _state(p, u, V, x.device)
    inv = torch.tensor([1.0 / max(t, torch.finfo(torch.float32).tiny) for t in p.temperature], dtype=torch.float32)
    top_k, top_p, min_p, uu = s.top_k[:, 0], s.top_p[:, 0], s.min_p[:, 0], s.u[:, 0]
    xc = x.contiguous()
    tok, rows = torch.full((R,), -1, dtype=torch.long), torch.arange(R)
    last = torch.zeros((R, 1), dtype=torch.long)
    for K in TIERS:
        got, last = native.draw_rows(xc, rows, inv[rows], top_k[rows], top_p[rows], min_p[rows], uu[rows], min(K, V))
        tok[rows] = got
        keep = got < 0
        rows, last = rows[keep], last[keep]
        if K >= V or not rows.numel():
            return tok
    sub = DrawParams(*([getattr(p, f)[r] for r in rows.tolist()] for f in ("temperature", "top_k", "top_p", "min_p")))
    tok[rows] = _draw_tensors(x[rows], sub, u[rows], (), last)  # the tail / sorted rows, with their last candidates
    return tok


def _state(p: DrawParams, u: torch.Tensor, V: int, dev: torch.device) -> _Rows:
    f32 = torch.float32
    top_k = to_device([k if 0 < k < V else 0 for k in p.top_k], dev, torch.long)[:, None]
    top_p, min_p = to_device(p.top_p, dev, f32)[:, None], to_device(p.min_p, dev, f32)[:, None]
    return _Rows(None, top_k, top_p, min_p, u.to(dev, f32)[:, None], (top_k > 0) | (top_p < 1.0) | (min_p > 0.0))


def _draw_tensors(x: torch.Tensor, p: DrawParams, u: torch.Tensor, tiers: tuple[int, ...],
                  last: torch.Tensor | None = None) -> torch.Tensor:
    """`draw` in tensor ops (any device): probabilities in the workspace, then `tiers`, then
    the tail or the whole sorted row. `last` [R, K]: the candidates of a tier already run (the
    tail leaves them out); else the last of `tiers` is found again."""
    R, V = x.shape
    dev = x.device
    s = _state(p, u, V, dev)
    s.x = _probabilities(x, p.temperature)  # [R, V]
    tok = torch.full((R,), -1, dtype=torch.long, device=dev)
    left = torch.ones(R, dtype=torch.bool, device=dev)  # [R] rows not settled yet
    for K in tiers:
        K = min(K, V)
        rows = _subset(left)
        w, idx = s.x[rows].topk(K, dim=-1) if rows.numel() != R else s.x.topk(K, dim=-1)  # [n, K]
        tok, left = _merge(tok, left, *_settle(s, rows, w, idx, V))
        if K == V or not _any(left):
            return tok
    tail, wide = left & ~s.truncated[:, 0], left & s.truncated[:, 0]
    if _any(tail):
        r = _subset(tail)
        tok[r] = _tail(s, r, None if last is None else last[r])
    if _any(wide):
        r = _subset(wide)
        tok[r] = _sorted(s, r)
    return tok


def _native_first(x: torch.Tensor) -> bool:
    """Whether the first tier runs in the native kernel: a host fp32 tensor, kernel built."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and native.sampling_available()


def _probabilities(x: torch.Tensor, temperature: list[float]) -> torch.Tensor:
    """softmax(x / t) per row, [R, V] in the workspace: one scaling pass, softmax in place.
    A row whose temperature is below SAFE_T has its max subtracted first, so x / t cannot
    overflow (its best token gets 0, the others -inf or less)."""
    R, V = x.shape
    tiny = torch.finfo(torch.float32).tiny
    inv = to_device([1.0 / max(t, tiny) for t in temperature], x.device, torch.float32)[:, None]  # [R, 1]
    w = workspace(R * V, x.device)[:R * V].view(R, V)
    torch.mul(x, inv.clamp_max(torch.finfo(torch.float32).max), out=w)
    cold = [r for r, t in enumerate(temperature) if t < SAFE_T]
    if cold:
        c = to_device(cold, x.device, torch.long)
        w[c] = (x[c] - x[c].amax(dim=-1, keepdim=True)) * inv[c]
    torch.ops.aten._softmax.out(w, -1, False, out=w)
    return w


def _subset(flags: torch.Tensor) -> torch.Tensor:
    """The rows a step works on: those flagged (host), every row (GPU: no host read)."""
    return torch.arange(flags.shape[0], device=flags.device) if flags.is_cuda else flags.nonzero()[:, 0]


def _any(flags: torch.Tensor) -> bool:
    return True if flags.is_cuda else bool(flags.any())


def _merge(tok: torch.Tensor, left: torch.Tensor, got: tuple[torch.Tensor, torch.Tensor],
           settled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of the rows `got` = (row indexes, tokens) that this tier settled and were left."""
    rows, toks = got
    take = settled & left[rows]
    tok = tok.clone()
    tok[rows] = torch.where(take, toks, tok[rows])
    left = left.clone()
    left[rows] = left[rows] & ~take
    return tok, left


def _settle(s: _Rows, rows: torch.Tensor, pc: torch.Tensor, idx: torch.Tensor, V: int
            ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The rows `rows` drawn among their K best (probabilities pc [n, K], best first, their
    ids idx): ((rows, tokens [n]), settled [n] bool: the draw holds for the row)."""
    K = pc.shape[-1]
    top_k, top_p, min_p, u, trunc = (v[rows] for v in (s.top_k, s.top_p, s.min_p, s.u, s.truncated))
    cum = pc.cumsum(-1)
    keep = _kept(pc, top_k, top_p, min_p)
    closed = (((top_k > 0) & (top_k <= K)) | ((top_p < 1.0) & (cum[:, -1:] >= top_p))
              | ((min_p > 0.0) & (pc[:, -1:] < min_p * pc[:, :1])))  # [n, 1] the kept set ends inside
    cw = (pc * keep).cumsum(-1)
    # truncated: within the kept candidates, renormalised; untruncated: u is a true probability
    j = _search(cw, torch.where(trunc, u * cw[:, -1:], u))  # [n, 1]
    settled = torch.where(trunc, closed, u < cum[:, -1:]) | (K == V)
    return (rows, idx.gather(1, j)[:, 0]), settled[:, 0]


def _kept(pc: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """pc [n, K] probabilities best first -> bool [n, K]: within top-k, before the nucleus
    closed (the token that crosses top_p is kept), at least min_p of the best; the best always."""
    rank = torch.arange(pc.shape[-1], device=pc.device)[None, :]  # [1, K]
    before = pc.cumsum(-1) - pc  # [n, K] mass of the better tokens
    keep = ((top_k == 0) | (rank < top_k)) & ((top_p >= 1.0) | (before < top_p)) & (pc >= min_p * pc[:, :1])
    keep[:, 0] = True
    return keep


def _search(c: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """c [n, N] cumulative weights, target [n, 1] -> [n, 1] the first index whose c exceeds
    target (the first one reaching the total when rounding puts target at the end)."""
    j = torch.searchsorted(c, target.contiguous(), right=True)  # [n, 1]
    last = (c < c[:, -1:]).sum(-1, keepdim=True)  # [n, 1]
    return torch.minimum(j, last)


def _tail(s: _Rows, rows: torch.Tensor, cands: torch.Tensor | None) -> torch.Tensor:
    """Untruncated rows whose u lies past their last tier's mass: the token at u's place in
    the rest of the vocabulary, index order, the last tier's candidates `cands` [n, K] left
    out (None: found again, the same top-k of the same row)."""
    x = s.x[rows]  # [n, V] a copy
    idx = cands if cands is not None else x.topk(min(TIERS[-1], x.shape[1]), dim=-1)[1]  # [n, K]
    head = x.gather(1, idx).sum(-1, keepdim=True)  # [n, 1]: the candidates' probability
    c = x.scatter_(1, idx, 0.0).cumsum_(-1)  # [n, V]
    target = (s.u[rows] - head).clamp_min(0.0)
    return _search(c, torch.minimum(target, c[:, -1:]))[:, 0]


def _sorted(s: _Rows, rows: torch.Tensor) -> torch.Tensor:
    """Truncated rows whose kept set reaches past the last tier: their whole rows sorted."""
    pc, idx = torch.sort(s.x[rows], dim=-1, descending=True)  # [n, V]
    keep = _kept(pc, s.top_k[rows], s.top_p[rows], s.min_p[rows])
    cw = (pc * keep).cumsum(-1)
    return idx.gather(1, _search(cw, s.u[rows] * cw[:, -1:]))[:, 0]
