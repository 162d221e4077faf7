"""The copy engine: runs the plan's transfers (weights into slots, KV into micro-batch
buffers) ahead of the compute that needs them, on worker threads of its own.

Two lanes, each a FIFO queue with its own thread (and on CUDA its own copy stream), so the
copies compute needs first are not queued behind others:
  * "urgent": the experts the router just chose (memory/streaming.py StreamedWeights.experts);
  * "normal": everything else, in submission order: the next module's dense weights, the
    next micro-batch's (or layer's) KV gather (a host index_select, then its copy), experts
    fetched ahead of routing, resident weights at start-up.
A job may depend on tickets of either lane (`submit(deps=...)`: the previous fill of the slot
it overwrites); dependencies only point back in time, so the lanes cannot deadlock. A ticket
not yet started can be cancelled (`Ticket.cancel`: an expert fetched ahead of routing that no
row chose): it is done at once and its copy never runs.

On CUDA a job stages host bytes into pinned memory (or DMAs straight from pinned weights) and
enqueues the host->device copies on its lane's stream; the engine records an event after them
and goes on to the next job without waiting, so consecutive transfers run back to back on the
stream. A ticket's `wait()` makes the *compute stream* wait for that event (no host
synchronize). A job may name events it must come after (`submit(after=...)`: the compute
stream's release of the slot it overwrites); the copy stream waits for those on the device. On
a CPU the workers copy into the (host) arena directly.

`DeviceToHost` is the other direction on CUDA: module outputs and new K/V copied into pinned
host memory on a stream of their own, each batch of copies closed by an event that whoever
reads the host copy waits on.

Race amplification (`RaceAmplifier`; MOECC_RACE_AMPLIFY=1 or `CopyEngine(race=True)`), for
tests: a random delay before every copy (on CUDA also a spin kernel on the copy stream,
torch.cuda._sleep) and on every release (on CUDA on the compute stream, before the release
event), and slots, KV buffers and staging poisoned (0xFF bytes: NaN in every float dtype) as
soon as they are free, so a missing wait or an early release changes the tokens instead of
passing by luck.

Accounting: `copy_s` is the engines' busy time summed over the lanes (on CUDA: each copy
stream's time from each job's start to its end, timed by CUDA events), `wait_s` the time
compute spent blocked on tickets (on CUDA: the host waiting for a job to be enqueued plus the
compute stream's stalls at `wait_event`, timed by events around it); the share of copy time
hidden behind compute is 1 - wait_s / copy_s. On CUDA a recorded step timeline's copy lane
shows when each job was staged and enqueued by the host (as its compute lane shows kernel
launches), not the DMA itself; a torch.profiler trace shows that (bench/gpu_offload_check.py).
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

LANES = ("normal", "urgent")


class CopyError(Exception):
    """A transfer failed; names what was being copied."""


class Ticket:
    """One submitted transfer: `wait()` blocks until it is enqueued (CPU: done), makes the
    compute stream wait for it on CUDA, and re-raises its failure. `end` (CUDA) is the event
    after its copies, kept, so a later user of what it filled (a cached slot) waits on it too."""

    def __init__(self, engine: "CopyEngine", what: str, nbytes: int, kind: str | None = None,
                 layer: int | None = None, lane: str = "normal"):
        self.engine = engine
        self.what = what
        self.nbytes = nbytes
        self.kind = kind  # on the step timeline: "fetch" | "kv_load"; None: bookkeeping, not drawn
        self.layer = layer
        self.lane = lane
        self.state = "queued"  # -> "running" -> "done", or "skipped" (cancelled before it ran)
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.end: Any = None  # torch.cuda.Event on CUDA, once enqueued

    def wait(self) -> None:
        if not self._done.is_set():
            t0 = time.perf_counter()
            self._done.wait()
            self.engine._add("_wait_s", time.perf_counter() - t0)
        if self._error is not None:
            err = self._error
            if isinstance(err, CopyError):
                raise err
            raise CopyError(f"copy engine: transfer of {self.what} failed: {err}") from err
        if self.end is not None:
            self.engine.stream_wait(self.end)

    def cancel(self) -> bool:
        """Drop the transfer if it has not started: True when it will never run (it is done
        now and filled nothing); False when it is running or ran."""
        with self.engine._lock:
            if self.state != "queued":
                return False
            self.state = "skipped"
        self._done.set()
        return True

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def skipped(self) -> bool:
        return self.state == "skipped"


@dataclass
class _Job:
    ticket: Ticket
    fn: Callable[[], None]  # does the copy (on CUDA: enqueues it on the lane's copy stream)
    after: list[Any] = field(default_factory=list)  # CUDA events the copy stream waits for first
    deps: list[Ticket] = field(default_factory=list)  # tickets (either lane) that must have run first


class RaceAmplifier:
    """Random delays and poisoned free memory (see the module docstring). Thread-safe."""

    def __init__(self, seed: int | None = None, max_delay_s: float = 0.0015, max_cycles: int = 2_000_000):
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.max_delay_s = max_delay_s
        self.max_cycles = max_cycles
        self.poisoned = 0  # buffers poisoned so far (tests check the mode did something)

    @staticmethod
    def from_env() -> "RaceAmplifier | None":
        if os.environ.get("MOECC_RACE_AMPLIFY", "") not in ("1", "true", "yes"):
            return None
        seed = os.environ.get("MOECC_RACE_SEED")
        return RaceAmplifier(int(seed) if seed else None)

    def _u(self) -> float:
        with self._lock:
            return self._rng.random()

    def delay(self, stream: Any = None) -> None:
        """Sleep a random while on the host; with a real CUDA `stream`, also spin on it."""
        time.sleep(self._u() * self.max_delay_s)
        if stream is not None and _real_cuda():
            with torch.cuda.stream(stream):
                torch.cuda._sleep(int(self._u() * self.max_cycles))

    def poison(self, t: torch.Tensor | None) -> None:
        """Fill `t`'s bytes with 0xFF (NaN in fp32/fp16/bf16): on its device's current stream."""
        if t is None or t.numel() == 0:
            return
        t.view(-1).view(torch.uint8).fill_(0xFF)
        with self._lock:
            self.poisoned += 1


def _real_cuda() -> bool:
    try:
        return bool(torch.cuda.is_available()) and hasattr(torch.cuda, "_sleep")
    except Exception:
        return False


@dataclass
class _Lane:
    name: str
    q: "queue.SimpleQueue[_Job | None]"
    stream: Any
    thread: threading.Thread | None = None


class CopyEngine:
    def __init__(self, device: torch.device, race: "bool | RaceAmplifier | None" = None):
        """`race`: True (or a RaceAmplifier) for race amplification; None: MOECC_RACE_AMPLIFY decides."""
        self.device = _indexed(torch.device(device))
        self.cuda = self.device.type == "cuda"
        self.race: RaceAmplifier | None = (RaceAmplifier() if race is True else race if race else None) \
            if race is not None else RaceAmplifier.from_env()
        self._copy_s = 0.0  # worker busy time (CUDA: harvested from `_timed`)
        self._wait_s = 0.0  # compute blocked on tickets (CUDA: plus stalls harvested from `_stalls`)
        self.bytes = 0
        self.copies = 0
        self.trace: Any = None  # a timeline.StepTrace recording this step's copies, if any
        self._timed: deque[tuple[Any, Any]] = deque()  # CUDA: (start, end) events of each job
        self._stalls: deque[tuple[Any, Any]] = deque()  # CUDA: events around each compute-stream wait
        self._harvest_lock = threading.Lock()
        self._lock = threading.Lock()  # ticket states and the counters
        self.lanes: dict[str, _Lane] = {}
        for name in LANES:
            stream = (torch.cuda.Stream(self.device, priority=-1 if name == "urgent" else 0)
                      if self.cuda else None)
            lane = self.lanes[name] = _Lane(name, queue.SimpleQueue(), stream)
            lane.thread = threading.Thread(target=self._work, args=(lane,), name=f"moecc-copy-{name}", daemon=True)
            lane.thread.start()
        self.stream = self.lanes["normal"].stream  # the normal lane's (what most copies use)

    @property
    def copy_s(self) -> float:
        self._harvest()
        return self._copy_s

    @property
    def wait_s(self) -> float:
        self._harvest()
        return self._wait_s

    def _add(self, total: str, x: float) -> None:
        with self._lock:
            setattr(self, total, getattr(self, total) + x)

    def _harvest(self) -> None:
        """CUDA: add the timed spans whose events have completed (in order; the rest later)."""
        if not self.cuda:
            return
        with self._harvest_lock:
            for q, total in ((self._timed, "_copy_s"), (self._stalls, "_wait_s")):
                while q and q[0][1].query():
                    a, b = q.popleft()
                    self._add(total, a.elapsed_time(b) / 1000.0)

    def stream_wait(self, event: Any) -> None:
        """CUDA: make the current (compute) stream wait for `event`, timing the stall."""
        s = torch.cuda.current_stream(self.device)
        before = torch.cuda.Event(enable_timing=True)
        before.record(s)
        s.wait_event(event)
        after = torch.cuda.Event(enable_timing=True)
        after.record(s)
        self._stalls.append((before, after))

    def submit(self, what: str, nbytes: int, fn: Callable[[], None], kind: str | None = None,
               layer: int | None = None, after: list[Any] | None = None, lane: str = "normal",
               deps: list[Ticket | None] | None = None) -> Ticket:
        """Queue `fn` (which copies `nbytes` for `what`) on `lane`; a lane runs its jobs in
        submission order. `kind` and `layer` place the transfer on a recorded step timeline.
        `after`: CUDA events (recorded on the compute stream) the copy must not start before;
        the copy stream waits for them on the device, the host does not. `deps`: earlier
        tickets (of either lane) whose copies must come first."""
        if lane not in self.lanes:
            raise ValueError(f"copy engine: lane {lane!r}: one of {', '.join(LANES)}")
        t = Ticket(self, what, nbytes, kind, layer, lane)
        self.lanes[lane].q.put(_Job(t, fn, [e for e in (after or []) if e is not None],
                                    [d for d in (deps or []) if d is not None and d.state != "skipped"]))
        return t

    def _work(self, lane: _Lane) -> None:
        if self.cuda and self.device.index is not None:
            torch.cuda.set_device(self.device)  # this thread's current device: the engine's
        while True:
            job = lane.q.get()
            if job is None:
                return
            with self._lock:
                if job.ticket.state == "skipped":
                    continue
                job.ticket.state = "running"
            for dep in job.deps:  # enqueued (CUDA) / done (CPU) before this job starts
                dep._done.wait()
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():  # the worker's mode (thread-local): its tensors are inference tensors
                    self._run(job, lane)
                with self._lock:
                    self.bytes += job.ticket.nbytes
                    self.copies += 1
            except BaseException as e:  # handed to whoever waits on the ticket
                job.ticket._error = e
            t1 = time.perf_counter()
            if not self.cuda:
                self._add("_copy_s", t1 - t0)
            trace = self.trace
            if trace is not None:
                trace.copy_done(job.ticket, t0, t1)
            job.ticket.state = "done"
            job.ticket._done.set()

    def _run(self, job: _Job, lane: _Lane) -> None:
        """One job's copies: on CUDA enqueued on the lane's stream behind its events and deps."""
        if not self.cuda:
            if self.race is not None and job.ticket.nbytes:
                self.race.delay()
            job.fn()
            return
        stream = lane.stream
        with torch.cuda.stream(stream):
            for ev in job.after:  # on the device: the host goes on staging
                stream.wait_event(ev)
            for dep in job.deps:
                if dep.end is not None and dep.lane != lane.name:  # same lane: the stream orders them
                    stream.wait_event(dep.end)
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            if self.race is not None and job.ticket.nbytes:
                self.race.delay(stream)
            job.fn()  # enqueues its copies (staging through pinned buffers, memory/streaming.py)
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
        job.ticket.end = end  # no synchronize: the next job's copies queue right behind
        self._timed.append((start, end))

    def drain(self) -> None:
        """Wait for every queued transfer (at the end of a job, or before tearing down)."""
        tickets = [self.submit("drain", 0, lambda: None, lane=name) for name in self.lanes]
        for t in tickets:
            t._done.wait()
        for lane in self.lanes.values():
            if lane.stream is not None:
                lane.stream.synchronize()  # the enqueued copies themselves

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.q.put(None)
        for lane in self.lanes.values():
            if lane.thread is not None:
                lane.thread.join(timeout=30)


def _indexed(device: torch.device) -> torch.device:
    """A CUDA device with its index (the current device's when none is given), so every stream,
    event and thread of the engine is on the same device; others as they are."""
    if device.type != "cuda" or device.index is not None:
        return device
    try:
        return torch.device("cuda", torch.cuda.current_device())
    except Exception:  # no CUDA (the fake-CUDA tests)
        return device


class DeviceToHost:
    """CUDA: device->host copies on a dedicated stream into pinned host memory, each batch
    closed by an event. The stream first waits for the compute stream (the values are
    computed); each source is marked used on this stream, so the caching allocator does not
    hand its memory to compute before the copy has read it. Readers wait on the event:
    `event.synchronize()` before the host reads the copy, or the compute stream's
    `wait_event` before a copy back to the device."""

    def __init__(self, device: torch.device):
        self.device = _indexed(torch.device(device))
        self.stream = torch.cuda.Stream(self.device)
        self.bytes = 0
        self.copies = 0

    def start(self, *xs: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
        """Fresh pinned host copies of `xs` (from torch's caching pinned allocator) and the
        event after which they hold the values."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        outs = []
        with torch.cuda.stream(self.stream):
            for x in xs:
                h = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                h.copy_(x, non_blocking=True)
                x.record_stream(self.stream)
                outs.append(h)
                self.bytes += x.numel() * x.element_size()
            ev = torch.cuda.Event(blocking=True)
            ev.record(self.stream)
        self.copies += 1
        return outs, ev

    def into(self, dst: torch.Tensor, x: torch.Tensor) -> Any:
        """Copy device `x` into the pinned host view `dst` (same shape); the event after which
        `dst` holds it."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(x, non_blocking=True)
            x.record_stream(self.stream)
            ev = torch.cuda.Event(blocking=True)
            ev.record(self.stream)
        self.bytes += x.numel() * x.element_size()
        self.copies += 1
        return ev

    def synchronize(self) -> None:
        self.stream.synchronize()
