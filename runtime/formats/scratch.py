"""Reused destinations for weights dequantized per use on the host: `ring(owner).out(entry,
dtype, device)` hands out a buffer for `formats.materialize(..., out=)`, the same few again and
again, so a step's expert weights cost one pass over their codes and no allocation (a fresh
multi-megabyte tensor is mapped and faulted in page by page at every use: 2-4x the dequantize
itself in a microbenchmark of a [1536, 512] expert weight).

A ring holds DEPTH buffers per (element count, dtype) and hands them out in turn: a weight so
made is valid until DEPTH more of its size have been asked for, so a caller may hold at most
DEPTH such weights at once (an expert's gate, up and down: three). Only on the CPU: a GPU's
dequantized weights stay the caching allocator's, as the planner's device bytes count them.

Needs: an owner object (the weights' server; the ring lives as long as it). Does: hand out
buffers. Guarantees: a dense tensor of the weight's element count in `dtype`, or None off the CPU.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

DEPTH = 4  # buffers per size: more than any expert's quantized weights


class Ring:
    """DEPTH reused buffers per (element count, dtype), handed out in turn."""

    def __init__(self, depth: int = DEPTH):
        self.depth = depth
        self._bufs: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._turn: dict[tuple[int, torch.dtype], int] = {}

    def out(self, entry: dict[str, Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The next buffer for weight `entry` in `dtype` (None unless `device` is the CPU)."""
        if device.type != "cpu":
            return None
        key = (math.prod(int(d) for d in (entry.get("logical_shape") or entry["shape"])), dtype)
        bufs = self._bufs.setdefault(key, [])
        i = self._turn.get(key, 0)
        self._turn[key] = (i + 1) % self.depth
        if i == len(bufs):
            bufs.append(torch.empty(key[0], dtype=dtype))
        return bufs[i]


_RINGS: weakref.WeakKeyDictionary[Any, Ring] = weakref.WeakKeyDictionary()


def ring(owner: Any) -> Ring:
    """The ring of `owner` (made at its first use, dropped with it)."""
    r = _RINGS.get(owner)
    if r is None:
        r = _RINGS[owner] = Ring()
    return r
