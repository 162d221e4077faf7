"""A step plan as the worker runs it: its rows as tensors, computed once per step and shared
by every layer, and the step cut into attention micro-batches.

Legend: T = rows (new tokens) of the step, S' = sequences finishing their known tokens this
step, t = rows of one micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moecc_runtime.scheduler.step_plan import SeqChunk, StepPlan


@dataclass
class MicroBatch:
    """Consecutive sequences of a step whose attention runs together."""

    r0: int  # rows r0..r1-1 of the step
    r1: int
    items: list[tuple[int, int, int, int]]  # (sid, local row, start position, n) per sequence
    tables: list[list[int]]
    write_blocks: torch.Tensor  # [t] where each row's K/V goes
    write_offsets: torch.Tensor  # [t]
    index: int = 0  # which micro-batch of the step
    host: bool = False  # attention on the host over the pool in place (worker/host_attention.py)
    #: the micro-batch's attention views, built once per step: (window, device kind) -> its KVView,
    #: ("host", window) -> its host_attention.HostView
    views: dict[tuple[Any, ...], Any] = field(default_factory=dict)


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
            spans.append((len(ids), len(ids) + c.n))
            ids.extend(c.tokens)
            pos.extend(range(c.start, c.start + c.n))
            blk.extend(c.slot_blocks)
            off.extend(c.slot_offsets)
            last.extend(len(ids) - c.n + j for j in c.head_rows(plan.all_rows))
        rows = torch.tensor(last, dtype=torch.long)
        return cls(plan.seqs, len(ids), torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
                   spans, torch.tensor(blk, dtype=torch.long), torch.tensor(off, dtype=torch.long),
                   [c.sid for c in plan.seqs if c.finishes], rows, plan.prefill_tokens, block_size)

    def micro_batches(self, b_a: int, cap_blocks: int | None = None, host_seqs: int = 0) -> list[MicroBatch]:
        """Consecutive groups of at most b_a sequences: the first `host_seqs` sequences' groups
        attend on the host (no KV buffer limit), the others' KV (full context) fits one device
        KV buffer of `cap_blocks` blocks (None: no limit). Device groups come first in the list
        (on a GPU they are launched before the host computes its own)."""
        host_seqs = max(0, min(host_seqs, len(self.seqs)))
        cuts = [(a, z, True) for a, z in self._cuts(b_a, None, 0, host_seqs)]
        cuts = [(a, z, False) for a, z in self._cuts(b_a, cap_blocks, host_seqs, len(self.seqs))] + cuts
        mbs = []
        for j, (a, z, host) in enumerate(cuts):
            r0, r1 = self.spans[a][0], self.spans[z - 1][1]
            items = [(c.sid, self.spans[i][0] - r0, c.start, c.n) for i, c in enumerate(self.seqs[a:z], start=a)]
            mbs.append(MicroBatch(r0, r1, items, [c.block_table for c in self.seqs[a:z]], self.blocks[r0:r1],
                                  self.offsets[r0:r1], j, host=host))
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
