"""Host <-> compute device traffic that could stall the device: host reads of device tensors,
all through one instrumented helper, and small host values sent without a stall.

On CUDA every read of a device tensor by the host (`.tolist()`, `.item()`, `.cpu()`) waits for
the device to drain the stream it was queued on: a sync. The runtime makes those reads only
through `to_host`, named by call site, so a step's syncs can be counted (`HostReads`), on a
CPU as on a GPU, and a new one cannot creep in unseen (tests/runtime/worker/test_syncs.py). The other way, a plain `torch.tensor(values, device=cuda)` or
`.to(cuda)` of pageable memory also waits for the stream (a copy then a stream sync); `to_device`
sends through pinned memory, non-blocking.

Sites that read once per step: "sample" (the step's tokens, and logprobs when asked).
Once per MoE layer: "route" (how many rows each expert got, to skip the unchosen ones).
"""

from __future__ import annotations

import threading
from collections import Counter

import torch

_counts: Counter[str] = Counter()
_lock = threading.Lock()


def to_host(t: torch.Tensor, site: str) -> torch.Tensor:
    """`t` on the host (itself when it already is), counted under `site`."""
    with _lock:
        _counts[site] += 1
    return t if t.device.type == "cpu" else t.cpu()


def to_device(x: torch.Tensor | list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host values (a tensor or a list) on `device` without waiting for it: on CUDA a
    non-blocking copy out of pinned memory (torch's pinned cache keeps the source alive until
    the copy is done); elsewhere the tensor itself."""
    t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda" or t.is_cuda:
        return t
    return t.pin_memory().to(device, non_blocking=True)


def to_list(t: torch.Tensor, site: str) -> list:
    """`t.tolist()` through `to_host`."""
    return to_host(t, site).tolist()


class HostReads:
    """Counts `to_host` calls by site while it is open: `with HostReads() as r: ...; r.counts`."""

    def __enter__(self) -> "HostReads":
        with _lock:
            self._start = Counter(_counts)
        self.counts: Counter[str] = Counter()
        return self

    def __exit__(self, *exc: object) -> None:
        with _lock:
            self.counts = Counter({k: v - self._start.get(k, 0) for k, v in _counts.items()
                                   if v - self._start.get(k, 0) > 0})

    def snapshot(self) -> Counter[str]:
        """The counts so far (while open)."""
        with _lock:
            return Counter({k: v - self._start.get(k, 0) for k, v in _counts.items() if v - self._start.get(k, 0) > 0})
