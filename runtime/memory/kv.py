"""The paged host KV pool: K and V of every sequence in fixed-size blocks of one pool, and
the pool's geometry as a plan gives it.

Legend: L = layers, Hkv = key/value heads, NB = blocks in the pool, bs = block size
(positions per block), D = head dim, Dv = value head dim, n = positions written in one call.

The pool is one tensor per K and V, [L, Hkv, NB, bs, D], laid out so that gathering a
micro-batch's blocks for one layer is one index_select along the block axis, and the blocks
of one sequence, gathered in table order, read as one [Hkv, positions, D] run. Which
sequence holds which blocks is the scheduler's (scheduler/blocks.py); the pool only stores,
zeroes and gathers blocks by index.

The pool is ordinary (pageable) host memory on every run, huge pages asked for before its
pages are first touched: no copy reads or writes it from the device directly. KV gathered for
device attention is gathered on the host into a pinned staging area and copied from there
(memory/streaming.py KVStaging); the new K/V of a micro-batch computed on the device go to it
asynchronously (`store`): copied device->host on the worker's device->host stream into
pinned buffers, an event recorded, and scattered into the pool only when something reads
the pool (`flush`: the host attention of that layer, the end of the step). On a CPU run
`store` is `write`, at once. So pinning the pool would only lock (and commit at start-up)
memory the weights' page cache needs; `KVPool(pin=True)` still does, for callers that DMA
from it themselves. A job commits only its first wave's blocks at start-up (`prefault`,
`first_wave_blocks`: `moecc exec` through Engine.prefault_kv), the rest on first use.

The pool is sized for the machine it runs on (`fit_to_host`, from `pool_geometry`): a
plan compiled elsewhere (or when more memory was free) whose pool does not fit this machine's
available memory now is shrunk, with a warning naming the numbers, down to the plan's batch
of sequences of its workload's length; below that the run is refused (KVFitError).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from moecc_runtime.contract.blocks import seq_blocks
from moecc_runtime.contract.kv_geometry import KVGeometry
from moecc_runtime.contract.plan_types import PlanView
from moecc_runtime.memory import pinned
from moecc_runtime.native import kv_write


class KVFitError(RuntimeError):
    """The plan's KV pool cannot be had on this machine, even shrunk to the plan's batch."""


class HostMemoryWarning(UserWarning):
    """The plan's KV pool was shrunk to fit this machine's available memory."""

def pool_geometry(plan: PlanView, kv_blocks: int | None = None, block_size: int | None = None) -> KVGeometry:
    """The plan's pool (`plan.kv`, the compiler's contract.kv_geometry.KVGeometry) fitted to this
    machine (`fit_to_host`), or `kv_blocks` blocks of `block_size` when given (tests, tuning: as asked)."""
    geo = dataclasses.replace(plan.kv, block_size=int(block_size or plan.kv.block_size),
                              num_blocks=int(kv_blocks or plan.kv.num_blocks))
    if kv_blocks is None and block_size is None:
        geo = fit_to_host(geo, plan.decode.B, plan.workload.seq_len, plan.host_other_bytes)
    return geo


def fit_to_host(geo: KVGeometry, B: int, seq_len: int, other: int, available: int | None = None) -> KVGeometry:
    """`geo` with at most the blocks this machine can hold now: its available memory
    (MemAvailable at run time, or `available`) less `other`, the host bytes of the plan's
    weights and host buffers. guarantees: unchanged when it fits or the memory or the block
    bytes are unknown; shrunk with a HostMemoryWarning down to B sequences of `seq_len`
    tokens (the plan's decode batch of its workload's length); KVFitError (naming the
    numbers and what to do) below that."""
    avail = pinned.available_bytes() if available is None else available
    per_block = geo.bytes_per_block
    if avail is None or per_block <= 0:
        return geo
    room = avail - other
    if geo.num_blocks * per_block <= room:
        return geo
    floor = B * seq_blocks(seq_len, geo.block_size)  # what the planner sized each sequence for
    fit = max(0, room) // per_block
    gib = 2 ** 30
    what = (f"the plan's KV pool ({geo.num_blocks} blocks, {geo.num_blocks * per_block / gib:.2f} GiB) does not fit "
            f"this machine: {avail / gib:.2f} GiB available now, {other / gib:.2f} GiB of it for the plan's weights "
            f"and host buffers")
    if fit < floor:
        raise KVFitError(f"{what}, leaving room for {fit} blocks, fewer than the {floor} its batch of {B} sequences of "
                         f"{seq_len} tokens needs. Free host memory, or recompile the plan on this machine "
                         f"(`moecc compile ... --host-mem <{(avail * 0.9) / gib:.0f}GB or less>`)")
    warnings.warn(f"{what}; using {fit} blocks ({fit * per_block / gib:.2f} GiB) instead, still room for its batch of "
                  f"{B} sequences of {seq_len} tokens (longer ones may wait for blocks). Recompile on this machine to "
                  f"size it here", HostMemoryWarning, stacklevel=3)
    return dataclasses.replace(geo, num_blocks=int(fit))


def first_wave_blocks(plan: PlanView, num_blocks: int, block_size: int, requests: int | None) -> int:
    """Blocks a job's first wave holds: min(B, `requests`) sequences (B: the plan's decode batch;
    `requests` None: unknown, B) of the plan's workload length, at most the pool."""
    seqs = plan.decode.B if requests is None else min(plan.decode.B, max(0, int(requests)))
    return min(num_blocks, seqs * seq_blocks(plan.workload.seq_len, block_size))


@dataclass
class _PendingStore:
    """K/V of one micro-batch on their way device->host (`KVPool.store`)."""

    layer: int
    blocks: torch.Tensor
    offsets: torch.Tensor
    k: torch.Tensor  # [n, Hkv, D] pinned host copy, valid once `event` has completed
    v: torch.Tensor
    event: Any  # torch.cuda.Event on the device->host stream


class KVPool:
    """The K and V bytes of `num_blocks` blocks (block ownership: scheduler/blocks.py)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, block_size: int,
                 num_blocks: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 v_head_dim: int | None = None, pin: bool = False):
        """`pin` (a host pool of a CUDA run): page-locked host memory (memory/pinned.py; when
        pinning fails a warning says so and the pool is pageable)."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
        dv = head_dim if v_head_dim is None else v_head_dim  # 0 for latent attention: K holds it all
        if torch.device(device).type == "cpu":
            # pages are committed only when first written (an idle pool costs address space only);
            # huge pages asked for before any touch (pinning touches them all): attention's reads
            # jump between blocks
            self.k = pinned.host_empty(shape, dtype, pin=pin, what="KV pool", huge=True)  # [L, Hkv, NB, bs, D]
            pin_v = pin and (pinned.is_registered(self.k) or _pinned(self.k))  # no second try when K failed
            self.v = pinned.host_empty(shape[:-1] + (dv,), dtype, pin=pin_v, what="KV pool (V)", huge=True)
        else:
            self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, Hkv, NB, bs, D]
            self.v = torch.empty(shape[:-1] + (dv,), dtype=dtype, device=device)  # [L, Hkv, NB, bs, Dv]
        self.pinned = bool(pin and (pinned.is_registered(self.k) or _pinned(self.k)))  # pinning can fail
        elem = self.k.element_size()
        self.bytes_per_token = num_layers * num_kv_heads * (head_dim + dv) * elem
        self.bytes_per_block = self.bytes_per_token * block_size
        self.d2h: Any = None  # a copy_engine.DeviceToHost on CUDA runs (the worker sets it): `store` is async
        self._pending: list[_PendingStore] = []

    @classmethod
    def of(cls, geo: KVGeometry, dtype: torch.dtype, compute_device: torch.device | str = "cpu") -> "KVPool":
        """A host pool of geometry `geo` for a run computing on `compute_device`: pageable on
        every device (see the module docstring: nothing DMAs from it)."""
        return cls(geo.layers, geo.heads, geo.key_dim, block_size=geo.block_size, num_blocks=geo.num_blocks,
                   dtype=dtype, device="cpu", v_head_dim=geo.value_dim, pin=False)

    def prefault(self, blocks: int) -> int:
        """Commit (and zero) the pages of blocks [0, blocks) in every layer and head, before a
        job's first step, so its steps do not pay their first touch (the allocator hands out block
        0 first and reuses freed blocks last in, first out: a job's first wave lives there; a
        page first touched can cost far more than its zeroing, e.g. a huge page a virtual
        machine's host has yet to back). Returns the bytes touched: 0 for a pinned pool (resident
        since registration) or one on a device."""
        n = max(0, min(int(blocks), self.num_blocks))
        if n == 0 or self.pinned or self.k.device.type != "cpu":
            return 0
        self.k[:, :, :n].zero_()  # [L, Hkv, n, bs, D]
        self.v[:, :, :n].zero_()
        return n * self.bytes_per_block

    def zero(self, blocks: list[int]) -> None:
        """Zero `blocks` in every layer, so the unwritten tail of a sequence's last block (read,
        masked, by attention) never holds stale NaN or Inf."""
        self.flush()  # a late store must not land in a block after it was zeroed for its new owner
        if blocks:
            idx = torch.tensor(blocks, dtype=torch.long, device=self.k.device)
            self.k.index_fill_(2, idx, 0)  # [L, Hkv, NB, bs, D]: the blocks, every layer
            self.v.index_fill_(2, idx, 0)

    def copy_blocks(self, copies: tuple[tuple[int, int], ...] | list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block in every layer (copy on write: a sequence's own
        copy of a block it shared); sources and destinations are distinct blocks."""
        self.flush()  # the sources' late stores land first
        if copies:
            src = torch.tensor([a for a, _ in copies], dtype=torch.long, device=self.k.device)
            dst = torch.tensor([b for _, b in copies], dtype=torch.long, device=self.k.device)
            self.k.index_copy_(2, dst, self.k.index_select(2, src))  # [L, Hkv, NB, bs, D]
            self.v.index_copy_(2, dst, self.v.index_select(2, src))

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store K/V of n positions. blocks/offsets: [n] (on the pool's device); k/v: [n, Hkv, D]."""
        for pool, x in ((self.k[layer], k), (self.v[layer], v)):
            if not kv_write.write(pool, blocks, offsets, x):  # one pass on the host, the same bytes
                pool[:, blocks, offsets] = x.transpose(0, 1).to(pool.dtype)  # [Hkv, n, D]

    def store(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """`write`, from wherever k/v [n, Hkv, D] are: host tensors at once; device tensors of a
        CUDA run through the device->host stream (non-blocking, into pinned memory), scattered
        into the pool by the next `flush` that covers `layer`."""
        if k.device.type != "cuda" or self.d2h is None:
            self.write(layer, blocks, offsets, k.to("cpu"), v.to("cpu"))
            return
        (hk, hv), event = self.d2h.start(k, v)
        self.defer(layer, blocks, offsets, hk, hv, event)

    def defer(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              event: Any) -> None:
        """Queue host copies k/v (valid once `event` completes) to be written by `flush`."""
        self._pending.append(_PendingStore(layer, blocks, offsets, k, v, event))

    def flush(self, layer: int | None = None, wait: bool = True) -> None:
        """Write the queued stores (of `layer`, or all) into the pool: waiting on each one's
        event, or (wait=False) only those whose copies have already finished."""
        if not self._pending:
            return
        keep = []
        for p in self._pending:
            if (layer is None or p.layer == layer) and (wait or p.event.query()):
                p.event.synchronize()
                self.write(p.layer, p.blocks, p.offsets, p.k, p.v)
            else:
                keep.append(p)
        self._pending = keep

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Write what is queued, then unpin the pool (its memory goes with the last reference)."""
        self.flush()
        pinned.release(self.k)
        pinned.release(self.v)

    def gather(self, layer: int, blocks: torch.Tensor, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
        """Copy the listed blocks of one layer into out_k/out_v: [Hkv, len(blocks), bs, D]
        (contiguous). One index_select per head along its leading block axis: 1.5x the
        bandwidth of one call along the middle axis on this CPU."""
        for h in range(self.k.shape[1]):
            torch.index_select(self.k[layer, h], 0, blocks, out=out_k[h])  # [nb, bs, D]
            torch.index_select(self.v[layer, h], 0, blocks, out=out_v[h])


def _pinned(t: torch.Tensor) -> bool:
    try:
        return t.is_pinned()
    except RuntimeError:
        return False
