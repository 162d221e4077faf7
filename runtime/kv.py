"""Paged host KV cache: K and V of every sequence in fixed-size blocks from one pool.

Legend: L = layers, Hkv = key/value heads, NB = blocks in the pool, bs = block size
(positions per block), D = head dim, n = positions written in one call.

A sequence owns a list of blocks (its block table); position p lives in block
table[p // bs] at offset p % bs. Blocks are handed out as a sequence grows and returned
when it finishes, so a sequence wastes at most one partly filled block. The pool is one
tensor per K and V, [L, Hkv, NB, bs, D], laid out so that gathering a micro-batch's
blocks for one layer is one index_select along the block axis, and the blocks of one
sequence, gathered in table order, read as one [Hkv, positions, D] run. Freed blocks are
reused last-in first-out, so the pages a job touches stay as few as its peak use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCacheFull(RuntimeError):
    """The pool has too few free blocks for a request; says how many were needed and free."""

    def __init__(self, sid: int, needed: int, free: int, capacity: int):
        self.sid, self.needed, self.free, self.capacity = sid, needed, free, capacity
        super().__init__(
            f"KV cache full: sequence {sid} needs {needed} more block(s) but {free} of {capacity} are free; "
            f"finish or preempt other sequences, or compile with more --host-mem")


@dataclass
class KVUsage:
    """A snapshot of the pool: blocks handed out and the tokens they hold."""

    blocks_used: int
    blocks_total: int
    tokens_live: int
    bytes_per_block: int
    bytes_per_token: int

    @property
    def allocated_bytes(self) -> int:
        return self.blocks_used * self.bytes_per_block

    @property
    def live_bytes(self) -> int:
        return self.tokens_live * self.bytes_per_token


class PagedKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, block_size: int,
                 num_blocks: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 v_head_dim: int | None = None):
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"KV cache needs block_size >= 1 and num_blocks >= 1, got {block_size}, {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
        dv = head_dim if v_head_dim is None else v_head_dim  # 0 for latent attention: K holds it all
        # torch.empty: pages are committed only when first written, so an idle pool costs address space only
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, Hkv, NB, bs, D]
        self.v = torch.empty(shape[:-1] + (dv,), dtype=dtype, device=device)  # [L, Hkv, NB, bs, Dv]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: block 0 handed out first
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # positions reserved per sequence
        elem = self.k.element_size()
        self.bytes_per_token = num_layers * num_kv_heads * (head_dim + dv) * elem
        self.bytes_per_block = self.bytes_per_token * block_size

    # -- allocation ---------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def reserve(self, sid: int, tokens: int) -> None:
        """Make sequence `sid` hold at least `tokens` positions, taking blocks as needed.
        All or nothing: on KVCacheFull the sequence keeps exactly what it had. New blocks
        are zeroed, so the unwritten tail of a last block (read, masked, by attention)
        never holds stale NaN or Inf."""
        table = self.tables.get(sid, [])
        need = self.blocks_for(tokens) - len(table)
        if need > len(self._free):
            raise KVCacheFull(sid, need, len(self._free), self.num_blocks)
        self.tables[sid] = table
        if need > 0:
            new = [self._free.pop() for _ in range(need)]
            table.extend(new)
            idx = torch.tensor(new, dtype=torch.long, device=self.k.device)
            self.k.index_fill_(2, idx, 0)  # [L, Hkv, NB, bs, D]: the new blocks, every layer
            self.v.index_fill_(2, idx, 0)
        self.lengths[sid] = max(self.lengths.get(sid, 0), tokens)

    def release(self, sid: int) -> None:
        """Return every block of `sid` to the pool (no-op for an unknown sequence)."""
        table = self.tables.pop(sid, [])
        self.lengths.pop(sid, None)
        self._free.extend(reversed(table))

    def usage(self) -> KVUsage:
        return KVUsage(self.num_blocks - len(self._free), self.num_blocks, sum(self.lengths.values()),
                       self.bytes_per_block, self.bytes_per_token)

    # -- addressing ---------------------------------------------------------------------------
    def slots(self, sid: int, start: int, n: int) -> tuple[list[int], list[int]]:
        """Physical (block, offset) of positions start..start+n-1 of `sid` (already reserved)."""
        table, bs = self.tables[sid], self.block_size
        if start + n > len(table) * bs:
            raise IndexError(f"sequence {sid}: positions up to {start + n} not reserved "
                             f"({len(table)} blocks of {bs})")
        return ([table[p // bs] for p in range(start, start + n)], [p % bs for p in range(start, start + n)])

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store K/V of n positions. blocks/offsets: [n] (on the pool's device); k/v: [n, Hkv, D]."""
        self.k[layer][:, blocks, offsets] = k.transpose(0, 1).to(self.k.dtype)  # [Hkv, n, D]
        self.v[layer][:, blocks, offsets] = v.transpose(0, 1).to(self.v.dtype)

    def gather(self, layer: int, blocks: torch.Tensor, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
        """Copy the listed blocks of one layer into out_k/out_v: [Hkv, len(blocks), bs, D]
        (contiguous). One index_select per head along its leading block axis: 1.5x the
        bandwidth of one call along the middle axis on this CPU."""
        for h in range(self.k.shape[1]):
            torch.index_select(self.k[layer, h], 0, blocks, out=out_k[h])  # [nb, bs, D]
            torch.index_select(self.v[layer, h], 0, blocks, out=out_v[h])
