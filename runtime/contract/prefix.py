"""The shared-prefix walk: how full KV blocks of a prompt are keyed, and which of them a
new sequence may take from blocks computed before.

A prompt of L tokens is cut into blocks of bs tokens. Only full blocks strictly before its
last token are shareable (the last token is always computed: it yields the logits), so a
prompt offers blocks 0 .. (L - 1) // bs - 1. Block i is keyed by value: (the id of block
i - 1's registered content, or ROOT for block 0; block i's bs tokens), so two blocks match
only when their whole prefixes are equal. A sequence takes the longest chain of known
blocks from block 0; the first block not known ends it.

The runtime's allocator (scheduler/blocks.py) registers every computed full block under these
keys (a prompt's last full block too: a later, longer prompt may take it); the planner's counter
(moecc/planner/shared_prefix.py) walks a job's prompts with the same keys and registers the
same blocks, every block seen assumed still cached (an upper bound on the runtime's reuse).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

#: a block's key: (the id of the block before it, or ROOT; its tokens)
BlockKey = tuple[int, tuple[int, ...]]
#: the parent id of a prompt's first block
ROOT = -1

T = TypeVar("T")


def shareable_blocks(tokens: int, block_size: int) -> int:
    """Full blocks of a `tokens`-token prompt before its last token (0 for an empty one)."""
    return (int(tokens) - 1) // block_size if tokens > 0 else 0


def block_key(parent: int, tokens: Sequence[int], i: int, block_size: int) -> BlockKey:
    """The key of block `i` of `tokens`, whose previous block's id is `parent` (ROOT for i = 0)."""
    return parent, tuple(tokens[i * block_size:(i + 1) * block_size])


def walk(tokens: Sequence[int], block_size: int, find: Callable[[BlockKey], T | None],
         id_of: Callable[[T], int]) -> list[T]:
    """needs: `find` (a key -> what is registered under it, or None) and `id_of` (that -> its
    id, the parent id of the next key). does: walk `tokens`' shareable blocks from block 0.
    guarantees: what `find` gave for the longest chain of leading blocks it knows, in order."""
    found: list[T] = []
    parent = ROOT
    for i in range(shareable_blocks(len(tokens), block_size)):
        hit = find(block_key(parent, tokens, i, block_size))
        if hit is None:
            break
        found.append(hit)
        parent = id_of(hit)
    return found
