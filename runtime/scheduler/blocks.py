"""KV block ownership: which blocks of the paged KV pool each sequence holds (the scheduler's
side of the pool; the K/V bytes themselves are `memory/kv.py`'s `KVPool`), which blocks
several sequences share, and which finished prefixes stay cached for later requests.

Legend: NB = blocks in the pool, bs = block size (positions per block).

A sequence owns a list of blocks (its block table); position p lives in block
table[p // bs] at offset p % bs. Blocks are handed out as a sequence grows and given back
when it finishes, so a sequence wastes at most one partly filled block.

Sharing, by reference counts:
  * prefixes: a full block whose positions are all computed is registered under its content,
    the key of contract/prefix.py (the uid of the block before it, its bs tokens); keys
    compare by value, so two blocks match only when their whole prefixes are equal. A new sequence takes the longest
    chain of registered blocks that covers its tokens before the last one (`match`): those
    positions are not computed again, and the last token always is (it yields the logits).
  * forks (n completions of one prompt): a child takes its parent's table, every block
    referenced once more (`fork`). Before a sequence writes into a block another one holds,
    it gets a copy of its own (`writable`: copy on write; the worker copies the bytes).
A block nobody holds any more goes back to the free list, or, when registered, to the
cached list: still matchable, and handed out again (forgetting its content) only when the
free list is empty, least recently released first. Free blocks are reused last-in first-out,
so the pages a job touches stay as few as its peak use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from moecc_runtime.contract.blocks import blocks_for
from moecc_runtime.contract.prefix import ROOT, BlockKey, block_key, walk


class Prefix(NamedTuple):
    """A probe's find: the registered blocks covering a sequence's leading tokens, and their uids."""

    blocks: list[int]
    chain: list[int]


NO_PREFIX = Prefix([], [])


class KVCacheFull(RuntimeError):
    """The pool has too few free blocks for a request; says how many were needed and free."""

    def __init__(self, sid: int, needed: int, free: int, capacity: int):
        self.sid, self.needed, self.free, self.capacity = sid, needed, free, capacity
        super().__init__(
            f"KV cache full: sequence {sid} needs {needed} more block(s) but {free} of {capacity} are free; "
            f"finish or preempt other sequences, or compile with more --host-mem")


@dataclass(frozen=True)
class KVUsage:
    """A snapshot of the pool: blocks held by sequences, the tokens they hold, and the blocks
    kept only as cached prefixes (reusable; handed out when the free list runs dry)."""

    blocks_used: int
    blocks_total: int
    tokens_live: int
    blocks_cached: int = 0


class BlockAllocator:
    """The block tables of the sequences holding KV in a pool of `num_blocks` blocks, with
    prefix sharing when `share_prefixes` (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, share_prefixes: bool = True):
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"KV cache needs block_size >= 1 and num_blocks >= 1, got {block_size}, {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.share_prefixes = share_prefixes
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: block 0 handed out first
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered, held by none; oldest first
        self._refs = [0] * num_blocks
        self._by_key: dict[BlockKey, int] = {}  # registered content -> block
        self._key: dict[int, BlockKey] = {}  # block -> its registered content
        self._uid: dict[int, int] = {}  # block -> the uid its children's keys name
        self._next_uid = 0
        self._chains: dict[int, list[int]] = {}  # sid -> uids of its leading registered blocks
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # positions reserved per sequence
        self.reused_tokens = 0  # positions `match` found computed (not computed again), since creation

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` positions (contract/blocks.py)."""
        return blocks_for(tokens, self.block_size)

    @property
    def free_blocks(self) -> int:
        """Blocks that can be handed out: free ones and cached prefixes no sequence holds."""
        return len(self._free) + len(self._cached)

    # -- ownership -------------------------------------------------------------------------
    def needs(self, sid: int, tokens: int, start: int | None = None) -> int:
        """Blocks `sid` must still take to hold `tokens` positions (<= 0: none), counting, with
        `start`, the copies it needs to write positions start.. (blocks it shares)."""
        return self.blocks_for(tokens) - len(self.tables.get(sid, [])) + len(self._shared_from(sid, start))

    def reserve(self, sid: int, tokens: int) -> list[int]:
        """Make sequence `sid` hold at least `tokens` positions, taking blocks as needed;
        returns the blocks taken (their contents are stale: the worker zeroes them). All or
        nothing: on KVCacheFull the sequence keeps exactly what it had."""
        need = self.needs(sid, tokens)
        if need > self.free_blocks:
            raise KVCacheFull(sid, need, self.free_blocks, self.num_blocks)
        table = self.tables.setdefault(sid, [])
        new = [self._take() for _ in range(need)]
        table.extend(new)
        self.lengths[sid] = max(self.lengths.get(sid, 0), tokens)
        return new

    def extend_in_place(self, sid: int, pos: int) -> bool:
        """The decode fast path of needs + writable + reserve for one position: when `pos`
        lies in `sid`'s last block and no other sequence holds that block, mark it reserved
        and return True (no block taken, nothing to copy: what the general path would do);
        else False, nothing changed."""
        table = self.tables.get(sid)
        if not table or len(table) != pos // self.block_size + 1 or self._refs[table[-1]] != 1:
            return False
        if self.lengths[sid] <= pos:
            self.lengths[sid] = pos + 1
        return True

    def writable(self, sid: int, start: int) -> list[tuple[int, int]]:
        """Give `sid` blocks of its own for positions start.. where it shares them (copy on
        write); returns the (source, destination) copies the worker must make before the
        step writes. Raises KVCacheFull (changing nothing) when the pool has too few blocks."""
        shared = self._shared_from(sid, start)
        if not shared:
            return []
        if len(shared) > self.free_blocks:
            raise KVCacheFull(sid, len(shared), self.free_blocks, self.num_blocks)
        table, copies = self.tables[sid], []
        for i in shared:
            src, dst = table[i], self._take()
            self._drop(src)
            table[i] = dst
            copies.append((src, dst))
        return copies

    def fork(self, parent: int, child: int) -> None:
        """`child` holds every block of `parent` (one reference more each) and its prefix chain."""
        table = list(self.tables.get(parent, []))
        for b in table:
            self._refs[b] += 1
        self.tables[child] = table
        self.lengths[child] = self.lengths.get(parent, 0)
        self._chains[child] = list(self._chains.get(parent, []))

    def release(self, sid: int) -> None:
        """Give back every block of `sid` (no-op for an unknown sequence); its registered
        blocks stay cached, the deepest ones first in line to be handed out again."""
        for b in reversed(self.tables.pop(sid, [])):
            self._drop(b)
        self.lengths.pop(sid, None)
        self._chains.pop(sid, None)

    # -- prefix sharing ----------------------------------------------------------------------
    def probe(self, tokens: Sequence[int]) -> Prefix:
        """The registered blocks `match` would give a sequence of `tokens` (changes nothing)."""
        chain: list[int] = []
        return Prefix(self._walk(tokens, chain) if self.share_prefixes else [], chain)

    def match(self, sid: int, hit: Prefix) -> int:
        """needs: `sid` holds no blocks, `hit` probed just now (nothing changed since). does:
        give `sid` the blocks of `hit`, the longest registered chain covering its tokens before
        the last one. guarantees: returns the positions they cover (a multiple of bs, < the
        tokens'): computed already, not to be computed again."""
        if self.tables.get(sid):
            raise ValueError(f"sequence {sid} already holds blocks; match only a new sequence")
        for b in hit.blocks:
            if self._refs[b] == 0:
                del self._cached[b]
            self._refs[b] += 1
        self.tables[sid], self._chains[sid] = list(hit.blocks), list(hit.chain)
        self.lengths[sid] = len(hit.blocks) * self.block_size
        self.reused_tokens += len(hit.blocks) * self.block_size
        return len(hit.blocks) * self.block_size

    def register(self, sid: int, tokens: list[int], computed: int) -> None:
        """`sid`'s positions < `computed` hold K/V of `tokens`: register its full blocks among
        them (a block whose content another block holds already stays unregistered; the chain
        goes on through that one)."""
        if not self.share_prefixes:
            return
        table, chain, bs = self.tables[sid], self._chains.setdefault(sid, []), self.block_size
        while len(chain) < min(computed // bs, len(table)):
            i = len(chain)
            key = block_key(chain[-1] if chain else ROOT, tokens, i, bs)
            b = self._by_key.get(key)
            if b is None:
                b = table[i]
                if b in self._key:  # registered under another content: cannot happen for a written block
                    break
                self._by_key[key], self._key[b], self._uid[b] = b, key, self._next_uid
                self._next_uid += 1
            chain.append(self._uid[b])

    def usage(self) -> KVUsage:
        held = self.num_blocks - len(self._free) - len(self._cached)
        return KVUsage(held, self.num_blocks, sum(self.lengths.values()), len(self._cached))

    def slots(self, sid: int, start: int, n: int) -> tuple[list[int], list[int]]:
        """Physical (block, offset) of positions start..start+n-1 of `sid` (already reserved)."""
        table, bs = self.tables[sid], self.block_size
        if start + n > len(table) * bs:
            raise IndexError(f"sequence {sid}: positions up to {start + n} not reserved "
                             f"({len(table)} blocks of {bs})")
        if n == 1:  # a decode position (most calls)
            return [table[start // bs]], [start % bs]
        return ([table[p // bs] for p in range(start, start + n)], [p % bs for p in range(start, start + n)])

    # -- checks ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert every bookkeeping invariant (for tests and debugging; O(NB + table sizes)).
        guarantees: returns only when reference counts equal the tables' listings, every block
        is exactly one of free, cached or held, cached blocks are registered and free ones are
        not, the key maps are each other's inverse, and each sequence's table and chain fit its
        length. Raises AssertionError naming the broken invariant otherwise."""
        count = [0] * self.num_blocks
        for table in self.tables.values():
            for b in table:
                count[b] += 1
        bad = [b for b in range(self.num_blocks) if count[b] != self._refs[b]]
        assert not bad, f"BlockAllocator: reference counts differ from the tables at blocks {bad[:8]}"
        free, cached, held = set(self._free), set(self._cached), {b for b, c in enumerate(count) if c}
        assert len(free) == len(self._free), f"BlockAllocator: the free list holds a block twice: {self._free}"
        overlap = (free & cached) | (free & held) | (cached & held)
        assert not overlap, f"BlockAllocator: blocks {sorted(overlap)[:8]} are in two of free, cached, held"
        assert free | cached | held == set(range(self.num_blocks)), (
            f"BlockAllocator: blocks {sorted(set(range(self.num_blocks)) - free - cached - held)[:8]} are lost")
        assert cached <= self._key.keys(), f"BlockAllocator: cached blocks {sorted(cached - self._key.keys())[:8]} are unregistered"
        assert not free & self._key.keys(), f"BlockAllocator: free blocks {sorted(free & self._key.keys())[:8]} are registered"
        assert {b: k for k, b in self._by_key.items()} == self._key, "BlockAllocator: the key maps are not each other's inverse"
        assert self._uid.keys() == self._key.keys() and len(set(self._uid.values())) == len(self._uid), (
            "BlockAllocator: uids are not one per registered block")
        assert self.tables.keys() == self.lengths.keys(), "BlockAllocator: sequences with a table and without a length"
        for sid, table in self.tables.items():
            assert len(table) == self.blocks_for(self.lengths[sid]), (
                f"BlockAllocator: sequence {sid} holds {len(table)} blocks for {self.lengths[sid]} positions")
            assert len(self._chains.get(sid, [])) <= len(table), f"BlockAllocator: sequence {sid}'s chain outruns its table"
        assert self._chains.keys() <= self.tables.keys(), "BlockAllocator: a chain of a sequence holding no table"

    # -- internals ---------------------------------------------------------------------------
    def _walk(self, tokens: Sequence[int], chain: list[int]) -> list[int]:
        """The registered blocks of `tokens`' leading full blocks before its last token (the
        contract's walk: contract/prefix.py), their uids appended to `chain`."""
        found = walk(tokens, self.block_size, self._by_key.get, self._uid.__getitem__)
        chain.extend(self._uid[b] for b in found)
        return found

    def _shared_from(self, sid: int, start: int | None) -> list[int]:
        """Table indexes of `sid`'s blocks at positions start.. that another sequence holds too."""
        if start is None:
            return []
        table = self.tables.get(sid, [])
        return [i for i in range(start // self.block_size, len(table)) if self._refs[table[i]] > 1]

    def _take(self) -> int:
        """A block for a new owner: a free one, else the least recently released cached one
        (its registration forgotten)."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._cached.popitem(last=False)
            del self._by_key[self._key.pop(b)]
            del self._uid[b]
        self._refs[b] = 1
        return b

    def _drop(self, b: int) -> None:
        """One reference to `b` fewer; at none it is cached (registered) or free."""
        self._refs[b] -= 1
        if self._refs[b] == 0:
            if b in self._key:
                self._cached[b] = None
            else:
                self._free.append(b)
