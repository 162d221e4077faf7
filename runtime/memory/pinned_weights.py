"""The streamed weights in page-locked host memory, so each streamed tensor is one DMA into
its slot (memory/weight_path.py chooses the path; this module takes it).

  * "registered-mmap": per checkpoint file, the byte range holding its streamed tensors is
    pre-faulted (MADV_POPULATE_READ, else a read per page) and registered read-only in place
    (pinned.register_range with READ_ONLY, in pieces cut at tensor boundaries). The mapping is
    the WeightStore's read-only one on CUDA runs, so nothing is copied or doubled.
  * "pinned-copy": where the driver will not register the mapping, the streamed tensors are
    copied once into one page-locked block (huge pages asked for before it is touched) and
    the WeightStore serves them from there; the page cache of the bytes copied is dropped
    behind the copy (madvise / posix_fadvise DONTNEED), so RAM holds them once.
  * "staged" / "host-memcpy": nothing is pinned; the copier stages every tensor.
Sources that are not views of a mapped file (weights cast to the compute dtype at load) are
pinned by copy on either pinned path.

`pin_streamed` never raises for memory it could not lock: what did not pin is named in one
warning, with what it costs, and is staged.
"""

from __future__ import annotations

import bisect
import mmap
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moecc_runtime.memory import huge_pages, pinned
from moecc_runtime.memory.weight_path import DESCRIPTIONS, WeightPath, choose_weight_path, other_host_bytes, pin_room

_PAGE = 4096
MADV_POPULATE_READ = 22  # Linux 5.14+


@dataclass
class WeightPins:
    """What of the streamed weights is page-locked, and how (the path actually taken)."""

    path: WeightPath
    streamed_bytes: int
    pinned_bytes: int = 0
    pieces: list[tuple[int, int]] = field(default_factory=list)  # (ptr, nbytes) registered, sorted
    blocks: list[torch.Tensor] = field(default_factory=list)  # pinned copies kept alive
    _starts: list[int] = field(default_factory=list)

    def add(self, pieces: list[tuple[int, int]]) -> None:
        self.pieces = sorted(self.pieces + pieces)
        self._starts = [p for p, _ in self.pieces]

    def covers(self, t: torch.Tensor) -> bool:
        """Whether host tensor `t` lies inside one registered piece (one DMA reads it)."""
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        i = bisect.bisect_right(self._starts, ptr) - 1
        return i >= 0 and ptr + n <= self.pieces[i][0] + self.pieces[i][1]

    def report(self) -> dict[str, Any]:
        """For stats and `moecc explain`: the path, its bytes, and what it costs in words."""
        return {"path": str(self.path), "streamed_bytes": self.streamed_bytes, "pinned_bytes": self.pinned_bytes,
                "how": DESCRIPTIONS[self.path]}

    def close(self) -> None:
        """Unpin (every copy from the pinned weights must have finished: the caller drains)."""
        pinned.unregister_pieces([p for p in self.pieces if not any(_inside(p, b) for b in self.blocks)])
        for b in self.blocks:
            pinned.release(b)
        self.pieces, self._starts, self.blocks = [], [], []


def _inside(piece: tuple[int, int], block: torch.Tensor) -> bool:
    return block.data_ptr() <= piece[0] < block.data_ptr() + block.numel()


def pin_streamed(store: Any, keys: list[str], device: torch.device, other_bytes: int = 0) -> WeightPins:
    """Page-lock the stored tensors of weights `keys` (the streamed ones) by the path the rule
    picks for this machine now. needs: a WeightStore; `other_bytes`: what else the run holds
    (other_host_bytes). guarantees: never raises for a refusal; the path in the result is
    the one taken ("staged" when nothing pinned)."""
    streamed = streamed_bytes(store.manifest, keys)
    kind = torch.device(device).type
    room = pin_room(pinned.available_bytes(), other_bytes) if kind == "cuda" else None
    path = choose_weight_path(kind, room, streamed, pinned.pinning_allowed())
    pins = WeightPins(path, streamed)
    if path not in (WeightPath.REGISTERED_MMAP, WeightPath.PINNED_COPY):
        return pins  # nothing read here: the weights stay lazily mapped
    srcs = _sources(store, keys)
    pins.streamed_bytes = sum(_nbytes(t) for _, _, t in srcs)  # as held (a cast copy in the compute dtype)
    failures: list[tuple[int, int, str]] = []
    mapped = [s for s in srcs if store.mapping(s[2]) is not None]
    other = [s for s in srcs if store.mapping(s[2]) is None]
    if path == WeightPath.REGISTERED_MMAP and mapped:
        _register_mapped(store, mapped, pins, failures)
        if pins.pinned_bytes == 0 and failures:  # the driver will not pin the mapping: copy instead
            pins.path = choose_weight_path("cuda", room, streamed, True, mapping_registrable=False)
            other, failures = srcs, []
    if pins.path == WeightPath.PINNED_COPY or other:
        _pin_by_copy(store, other if pins.path == WeightPath.REGISTERED_MMAP else srcs, pins, failures)
    if pins.pinned_bytes == 0:
        pins.path = WeightPath.STAGED
    _warn_short(pins, failures)
    return pins


def streamed_bytes(manifest: dict[str, dict[str, Any]], keys: list[str]) -> int:
    """Stored bytes of weights `keys` as the plan's manifest gives them (every part)."""
    from moecc_runtime import formats

    return sum(int(e.get("nbytes", 0)) for k in dict.fromkeys(keys) for e in formats.stored_entries(manifest[k]).values())


def _sources(store: Any, keys: list[str]) -> list[tuple[str, str, torch.Tensor]]:
    """(key, part, host tensor) of every stored tensor of `keys`, each storage once."""
    out, seen = [], set()
    for k in keys:
        for name, t in store.stored(k).items():
            if t.data_ptr() not in seen and _nbytes(t):
                seen.add(t.data_ptr())
                out.append((k, name, t))
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _register_mapped(store: Any, srcs: list[tuple[str, str, torch.Tensor]], pins: WeightPins,
                     failures: list[tuple[int, int, str]]) -> None:
    """Per mapped file, per run of its streamed tensors (runs split where more than
    `GAP_BYTES` of other tensors lie between): pre-fault and register (read-only) the run's
    pages, in pieces cut only where no tensor spans the cut (`_cuts`)."""
    by_file: dict[Path, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for _, _, t in srcs:
        path, base = store.mapping(t)
        by_file.setdefault(path, (base, []))[1].append(t)
    for path, (base, ts) in by_file.items():
        for run in _runs(sorted(ts, key=lambda t: t.data_ptr())):
            b0 = base.data_ptr()
            lo = (run[0].data_ptr() - b0) // _PAGE * _PAGE
            hi = min(_page_up(max(t.data_ptr() - b0 + _nbytes(t) for t in run)), _page_up(base.numel()))
            cuts = _cuts(run, b0, lo)
            _populate(base, lo, hi)
            got = pinned.register_range(b0 + lo, hi - lo, f"weights in {path.name}", flags=pinned.READ_ONLY,
                                        cuts=cuts, failures=failures)
            pins.add(got)
            pins.pinned_bytes += sum(_nbytes(t) for t in run if pins.covers(t))


def _cuts(run: list[torch.Tensor], b0: int, lo: int) -> list[int]:
    """Offsets from `lo` (page multiples) where `run`'s registration may be cut into pieces with
    every tensor inside one piece (one DMA reads it): a tensor's start where it falls on a page,
    else the first page after the previous tensor where that is before the start. Two tensors
    sharing a page are never cut apart: safetensors' data rarely starts on a page, so cutting
    at the page under each tensor's start, as before, split one tensor at every piece boundary
    (the first device run: 8 of 96 expert matrices a step staged at memmove speed)."""
    cuts: set[int] = set()
    end: int | None = None
    for t in run:  # sorted by address
        s = t.data_ptr() - b0
        cut = s if s % _PAGE == 0 else (_page_up(end) if end is not None and _page_up(end) <= s else None)
        if cut is not None and cut > lo:
            cuts.add(cut - lo)
        end = max(end or 0, s + _nbytes(t))
    return sorted(cuts)


#: Streamed tensors of one file farther apart than this are registered as separate ranges, so
#: resident tensors between them are not locked for nothing.
GAP_BYTES = 64 << 20


def _runs(ts: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`ts` (sorted by address) in runs whose gaps are at most GAP_BYTES."""
    runs: list[list[torch.Tensor]] = []
    end = None
    for t in ts:
        if end is None or t.data_ptr() - end > GAP_BYTES:
            runs.append([])
        runs[-1].append(t)
        end = max(end or 0, t.data_ptr() + _nbytes(t))
    return runs


def _page_up(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def _populate(base: torch.Tensor, lo: int, hi: int) -> None:
    """Fault in bytes [lo, hi) of a mapping before registering them (read-ahead in big I/Os
    instead of the driver's page-by-page faults)."""
    fn = huge_pages._madvise()
    if fn is not None and fn(base.data_ptr() + lo, hi - lo, MADV_POPULATE_READ) == 0:
        return
    end = min(hi, base.numel())
    if end > lo:
        int(base[lo:end:_PAGE].sum())  # one read per page


def _pin_by_copy(store: Any, srcs: list[tuple[str, str, torch.Tensor]], pins: WeightPins,
                 failures: list[tuple[int, int, str]]) -> None:
    """Copy `srcs` into one page-locked block and serve their weights from it; drop the page
    cache of the mapped bytes copied."""
    if not srcs:
        return
    offs, total = [], 0
    for _, _, t in srcs:
        offs.append(total)
        total += _page_up(_nbytes(t))  # page-aligned: the registration is cut between tensors only
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", pinned.PinningWarning)
        block = pinned.host_empty((total,), torch.uint8, pin=True, what="streamed weights (pinned copy)", huge=True,
                                  cuts=offs)
    pieces = pinned.pieces_of(block) or ([(block.data_ptr(), total)] if _is_pinned(block) else [])
    if not pieces:
        failures.append((0, total, "; ".join(str(w.message) for w in caught)[:300] or "not page-locked"))
        return
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for (k, name, t), off in zip(srcs, offs):
        dst = block[off:off + _nbytes(t)].view(t.dtype).view(t.shape)
        dst.copy_(t)
        parts.setdefault(k, dict(store.stored(k)))[name] = dst
    for (_, _, t) in srcs:
        _drop_cache(store, t)
    for k, p in parts.items():
        store.rebase(k, p)
    pins.blocks.append(block)
    pins.add(pieces)
    pins.pinned_bytes += sum(_nbytes(t) for (_, _, t), off in zip(srcs, offs)
                             if pins.covers(block[off:off + max(1, _nbytes(t))]))


def _is_pinned(t: torch.Tensor) -> bool:
    """From torch's pinned allocator (a small block)."""
    try:
        return bool(t.is_pinned())
    except RuntimeError:
        return False


def _drop_cache(store: Any, t: torch.Tensor) -> None:
    """After copying mapped tensor `t`: unmap its whole pages and drop them from the page
    cache, so RAM does not hold the bytes twice (advice; failures change nothing)."""
    found = store.mapping(t)
    if found is None:
        return
    path, base = found
    off = t.data_ptr() - base.data_ptr()
    lo, hi = _page_up(off), (off + _nbytes(t)) // _PAGE * _PAGE
    if hi <= lo:
        return
    fn = huge_pages._madvise()
    if fn is not None:
        fn(base.data_ptr() + lo, hi - lo, getattr(mmap, "MADV_DONTNEED", 4))
    if hasattr(os, "posix_fadvise"):
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError:
            pass


def _warn_short(pins: WeightPins, failures: list[tuple[int, int, str]]) -> None:
    """One warning when part of the streamed weights stays pageable: how much and what it costs."""
    short = pins.streamed_bytes - pins.pinned_bytes
    if not failures or short <= 0:
        return
    gib = 2 ** 30
    warnings.warn(f"streamed weights: {pins.pinned_bytes / gib:.2f} of {pins.streamed_bytes / gib:.2f} GiB "
                  f"page-locked ({pins.path}); the other {short / gib:.2f} GiB are staged through pinned buffers "
                  f"(a host memmove per copy, ~5-10 GB/s instead of the link's rate). First refusal: "
                  f"{failures[0][2]}. Free host memory or lower the plan's KV pool (moecc compile --host-mem) to "
                  f"pin them all; MOECC_NO_PIN=1 silences this", pinned.PinningWarning, stacklevel=3)


__all__ = ["WeightPins", "other_host_bytes", "pin_streamed", "streamed_bytes"]
