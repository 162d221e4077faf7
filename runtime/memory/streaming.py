"""Where the worker's weights and gathered KV live during a step, and how they get there.

Legend: Hkv = key-value heads, nb = KV blocks gathered, bs = block size, D = head dim.

Two policies with one interface (`enter`, `get`, `experts`; `KVStaging.submit/acquire/release`):
  * InPlace (no device budget in the plan): weights are read where they are (the mmap on
    a CPU; fetched once and kept on CUDA), KV is gathered on the compute thread;
  * Streamed (the plan has an arena): every device-resident tensor is carved from the
    arena. Weight groups the plan keeps resident are copied in once at start-up; every
    other module's dense weights go through two dense slots (the next streamed module is
    fetched while the current one computes, cyclically across steps); experts go through
    `expert_slots` slots, fetched `expert_slots - 1` ahead in the order compute uses them,
    and only experts some token chose; the KV of attention micro-batches goes through two
    buffers (micro-batch j+1, or the next layer's first, is gathered while j computes).

On CUDA every host->device copy goes from pinned memory on a copy-engine lane's stream:
streamed weights straight from their page-locked pages where the weight path allows
(memory/weight_path.py, taken by memory/pinned_weights.py at start-up: "registered-mmap" or
"pinned-copy"; `StreamedWeights.weight_path` says which), otherwise through two pinned
staging buffers per lane used in turn (`Copier`: the multi-threaded memmove of one chunk
overlaps the DMA of the one before, and all are enqueued back to back); gathered KV through
a pinned staging area per KV buffer. The host waits only when it reuses a staging buffer
whose DMA is still running, and a slot or KV buffer is overwritten only after the compute
stream's release event, which the copy stream (not the host) waits for.

Copy order (memory/copy_engine.py lanes): the experts the router chose are fetched on the
"urgent" lane, never queued behind the next module's dense prefetch or the next KV gather
(the "normal" lane, which also carries experts fetched ahead of routing). A slot remembers
the ticket of the copy that filled it: its next fill waits for that one (on either lane), a
cached slot is handed out with it, and an expert fetched ahead that no row chose is
cancelled if its copy has not started. Race amplification (copy_engine.RaceAmplifier)
poisons a slot when it is given to another unit (a free slot still holding its unit is a
cache, not garbage) and a KV buffer as soon as it is released.
"""

from __future__ import annotations

import ctypes
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from moecc_runtime.contract.placement import ALIGN, align, placed_bytes
from moecc_runtime.contract.plan_types import Op, PlanView
from moecc_runtime.memory.arena import ArenaError, DeviceArena, Region
from moecc_runtime.memory.copy_engine import LANES, CopyEngine, CopyError, RaceAmplifier, Ticket
from moecc_runtime.memory import pinned, pinned_weights
from moecc_runtime.memory.weight_path import WeightPath, other_host_bytes, streamed_keys
from moecc_runtime.memory.kv import KVPool
from moecc_runtime.memory.weights import WeightError, WeightStore
from moecc_runtime import formats
from moecc_runtime.plan_schema import expert_group, speculates  # speculates: re-exported, the rule StreamedWeights.speculate serves
from moecc_runtime.worker import kernels

ExpertWeights = tuple[torch.Tensor, ...]  # in kernels.expert_parts order: gate, up, down (or gpt-oss's four)


def expert_keys(op: Op, e: int) -> list[str]:
    """Plan weight keys of expert `e` of an experts op, in the order its MLP takes them."""
    return [op.weights[f"e{e}.{part}"] for part in kernels.expert_parts(op.attrs)]


def experts_ops(plan: PlanView) -> dict[str, Op]:
    """The plan's experts ops by name (what `experts(name, ...)` and `speculate(name)` look up)."""
    return {op.name: op for m in plan.schedule for op in m.ops if op.op == "experts"}


def _placed(t: torch.Tensor) -> int:
    """Arena bytes tensor `t` takes in a slot: its bytes at ALIGN (contract/placement.py, by
    which the planner's moecc/planner/costs.slot_bytes sizes the slot)."""
    return align(t.numel() * t.element_size())


class InPlaceWeights:
    """No arena: read weights where they are."""

    weight_path: WeightPath | None = None  # nothing is copied to a device
    packed_bytes: int = 0  # weights laid out for the host GEMM (memory/packed_weights.py)
    holds_together = True  # every expert `experts` yields stays valid while later ones are fetched

    def __init__(self, store: WeightStore, plan: PlanView):
        self.store = store
        self._ops = experts_ops(plan)
        self._made: dict[str, torch.Tensor] = {}  # the running module's materialized quantized weights

    def enter(self, index: int) -> None:
        self._made.clear()

    def get(self, key: str) -> torch.Tensor:
        t = self._made.get(key)
        if t is None:
            t = self.store.get(key)
            if not formats.is_dense(self.store.manifest[key]):  # dequantized once per module run
                self._made[key] = t
        return t

    def experts(self, name: str, used: list[int]) -> Iterator[ExpertWeights]:
        """The weights of experts `used` of experts op `name`, in that order."""
        op = self._ops[name]
        for e in used:
            yield tuple(self._expert_weight(k) for k in expert_keys(op, e))  # type: ignore[misc]

    def _expert_weight(self, key: str) -> torch.Tensor:
        """One expert weight as its MLP takes it (a quantized one dequantized now, not kept)."""
        return self.store.get(key)

    def speculate(self, name: str) -> None:
        """Nothing to fetch: the weights are where they are."""

    def close(self) -> None:
        pass


@dataclass
class _Slot:
    index: int
    region: Region
    offset: int
    nbytes: int
    unit: Any = None  # what it holds (module index or (op, expert)); None when free
    release: Any = None  # CUDA event recorded when compute last used it
    fill: Ticket | None = None  # the copy that last filled it (a cached hand-out waits on it)

    @property
    def bytes(self) -> torch.Tensor:
        """[nbytes] uint8: the slot's arena bytes (what race amplification poisons)."""
        return self.region.base[self.offset:self.offset + self.nbytes]


class _SlotPool:
    def __init__(self, region: Region, n: int, slot_bytes: int, race: RaceAmplifier | None = None):
        stride = align(slot_bytes)  # every slot starts aligned
        self.slots = [_Slot(i, region, i * stride, slot_bytes) for i in range(n)]
        self._free = deque(self.slots)
        self.race = race

    def acquire(self, unit: Any) -> tuple[_Slot, Ticket | None]:
        """A slot for `unit`: a free one that still holds it, with the ticket of the copy that
        filled it (nothing to copy; the user waits on that copy), else the least recently freed
        (which keeps recent units around for reuse) and None."""
        held = next((s for s in self._free if s.unit == unit and _valid_fill(s.fill)), None)
        if held is not None:
            self._free.remove(held)
            return held, held.fill
        if not self._free:
            raise RuntimeError("copy engine: no free weight slot (the runtime released too few)")
        s = self._free.popleft()
        s.unit = unit
        return s, None

    def release(self, s: _Slot) -> None:
        """Compute is done with `s` (on CUDA: once the compute stream passes this point)."""
        device = s.region.base.device
        if self.race is not None:
            self.race.delay(torch.cuda.current_stream(device) if device.type == "cuda" else None)
        if device.type == "cuda":
            s.release = torch.cuda.Event(blocking=True)
            s.release.record(torch.cuda.current_stream(device))
        self._free.append(s)


def _valid_fill(t: Ticket | None) -> bool:
    """Whether the copy `t` filled (or will fill) its slot: not cancelled, not failed."""
    return t is not None and not t.skipped and t._error is None


def _default_threads() -> int:
    """Threads memmoving staged chunks: half the cores, 1 to 8 (compute needs the rest)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class _Staging:
    """Pinned host buffers the copier stages through, used round robin; each carries the
    event recorded after the copy that last read it, waited on (host side) before the
    buffer is written again."""

    def __init__(self, n: int, nbytes: int):
        self.bufs = [pinned.host_empty((nbytes,), torch.uint8, pin=True, what="copy staging") for _ in range(n)]
        self.events = [torch.cuda.Event(blocking=True) for _ in range(n)]
        self._next = 0

    def take(self) -> tuple[torch.Tensor, Any]:
        i = self._next
        self._next = (i + 1) % len(self.bufs)
        self.events[i].synchronize()  # the DMA that read it last is done (an unrecorded event: at once)
        return self.bufs[i], self.events[i]

    def close(self) -> None:
        for e in self.events:
            e.synchronize()
        for b in self.bufs:
            pinned.release(b)


class Copier:
    """Host tensors into arena views, on a copy-engine lane's thread. On CUDA a source in
    page-locked memory (`pins`: the streamed weights, memory/pinned_weights.py) is one DMA
    straight into the arena; any other goes through `STAGING_BUFFERS` pinned staging buffers
    of up to `CHUNK` bytes per lane, used in turn: a chunk is memmoved into one (split across
    `threads` threads) while the DMA out of the other runs, every copy enqueued back to back
    on the lane's stream; the host waits only when it comes back to a buffer whose DMA has
    not finished. On a CPU a plain memmove (the GIL released), so page faults on the mmap
    land on the copy thread, not on compute."""

    CHUNK = 8 << 20
    STAGING_BUFFERS = 2

    def __init__(self, device: torch.device, staging_bytes: int, threads: int | None = None):
        self.cuda = device.type == "cuda"
        self.device = device
        self.chunk = max(ALIGN, min(align(staging_bytes), self.CHUNK))
        self.rings = {lane: _Staging(self.STAGING_BUFFERS, self.chunk) for lane in LANES} if self.cuda else {}
        self.ring = self.rings.get("normal")
        self.threads = int(threads or _default_threads())
        self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="moecc-stage") \
            if self.cuda and self.threads > 1 else None
        self.pins: Any = None  # a pinned_weights.WeightPins: sources DMA'd without staging
        self.race: RaceAmplifier | None = None  # set by StreamedWeights from its copy engine
        self.direct_bytes = 0  # bytes DMA'd straight from pinned sources
        self.staged_bytes = 0  # bytes memmoved through staging (CUDA) or into the arena (CPU)

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], slot: _Slot | None, lane: str = "normal") -> None:
        """pairs: (host source, arena destination), all destinations inside `slot` (if given)."""
        if slot is not None and slot.release is not None:  # not handed to the engine as `after`
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(slot.release)  # on the device
            else:
                slot.release.synchronize()
            slot.release = None
        if not self.cuda:
            for src, dst in pairs:
                n = src.numel() * src.element_size()
                ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
                self.staged_bytes += n
            return
        stream = torch.cuda.current_stream(self.device)  # the lane's stream (the engine set it)
        for src, dst in pairs:
            n = src.numel() * src.element_size()
            if dst.numel() * dst.element_size() != n:
                raise CopyError(f"copy engine: {n} B source into a {dst.numel() * dst.element_size()} B view")
            if self.pins is not None and self.pins.covers(src):
                dst.copy_(src, non_blocking=True)  # one DMA from page-locked memory
                self.direct_bytes += n
                continue
            self._staged(src, dst.view(-1).view(torch.uint8), n, self.rings[lane], stream)

    def _staged(self, src: torch.Tensor, out: torch.Tensor, n: int, ring: _Staging, stream: Any) -> None:
        """`n` bytes of `src` into `out` [n] uint8 through the staging ring, chunk by chunk."""
        ptr = src.data_ptr()
        for off in range(0, n, self.chunk):
            c = min(self.chunk, n - off)
            buf, done = ring.take()
            self._memmove(buf.data_ptr(), ptr + off, c)
            out[off:off + c].copy_(buf[:c], non_blocking=True)
            done.record(stream)
            if self.race is not None:  # the buffer is free once its DMA is: poison it then
                done.synchronize()
                self.race.poison(buf)
        self.staged_bytes += n

    def _memmove(self, dst: int, src: int, n: int) -> None:
        """memmove, split across the copier's threads for big chunks (1 MiB pieces or more)."""
        parts = min(self.threads, max(1, n >> 20)) if self._pool is not None else 1
        if parts == 1:
            ctypes.memmove(dst, src, n)
            return
        step = -(-n // parts)
        futs = [self._pool.submit(ctypes.memmove, dst + o, src + o, min(step, n - o))  # type: ignore[union-attr]
                for o in range(step, n, step)]
        ctypes.memmove(dst, src, min(step, n))
        for f in futs:
            f.result()

    def close(self) -> None:
        for ring in self.rings.values():
            ring.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class StreamedWeights:
    """Weights through the arena (see the module docstring)."""

    holds_together = False  # an expert's slot is handed to a later one: hold one expert at a time

    def __init__(self, plan: PlanView, store: WeightStore, arena: DeviceArena, engine: CopyEngine,
                 copier: Copier):
        lay = plan.arena
        if lay is None:
            raise ArenaError("StreamedWeights: the plan has no device arena (compiled without --gpu-mem); "
                             "read its weights in place (InPlaceWeights) or recompile with --gpu-mem")
        self.store, self.arena, self.engine, self.copier = store, arena, engine, copier
        self.plan = plan
        self.schedule = plan.schedule
        self._ops = experts_ops(plan)
        self._op_layer = {op.name: m.layer for m in self.schedule for op in m.ops}
        resident = set(lay.resident)
        self.views: dict[str, dict[str, torch.Tensor]] = {}  # resident key -> its stored tensors in the arena
        self._cur: dict[str, dict[str, torch.Tensor]] = {}  # the running module's streamed weights, the same
        self._made: dict[str, torch.Tensor] = {}  # the running module's dequantized weights
        self.units: list[list[str] | None] = []  # per module: streamed dense keys, or None
        self.resident_experts: set[str] = set()  # expert op names whose experts are resident
        res_keys: list[str] = []
        for m in self.schedule:
            g = m.residency_group  # None: host only (the stem)
            keys = m.dense_keys() if g is not None else []
            if g is not None and g in resident:
                res_keys += keys
                self.units.append(None)
            else:
                self.units.append(keys or None)
            for op in m.ops:
                if op.op == "experts" and m.layer is not None and expert_group(m.layer) in resident:
                    self.resident_experts.add(op.name)
                    res_keys += list(op.weights.values())
        self._load_resident(res_keys)
        self.race = engine.race
        copier.race = self.race
        dense, n, expert = lay.dense_slot_bytes, lay.expert_slots, lay.expert_slot_bytes
        self.dense = _SlotPool(arena.region("dense_slots", 2 * align(dense)), 2, dense, self.race)
        self.expert_pool = _SlotPool(arena.region("expert_slots", n * align(expert)), n, expert, self.race)
        self._pending: dict[int, tuple[_Slot, Ticket, dict[str, torch.Tensor]]] = {}
        self._holding: _Slot | None = None  # the running module's dense slot
        self._spec: dict[str, list[tuple[_Slot, Ticket, dict[str, torch.Tensor], int]]] = {}  # fetched ahead of routing
        self.streamed = [i for i, u in enumerate(self.units) if u]
        self.pins = pinned_weights.pin_streamed(store, self._streamed_keys(), arena.device, other_host_bytes(plan.raw))
        copier.pins = self.pins if self.pins.pinned_bytes else None

    @property
    def weight_path(self) -> WeightPath:
        """How the streamed weights reach the device (memory/weight_path.py), as taken."""
        return self.pins.path

    def _streamed_keys(self) -> list[str]:
        """Every weight that goes through a slot (weight_path.streamed_keys: the rule's figure
        and the runtime's pins agree), checked against this object's own split."""
        keys = streamed_keys(self.plan.raw)
        mine = {k for u in self.units if u for k in u} | {
            k for op in self._ops.values() if op.name not in self.resident_experts for k in op.weights.values()}
        if set(keys) != mine:
            raise WeightError("the plan's streamed weights and the runtime's slots disagree (a runtime bug: "
                              "weight_path.streamed_keys and StreamedWeights split residency differently)")
        return keys

    # -- resident weights: copied in once -------------------------------------------------
    def _load_resident(self, keys: list[str]) -> None:
        keys = list(dict.fromkeys(keys))
        srcs = [self.store.stored(k) for k in keys]
        total = sum(_placed(t) for parts in srcs for t in parts.values())
        region = self.arena.region("resident", total)
        off = 0
        pairs = []
        for k, parts in zip(keys, srcs):
            views = self.views[k] = {}
            for name, src in parts.items():
                views[name] = region.view(off, src.shape, src.dtype, what=f"resident weight {k}.{name}")
                pairs.append((src, views[name]))
                off += _placed(src)
        if pairs:
            self.engine.submit(f"{len(pairs)} resident weights", total,
                               lambda: self.copier.copy(pairs, None), kind="fetch").wait()

    def _place(self, slot: _Slot, keys: list[str], what: str) -> tuple[dict[str, torch.Tensor], list, int]:
        views: dict[str, dict[str, torch.Tensor]] = {}
        pairs, off = [], 0
        srcs = [self.store.stored(k) for k in keys]
        need = placed_bytes(t.numel() * t.element_size() for parts in srcs for t in parts.values())
        if need > slot.nbytes:
            raise ArenaError(f"device arena: {what} ({need} B as placed) does not fit a {slot.nbytes} B slot; "
                             f"the plan sized its slots for other weights (recompile the plan)")
        for k, parts in zip(keys, srcs):
            views[k] = {}
            for name, src in parts.items():
                views[k][name] = slot.region.view(slot.offset + off, src.shape, src.dtype,
                                                  what=f"{what} weight {k}.{name}")
                pairs.append((src, views[k][name]))
                off += _placed(src)
        return views, pairs, off

    def _submit_unit(self, pool: _SlotPool, unit: Any, keys: list[str], what: str, layer: int | None,
                     lane: str = "normal"):
        """Fetch `unit` (its weights `keys`) into a slot of `pool` on copy lane `lane`: (slot,
        ticket, views). A free slot still holding the unit is reused without a copy, with the
        ticket of the copy that filled it (still running, perhaps, on the other lane)."""
        slot, cached = pool.acquire(unit)
        try:
            views, pairs, nbytes = self._place(slot, keys, what)
        except (WeightError, ArenaError):
            slot.unit = None
            pool.release(slot)
            raise
        if cached is not None:
            return slot, cached, views
        after, slot.release = [slot.release], None  # CUDA: the copy stream waits for compute's last use
        race, copier, device = self.race, self.copier, self.arena.device

        def fill() -> None:
            if race is not None:  # the slot's old content is garbage from here: make it loud
                race.poison(slot.bytes)
                race.delay(torch.cuda.current_stream(device) if device.type == "cuda" else None)
            copier.copy(pairs, slot, lane)

        # deps: the slot's previous fill (perhaps on the other lane) lands before this one
        slot.fill = self.engine.submit(what, nbytes, fill, kind="fetch", layer=layer, after=after, lane=lane,
                                       deps=[slot.fill])
        return slot, slot.fill, views

    # -- dense weights: two slots, the next streamed module fetched while one computes ----
    def enter(self, index: int) -> None:
        """Module `index` is about to run: make its weights available, release the previous
        module's slot, and start fetching the next streamed module's."""
        if self._holding is not None:
            self.dense.release(self._holding)
            self._holding = None
        self._cur = {}
        self._made = {}
        if self.units[index] is not None:
            if index not in self._pending:
                self._prefetch(index)
            slot, ticket, views = self._pending.pop(index)
            ticket.wait()
            self._holding, self._cur = slot, views
        if self.streamed:
            later = [i for i in self.streamed if i > index] or self.streamed  # cyclic: next step's first
            nxt = later[0]
            if nxt != index and nxt not in self._pending:
                self._prefetch(nxt)

    def _prefetch(self, index: int) -> None:
        keys = self.units[index]
        assert keys is not None
        m = self.schedule[index]
        self._pending[index] = self._submit_unit(self.dense, index, keys, f"module {m.module}", m.layer)

    def get(self, key: str) -> torch.Tensor:
        made = self._made.get(key)
        if made is not None:
            return made
        parts = self._cur.get(key)
        if parts is None:
            parts = self.views.get(key)
        if parts is None:
            raise WeightError(f"weight {key} is neither resident nor fetched for the running module "
                              f"(the plan's schedule and arena disagree)")
        return self._materialize(key, parts)

    def _materialize(self, key: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The weight from its stored tensors in the arena (dense: the view itself; quantized:
        dequantized on the device, kept for the running module only)."""
        entry = self.store.manifest[key]
        if formats.is_dense(entry):
            return parts["data"]
        w = self._made[key] = formats.materialize(entry, parts, self.store.compute_dtype or torch.float32, key)
        return w

    # -- experts: expert_slots slots, fetched ahead in the order compute uses them -------
    def speculate(self, name: str) -> None:
        """Start fetching the first experts of experts op `name` (as many as there are slots, in
        index order: the order they run) before its router has chosen them (the worker calls this
        during the layer's attention when `speculates(...)` holds). `experts(name, ...)` takes
        them over; one no row chose has only cost its copy."""
        if name in self.resident_experts or name in self._spec:
            return
        self._drop_speculated()
        op, pool, layer = self._ops[name], self.expert_pool, self._op_layer.get(name)
        n = min(len(pool.slots), int(op.attrs["num_experts"]))
        self._spec[name] = [
            self._submit_unit(pool, (name, e), expert_keys(op, e), f"expert {e} of {name} (ahead of routing)",
                              layer) + (e,) for e in range(n)]

    def _drop_speculated(self, keep: str | None = None) -> None:
        """Free the slots of experts fetched ahead for any op but `keep`."""
        for name in [n for n in self._spec if n != keep]:
            for slot, t, *_ in self._spec.pop(name):
                self._drop(slot, t)

    def _drop(self, slot: _Slot, ticket: Ticket) -> None:
        """Free an expert slot no row needs: its copy is cancelled if it has not started (the
        slot then holds nothing), else the slot's next fill waits for it (`deps`)."""
        if ticket.cancel():
            slot.unit = None
        self.expert_pool.release(slot)

    def experts(self, name: str, used: list[int]) -> Iterator[ExpertWeights]:
        """The weights of experts `used` of experts op `name`, in that order: resident ones from
        the arena, the rest through the expert slots (those fetched ahead taken over)."""
        op = self._ops[name]
        if name in self.resident_experts:
            for e in used:
                yield tuple(self._expert(k, self.views[k]) for k in expert_keys(op, e))  # type: ignore[misc]
            return
        pool = self.expert_pool
        self._drop_speculated(keep=name)
        ahead = {job[-1]: job for job in self._spec.pop(name, [])}  # fetched before routing
        inflight: deque[tuple[_Slot, Ticket, dict[str, torch.Tensor], int]] = deque()
        todo = deque(used)
        while todo and todo[0] in ahead:  # they run first, in `used` order
            inflight.append(ahead.pop(todo.popleft()))
        for slot, t, *_ in ahead.values():  # chosen by no row (or out of order): only their copy was spent
            self._drop(slot, t)

        def submit() -> None:  # on the urgent lane: compute waits for these next
            e = todo.popleft()
            slot, t, views = self._submit_unit(pool, (name, e), expert_keys(op, e), f"expert {e} of {name}",
                                               self._op_layer.get(name), lane="urgent")
            inflight.append((slot, t, views, e))

        try:
            while todo and len(inflight) < len(pool.slots):
                submit()
            while inflight:
                slot, t, views, e = inflight.popleft()
                t.wait()
                yield tuple(self._expert(k, views[k]) for k in expert_keys(op, e))  # type: ignore[misc]
                pool.release(slot)
                if todo:
                    submit()
        finally:  # an error mid-way: let queued copies finish before their slots are reused
            for slot, t, _, _ in inflight:
                try:
                    t.wait()
                except CopyError:
                    pass
                pool.release(slot)

    def _expert(self, key: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """An expert weight from its stored tensors (dequantized per use: never kept; on the host
        into a reused buffer of formats.scratch, valid until the next expert's are asked for)."""
        entry = self.store.manifest[key]
        if formats.is_dense(entry):
            return parts["data"]
        dtype = self.store.compute_dtype or torch.float32
        out = formats.scratch.ring(self).out(entry, dtype, parts["data"].device)
        return formats.materialize(entry, parts, dtype, key, out=out)

    def close(self) -> None:
        self.engine.drain()
        self.copier.close()
        self.pins.close()  # after the drain: no copy reads the pinned weights any more


@dataclass
class _KVBuf:
    k: torch.Tensor  # [Hkv * cap_blocks * bs * D] flat, viewed per micro-batch
    v: torch.Tensor
    key: Any = None  # (step, layer, micro-batch) it holds or is being filled with
    ticket: Ticket | None = None
    release: Any = None  # CUDA event
    staging: torch.Tensor | None = None  # CUDA: this buffer's pinned host staging (K then V elements)
    staged: Any = None  # CUDA event after the last copy out of `staging`


@dataclass
class KVStaging:
    """Gathered KV of attention micro-batches: two buffers, the next one filled while the
    current computes (through the copy engine), or one buffer filled on the compute thread
    when there is no copy engine. `cap_blocks`: blocks one buffer holds (None: grows).
    On CUDA each buffer has a pinned host staging area of its size: the blocks are gathered
    there, copied on the copy stream, and the staging is gathered into again only after
    that copy's event (so the gather of micro-batch j+1 overlaps the copy of j); a buffer is
    refilled only after the compute stream's release of it (waited on by the copy stream)."""

    kv: KVPool
    device: torch.device
    engine: CopyEngine | None = None
    region: Region | None = None
    cap_blocks: int | None = None
    bufs: list[_KVBuf] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.region is not None:
            assert self.cap_blocks is not None
            item = self.kv.k.element_size()
            nk, nv = self.k_elems * self.cap_blocks, self.v_elems * self.cap_blocks
            step = align(nk * item) + align(nv * item)
            self.bufs = [_KVBuf(self.region.view(i * step, (nk,), self.kv.k.dtype, what="KV buffer"),
                                self.region.view(i * step + align(nk * item), (nv,), self.kv.k.dtype,
                                                 what="KV buffer")) for i in range(2)]
            if self.device.type == "cuda":
                for b in self.bufs:
                    b.staging = pinned.host_empty((nk + nv,), self.kv.k.dtype, pin=True, what="KV staging")
                    b.staged = torch.cuda.Event(blocking=True)

    def close(self) -> None:
        for b in self.bufs:
            if b.staged is not None:
                b.staged.synchronize()
            pinned.release(b.staging)
            b.staging = None

    @property
    def k_elems(self) -> int:
        return self.kv.k.shape[1] * self.kv.block_size * self.kv.k.shape[4]  # Hkv * bs * D per block

    @property
    def v_elems(self) -> int:
        return self.kv.v.shape[1] * self.kv.block_size * self.kv.v.shape[4]  # Hkv * bs * Dv per block

    @staticmethod
    def region_bytes(kv: KVPool, cap_blocks: int) -> int:
        """Two buffers of K and V for `cap_blocks` blocks each."""
        item = kv.k.element_size()
        per = kv.k.shape[1] * kv.block_size * cap_blocks * item
        return 2 * (align(per * kv.k.shape[4]) + align(per * kv.v.shape[4]))

    def _shape(self, nb: int, v: bool = False) -> tuple[int, int, int, int]:
        t = self.kv.v if v else self.kv.k
        return (t.shape[1], nb, self.kv.block_size, t.shape[4])  # [Hkv, nb, bs, D]

    def submit(self, key: Any, layer: int, blocks: torch.Tensor) -> None:
        """Start gathering `blocks` of `layer` for `key` into a free buffer (no-op if it
        already is; with no copy engine, nothing happens until `acquire`). guarantees: when
        it raises, no buffer is left claimed."""
        if self.engine is None or any(b.key == key for b in self.bufs):
            return
        free = [b for b in self.bufs if b.key is None]
        if not free:
            return  # both busy: `acquire` fills it when one frees
        buf = free[0]
        nb = blocks.numel()
        if nb > (self.cap_blocks or 0):
            raise ArenaError(f"device arena: a micro-batch needs {nb} KV blocks but a KV buffer holds "
                             f"{self.cap_blocks}; the runtime split micro-batches wrongly")
        nbytes = nb * (self.k_elems + self.v_elems) * self.kv.k.element_size()
        fill = self._filler(buf, layer, blocks)
        # CUDA: the copy stream waits for compute's release of the buffer (`after`), not the host
        ticket = self.engine.submit(f"KV of layer {layer} ({nb} blocks)", nbytes, fill, kind="kv_load", layer=layer,
                                    after=[buf.release])
        buf.key, buf.ticket, buf.release = key, ticket, None  # claimed only once it is queued

    def _filler(self, buf: _KVBuf, layer: int, blocks: torch.Tensor) -> Callable[[], None]:
        """The copy-engine job that gathers `blocks` of `layer` into `buf` (on CUDA through its
        pinned staging and a copy on the lane's stream)."""
        nb = blocks.numel()
        hk = buf.k[:nb * self.k_elems].view(self._shape(nb))  # [Hkv, nb, bs, D] on the compute device
        hv = buf.v[:nb * self.v_elems].view(self._shape(nb, v=True))
        race = self.engine.race if self.engine is not None else None

        def fill() -> None:
            if buf.staging is None:  # a CPU arena: gather straight into it
                self.kv.gather(layer, blocks, hk, hv)
                return
            nk, nv = nb * self.k_elems, nb * self.v_elems
            buf.staged.synchronize()  # the previous copy out of this staging is done
            sk = buf.staging[:nk].view(self._shape(nb))  # [Hkv, nb, bs, D] pinned host
            sv = buf.staging[nk:nk + nv].view(self._shape(nb, v=True))
            self.kv.gather(layer, blocks, sk, sv)
            hk.copy_(sk, non_blocking=True)
            hv.copy_(sv, non_blocking=True)
            buf.staged.record(torch.cuda.current_stream(self.device))
            if race is not None:  # the staging is free once its copy is: poison it then
                buf.staged.synchronize()
                race.poison(buf.staging)

        return fill

    def acquire(self, key: Any, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gathered KV [Hkv, nb, bs, D] x2 for `key` on the compute device."""
        nb = blocks.numel()
        if self.engine is None:  # fill one growing buffer on this thread
            nk, nv = nb * self.k_elems, nb * self.v_elems
            if not self.bufs or self.bufs[0].k.numel() < nk:
                grow = 1.25
                self.bufs = [_KVBuf(torch.empty(int(nk * grow), dtype=self.kv.k.dtype),
                                    torch.empty(int(nv * grow), dtype=self.kv.k.dtype))]
            b = self.bufs[0]
            hk, hv = b.k[:nk].view(self._shape(nb)), b.v[:nv].view(self._shape(nb, v=True))
            self.kv.gather(layer, blocks, hk, hv)
            return hk.to(self.device), hv.to(self.device)
        self.submit(key, layer, blocks)
        buf = next((b for b in self.bufs if b.key == key), None)
        if buf is None:  # both buffers busy: should not happen (one is released per micro-batch)
            raise RuntimeError("KV staging: no free buffer (micro-batch released too late)")
        assert buf.ticket is not None
        buf.ticket.wait()
        return (buf.k[:nb * self.k_elems].view(self._shape(nb)),
                buf.v[:nb * self.v_elems].view(self._shape(nb, v=True)))

    def release(self, key: Any) -> None:
        """Compute is done with `key`'s buffer (on CUDA: once the compute stream passes here)."""
        race = self.engine.race if self.engine is not None else None
        for b in self.bufs:
            if b.key != key:
                continue
            cuda = b.k.is_cuda
            stream = torch.cuda.current_stream(b.k.device) if cuda else None
            if race is not None:
                race.delay(stream)
            if cuda:
                b.release = torch.cuda.Event(blocking=True)
                b.release.record(stream)
            b.key, b.ticket = None, None
            if race is not None:
                self._poison(b, race)

    def _poison(self, b: _KVBuf, race: RaceAmplifier) -> None:
        """Race amplification: a released KV buffer is garbage at once (CUDA: on the copy
        stream, after compute's release; it is refilled after that on the same lane)."""
        if not b.k.is_cuda:
            race.poison(b.k)
            race.poison(b.v)
            return
        assert self.engine is not None
        self.engine.submit("poison KV buffer", 0, lambda: (race.poison(b.k), race.poison(b.v)), after=[b.release])


__all__ = ["ALIGN", "Copier", "InPlaceWeights", "KVStaging", "StreamedWeights", "speculates"]
