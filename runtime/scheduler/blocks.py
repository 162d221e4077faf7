"""KV block ownership: which blocks of the paged KV pool each sequence holds (the scheduler's
side of the pool; the K/V bytes themselves are `memory/kv.py`'s `KVPool`).

Legend: NB = blocks in the pool, bs = block size (positions per block).

A sequence owns a list of blocks (its block table); position p lives in block
table[p // bs] at offset p % bs. Blocks are handed out as a sequence grows and returned
when it finishes, so a sequence wastes at most one partly filled block. Freed blocks are
reused last-in first-out, so the pages a job touches stay as few as its peak use.
"""

from __future__ import annotations

from dataclasses import dataclass


class KVCacheFull(RuntimeError):
    """The pool has too few free blocks for a request; says how many were needed and free."""

    def __init__(self, sid: int, needed: int, free: int, capacity: int):
        self.sid, self.needed, self.free, self.capacity = sid, needed, free, capacity
        super().__init__(
            f"KV cache full: sequence {sid} needs {needed} more block(s) but {free} of {capacity} are free; "
            f"finish or preempt other sequences, or compile with more --host-mem")


@dataclass(frozen=True)
class KVUsage:
    """A snapshot of the pool: blocks handed out and the tokens they hold."""

    blocks_used: int
    blocks_total: int
    tokens_live: int


class BlockAllocator:
    """The block tables of the sequences holding KV in a pool of `num_blocks` blocks."""

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"KV cache needs block_size >= 1 and num_blocks >= 1, got {block_size}, {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: block 0 handed out first
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # positions reserved per sequence

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def needs(self, sid: int, tokens: int) -> int:
        """Blocks `sid` must still take to hold `tokens` positions (<= 0: none)."""
        return self.blocks_for(tokens) - len(self.tables.get(sid, []))

    def reserve(self, sid: int, tokens: int) -> list[int]:
        """Make sequence `sid` hold at least `tokens` positions, taking blocks as needed;
        returns the blocks taken (their contents are stale: the worker zeroes them). All or
        nothing: on KVCacheFull the sequence keeps exactly what it had."""
        need = self.needs(sid, tokens)
        if need > len(self._free):
            raise KVCacheFull(sid, need, len(self._free), self.num_blocks)
        table = self.tables.setdefault(sid, [])
        new = [self._free.pop() for _ in range(need)]
        table.extend(new)
        self.lengths[sid] = max(self.lengths.get(sid, 0), tokens)
        return new

    def release(self, sid: int) -> None:
        """Return every block of `sid` to the pool (no-op for an unknown sequence)."""
        table = self.tables.pop(sid, [])
        self.lengths.pop(sid, None)
        self._free.extend(reversed(table))

    def usage(self) -> KVUsage:
        return KVUsage(self.num_blocks - len(self._free), self.num_blocks, sum(self.lengths.values()))

    def slots(self, sid: int, start: int, n: int) -> tuple[list[int], list[int]]:
        """Physical (block, offset) of positions start..start+n-1 of `sid` (already reserved)."""
        table, bs = self.tables[sid], self.block_size
        if start + n > len(table) * bs:
            raise IndexError(f"sequence {sid}: positions up to {start + n} not reserved "
                             f"({len(table)} blocks of {bs})")
        return ([table[p // bs] for p in range(start, start + n)], [p % bs for p in range(start, start + n)])
