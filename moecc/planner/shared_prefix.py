"""A job's shared-prefix share: the prompt tokens whose KV the runtime's prefix sharing
computes once (pure Python; no solver, no torch).

The runtime splits a prompt into full KV blocks of `block_size` tokens, each block named by
the hash of (its parent block's hash, its tokens); a request whose leading full blocks an
earlier request already computed skips computing them. Only full blocks strictly before
the prompt's last token are shared (the last token is always computed, so the block that
holds position L - 1 never is): a prompt of L tokens offers blocks 0 .. (L - 1) // bs - 1,
and reuses the longest chain of them, from block 0, already seen in the job.

`shared_prefix` walks the prompts in file order and assumes every block seen stays cached:
an upper bound on what the runtime reuses (its KV pool evicts; requests in flight together
may both compute a block neither had finished).

The block size is the plan's (`plan["batch"]["kv"]["block_size"]`); at compile, before the
plan exists, the planner's own: `KV_BLOCK_SIZE` of runtime/plan_schema.py, the one value
solve_batch_sizes writes into every plan (moecc/planner/solve.py: KV_BLOCK), not a choice
per candidate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from moecc_runtime.plan_schema import KV_BLOCK_SIZE

UPPER_BOUND_NOTE = ("upper bound: prompts in file order, every block seen assumed still cached "
                    "(the runtime's KV pool evicts, and requests in flight together may both compute a block)")


@dataclass
class PrefixCounter:
    """Feed prompts in job order (`add`); counts prompt tokens and the tokens a prompt's
    leading full blocks (before its last token) reuse from earlier prompts."""

    block_size: int = KV_BLOCK_SIZE
    prompt_tokens: int = 0
    shared_tokens: int = 0
    requests: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, not {self.block_size}")
        self._seen: set[int] = set()

    def add(self, ids: Sequence[int]) -> int:
        """Count one prompt; returns the tokens it reuses."""
        bs, seen = self.block_size, self._seen
        ids = tuple(ids)
        n = len(ids)
        self.requests += 1
        self.prompt_tokens += n
        shareable = (n - 1) // bs if n > 0 else 0
        parent, reused, chained = 0, 0, True
        for b in range(shareable):
            key = hash((parent, ids[b * bs:(b + 1) * bs]))
            if chained and key in seen:
                reused += bs
            else:
                chained = False  # a block's chain includes every block before it: no later one matches
                seen.add(key)
            parent = key
        self.shared_tokens += reused
        return reused

    @property
    def unique_tokens(self) -> int:
        """Prompt tokens computed (not reused)."""
        return self.prompt_tokens - self.shared_tokens

    @property
    def share(self) -> float:
        """Reused tokens / prompt tokens (0 for no tokens), in [0, 1)."""
        return self.shared_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def shared_prefix(prompts: Iterable[Sequence[int]], block_size: int = KV_BLOCK_SIZE) -> PrefixCounter:
    """The counts of a job's prompt ids in order (PrefixCounter: share, shared_tokens,
    prompt_tokens, unique_tokens)."""
    c = PrefixCounter(block_size)
    for ids in prompts:
        c.add(ids)
    return c
