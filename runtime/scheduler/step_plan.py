"""The step plan: what the scheduler hands the worker for one step, as plain data.

A step runs, for each sequence in it, a chunk of its not-yet-cached tokens (a prompt chunk
being prefilled, or the one token it decodes). Every position a chunk writes is already
reserved in the sequence's block table, and the blocks reserved for this step are listed so
the worker zeroes them before anything reads them; blocks a sequence shared and now writes
into are listed as copies (source, destination), made after the zeroing, before the step. The worker returns, for the sequences
whose known tokens are all cached after the step, their next-token logits.

Legend: S' = sequences finishing their known tokens this step, T = rows of the step, V =
vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from moecc_runtime.scheduler.blocks import KVUsage


class SeqChunk(NamedTuple):
    """One sequence's share of a step: `tokens` at positions start..start+len(tokens)-1. (A named
    tuple: immutable as a frozen dataclass, built in a quarter of its time; a step makes one a
    sequence.)"""

    sid: int
    tokens: list[int]
    start: int  # positions already cached before this step
    block_table: list[int]  # the sequence's blocks, covering at least start + len(tokens)
    slot_blocks: list[int]  # per token: the block its K/V goes to
    slot_offsets: list[int]  # per token: the offset in that block
    prefill: bool  # counts as prompt work (a chunk of several tokens, or inside the prompt)
    finishes: bool  # its known tokens are all cached after this step: its last row reaches the head
    score: bool = False  # every row reaches the head (its prompt tokens' logprobs are asked)

    @property
    def n(self) -> int:
        return len(self.tokens)

    def head_rows(self, all_rows: bool = False) -> range:
        """Offsets of this chunk's rows that reach the head (whose logits the step returns):
        every row when scoring (or `all_rows`), the last one when it finishes, else none."""
        n = len(self.tokens)
        if self.score or all_rows:
            return range(n)
        return range(n - 1, n) if self.finishes else range(0)


@dataclass(frozen=True)
class StepPlan:
    """One step: its chunks in row order, the phase whose sizes it runs with, the blocks
    reserved for it (zeroed before it runs) and the pool's use once they are."""

    seqs: list[SeqChunk]
    phase: str  # "prefill" (mostly prompt tokens) or "decode"
    new_blocks: list[int]
    kv: KVUsage
    all_rows: bool = False  # every row reaches the head (scoring text), not only finishing ones
    copies: tuple[tuple[int, int], ...] = ()  # (source, destination) blocks copied before the step (copy on write)

    @property
    def tokens(self) -> int:
        return sum(c.n for c in self.seqs)

    @property
    def prefill_tokens(self) -> int:
        return sum(c.n for c in self.seqs if c.prefill)


@dataclass(frozen=True)
class StepOutput:
    """What the worker computed: the logits of the rows that reach the head, in row order: each
    finishing chunk's last row and every row of a scoring chunk (`score`), [R, V]; with
    `all_rows` those of every row, [T, V]. `raw` in the model's dtype, `logits` the same in fp32
    (widened once, when first asked: a greedy step reads `raw` alone)."""

    finished: list[int]  # sids
    raw: torch.Tensor

    @cached_property
    def logits(self) -> torch.Tensor:
        return self.raw.float()
