"""A step plan as the worker runs it: its rows as tensors, computed once per step and shared
by every layer, and the step cut into attention micro-batches.

Legend: T = rows (new tokens) of the step, S' = sequences finishing their known tokens this
step, t = rows of one micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

from moecc_runtime.scheduler.step_plan import SeqChunk, StepPlan

if TYPE_CHECKING:  # the registry imports this module
    from moecc_runtime.worker.attention_backends import Where

V = TypeVar("V")


class ViewCache:
    """A micro-batch's attention views (index tensors), built once per step and shared by
    every layer: one per view type, sliding window and device kind."""

    def __init__(self) -> None:
        self._views: dict[tuple[type, int | None, str], object] = {}

    def get(self, kind: type[V], window: int | None, device: str, build: Callable[[], V]) -> V:
        """The `kind` view for `window` (None: full) on `device` ("cpu", "cuda"), built by
        `build` the first time it is asked for."""
        key = (kind, window, device)
        view = self._views.get(key)
        if isinstance(view, kind):
            return view
        made = build()
        self._views[key] = made
        return made


@dataclass
class MicroBatch:
    """Consecutive sequences of a step whose attention runs together, on one backend."""

    r0: int  # rows r0..r1-1 of the step
    r1: int
    items: list[tuple[int, int, int, int]]  # (sid, local row, start position, n) per sequence
    tables: list[list[int]]
    write_blocks: torch.Tensor  # [t] where each row's K/V goes
    write_offsets: torch.Tensor  # [t]
    where: Where  # its attention backend (worker/attention_backends.py)
    index: int = 0  # which micro-batch of the step
    views: ViewCache = field(default_factory=ViewCache)


@dataclass
class StepBatch:
    """A step plan's rows as tensors."""

    seqs: list[SeqChunk]
    T: int
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    spans: list[tuple[int, int]]  # each sequence's rows
    blocks: torch.Tensor  # [T] KV block of each row
    offsets: torch.Tensor  # [T] offset in that block
    finishing: list[int]  # sids whose tokens are all cached after this step
    last_rows: torch.Tensor  # [R] rows reaching the head: finishing chunks' last, scoring chunks' all; every row with all_rows
    prefill_tokens: int
    block_size: int

    @classmethod
    def build(cls, plan: StepPlan, block_size: int) -> "StepBatch":
        ids: list[int] = []
        pos: list[int] = []
        blk: list[int] = []
        off: list[int] = []
        spans: list[tuple[int, int]] = []
        last: list[int] = []
        for c in plan.seqs:
            r0, n = len(ids), len(c.tokens)
            spans.append((r0, r0 + n))
            ids.extend(c.tokens)
            pos.extend(range(c.start, c.start + n))
            blk.extend(c.slot_blocks)
            off.extend(c.slot_offsets)
            heads = c.head_rows(plan.all_rows)
            last.extend(range(r0 + heads.start, r0 + heads.stop))
        rows = torch.tensor(last, dtype=torch.long)
        return cls(plan.seqs, len(ids), torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
                   spans, torch.tensor(blk, dtype=torch.long), torch.tensor(off, dtype=torch.long),
                   [c.sid for c in plan.seqs if c.finishes], rows, plan.prefill_tokens, block_size)

    def micro_batches(self, b_a: int, parts: Sequence[tuple[Where, int, int, int | None]]) -> list[MicroBatch]:
        """Each part (backend, first sequence, end sequence, KV block cap) cut into groups of at
        most b_a consecutive sequences whose KV (full context) fits the cap (None: no limit),
        parts in order; a micro-batch's index is its place in the list
        (attention_backends.place says which parts a placement makes)."""
        cuts = [(a, z, where) for where, first, end, cap in parts for a, z in self._cuts(b_a, cap, first, end)]
        mbs = []
        for j, (a, z, where) in enumerate(cuts):
            r0, r1 = self.spans[a][0], self.spans[z - 1][1]
            items = [(c.sid, self.spans[i][0] - r0, c.start, c.n) for i, c in enumerate(self.seqs[a:z], start=a)]
            mbs.append(MicroBatch(r0, r1, items, [c.block_table for c in self.seqs[a:z]], self.blocks[r0:r1],
                                  self.offsets[r0:r1], where, j))
        return mbs

    def _cuts(self, b_a: int, cap_blocks: int | None, first: int, end: int) -> list[tuple[int, int]]:
        """(first, end) sequence index of each micro-batch of sequences first..end-1."""
        bs = self.block_size
        cuts, a = [], first
        while a < end:
            z, used = a, 0
            while z < end and z - a < b_a:
                c = self.seqs[z]
                need = -(-(c.start + c.n) // bs)
                if cap_blocks is not None and used + need > cap_blocks:
                    if z == a:
                        raise ValueError(f"sequence {c.sid} needs {need} KV blocks but one device KV buffer "
                                         f"holds {cap_blocks}; the plan's arena is too small for it")
                    break
                used += need
                z += 1
            cuts.append((a, z))
            a = z
        return cuts
