"""KV block math: a sequence's positions live in fixed-size blocks of the paged KV pool.

The planner sizes the pool in blocks of KV_BLOCK_SIZE tokens and writes that size into
every plan (`batch.kv.block_size`); the runtime's allocator (scheduler/blocks.py) and pool
(memory/kv.py) read it from there.
"""

from __future__ import annotations

#: Tokens per KV block the planner sizes the pool in (the one value every plan carries).
KV_BLOCK_SIZE = 8


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` positions: ceil(tokens / block_size) (0 for none)."""
    return -(-int(tokens) // int(block_size))


def seq_blocks(tokens: int, block_size: int = KV_BLOCK_SIZE) -> int:
    """Blocks one sequence of `tokens` positions may hold at its peak: its blocks plus one
    (the block the next step's position opens before the finished one is given back)."""
    return blocks_for(tokens, block_size) + 1
