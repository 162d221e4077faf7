"""A job's shared-prefix share: the prompt tokens whose KV the runtime's prefix sharing
computes once (pure Python; no solver, no torch).

The runtime splits a prompt into full KV blocks of `block_size` tokens, each keyed by value
as the contract says (moecc_runtime/contract/prefix.py: the id of its parent block's
content, its tokens); a request whose leading full blocks an earlier request already
computed skips computing them. Only full blocks strictly before the prompt's last token
are shared: a prompt of L tokens offers blocks 0 .. (L - 1) // bs - 1, and reuses the
longest chain of them, from block 0, already seen in the job. This counter walks with the
runtime's own walk and keys (`walk`, `block_key`).

`shared_prefix` walks the prompts in file order and assumes every block seen stays cached:
an upper bound on what the runtime reuses (its KV pool evicts; requests in flight together
may both compute a block neither had finished).

The block size is the plan's (`plan["batch"]["kv"]["block_size"]`); at compile, before the
plan exists, the planner's own: `KV_BLOCK_SIZE` of moecc_runtime/contract/blocks.py, the one value
solve_batch_sizes writes into every plan (moecc/planner/solve.py: KV_BLOCK), not a choice
per candidate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from moecc_runtime.contract.blocks import KV_BLOCK_SIZE
from moecc_runtime.contract.prefix import ROOT, BlockKey, block_key, walk

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
        # every block seen: hash of its key -> its id (the next key's parent); the hash, not the
        # key, so a job of millions of blocks is counted in little memory
        self._ids: dict[int, int] = {}

    def _find(self, key: BlockKey) -> int | None:
        return self._ids.get(hash(key))

    def add(self, ids: Sequence[int]) -> int:
        """Count one prompt; returns the tokens it reuses."""
        bs, ids = self.block_size, tuple(ids)
        self.requests += 1
        self.prompt_tokens += len(ids)
        found = walk(ids, bs, self._find, int)
        reused = len(found) * bs
        parent = found[-1] if found else ROOT
        for b in range(len(found), len(ids) // bs):  # after the chain: every full block, seen from now on (the runtime registers the last full one too)
            parent = self._ids.setdefault(hash(block_key(parent, ids, b, bs)), len(self._ids))
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
