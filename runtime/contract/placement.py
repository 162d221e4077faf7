"""Where a tensor goes in the device arena, and how many bytes it takes there.

Every tensor carved from the arena (resident weights, weight slots, KV buffers, staging)
starts at an ALIGN-byte boundary, so a slot's bytes are each stored tensor's bytes rounded
up to ALIGN. The planner sizes slots with `placed_bytes` (moecc/planner/costs.py) and the
runtime places weights with it (memory/streaming.py); a slot the planner sized therefore
holds exactly what the runtime puts there.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Byte alignment of every tensor carved from the device arena.
ALIGN = 256


def align(nbytes: int) -> int:
    """`nbytes` rounded up to ALIGN."""
    return -(-int(nbytes) // ALIGN) * ALIGN


def placed_bytes(stored_nbytes: Iterable[int]) -> int:
    """Arena bytes one weight takes in a slot: each of its stored tensors (the data part and,
    for a quantized format, its scales and the rest) at ALIGN."""
    return sum(align(n) for n in stored_nbytes)


def dense_placed_bytes(numel: int, stored_itemsize: int, compute_itemsize: int) -> int:
    """Arena bytes of a dense weight: its elements in the wider of its file dtype and the
    compute dtype (one stored in another dtype is cast to the compute dtype when read), at ALIGN."""
    return align(int(numel) * max(int(stored_itemsize), int(compute_itemsize)))
