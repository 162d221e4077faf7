"""The copy engine: runs the plan's transfers (weights into slots, KV into micro-batch
buffers) ahead of the compute that needs them, on its own worker thread.

On CUDA a job stages host bytes into pinned memory and enqueues the host->device copies on
the engine's copy stream; the engine records an event after them and goes on to the next job
without waiting, so consecutive transfers run back to back on the stream. A ticket's
`wait()` makes the *compute stream* wait for that event (no host synchronize). A job may
name events it must come after (`submit(after=...)`: the compute stream's release of the
slot it overwrites); the copy stream waits for those on the device. On a CPU the worker
copies into the (host) arena directly.

`DeviceToHost` is the other direction on CUDA: module outputs and new K/V copied into pinned
host memory on a stream of their own, each batch of copies closed by an event that whoever
reads the host copy waits on.

Accounting: `copy_s` is the engine's busy time (on CUDA: the copy stream's time from each
job's start to its end, timed by CUDA events), `wait_s` the time compute spent blocked on
tickets (on CUDA: the host waiting for a job to be enqueued plus the compute stream's
stalls at `wait_event`, timed by events around it); the share of copy time hidden behind
compute is 1 - wait_s / copy_s. On CUDA a recorded step timeline's copy lane shows when each
job was staged and enqueued by the host (as its compute lane shows kernel launches), not the
DMA itself; a torch.profiler trace shows that (bench/gpu_offload_check.py).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


class CopyError(Exception):
    """A transfer failed; names what was being copied."""


class Ticket:
    """One submitted transfer: `wait()` blocks until it is done (on CUDA: makes the compute
    stream wait for it) and re-raises its failure."""

    def __init__(self, engine: "CopyEngine", what: str, nbytes: int, kind: str | None = None,
                 layer: int | None = None):
        self.engine = engine
        self.what = what
        self.nbytes = nbytes
        self.kind = kind  # on the step timeline: "fetch" | "kv_load"; None: bookkeeping, not drawn
        self.layer = layer
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._event: Any = None  # torch.cuda.Event on CUDA

    def wait(self) -> None:
        if not self._done.is_set():
            t0 = time.perf_counter()
            self._done.wait()
            self.engine._wait_s += time.perf_counter() - t0
        if self._error is not None:
            err = self._error
            if isinstance(err, CopyError):
                raise err
            raise CopyError(f"copy engine: transfer of {self.what} failed: {err}") from err
        if self._event is not None:
            self.engine.stream_wait(self._event)
            self._event = None

    @property
    def done(self) -> bool:
        return self._done.is_set()


@dataclass
class _Job:
    ticket: Ticket
    fn: Callable[[], None]  # does the copy (on CUDA: enqueues it on the copy stream)
    after: list[Any] = field(default_factory=list)  # CUDA events the copy stream waits for first


class CopyEngine:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._copy_s = 0.0  # worker busy time (CUDA: harvested from `_timed`)
        self._wait_s = 0.0  # compute blocked on tickets (CUDA: plus stalls harvested from `_stalls`)
        self.bytes = 0
        self.copies = 0
        self.trace: Any = None  # a timeline.StepTrace recording this step's copies, if any
        self._timed: deque[tuple[Any, Any]] = deque()  # CUDA: (start, end) events of each job
        self._stalls: deque[tuple[Any, Any]] = deque()  # CUDA: events around each compute-stream wait
        self._harvest_lock = threading.Lock()
        self._q: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="moecc-copy", daemon=True)
        self._thread.start()

    @property
    def copy_s(self) -> float:
        self._harvest()
        return self._copy_s

    @property
    def wait_s(self) -> float:
        self._harvest()
        return self._wait_s

    def _harvest(self) -> None:
        """CUDA: add the timed spans whose events have completed (in order; the rest later)."""
        if not self.cuda:
            return
        with self._harvest_lock:
            for q, total in ((self._timed, "_copy_s"), (self._stalls, "_wait_s")):
                while q and q[0][1].query():
                    a, b = q.popleft()
                    setattr(self, total, getattr(self, total) + a.elapsed_time(b) / 1000.0)

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
               layer: int | None = None, after: list[Any] | None = None) -> Ticket:
        """Queue `fn` (which copies `nbytes` for `what`); transfers run in submission order.
        `kind` and `layer` place the transfer on a recorded step timeline. `after`: CUDA
        events (recorded on the compute stream) the copy must not start before; the copy
        stream waits for them on the device, the host does not."""
        t = Ticket(self, what, nbytes, kind, layer)
        self._q.put(_Job(t, fn, [e for e in (after or []) if e is not None]))
        return t

    def _work(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                if self.cuda:
                    assert self.stream is not None
                    with torch.cuda.stream(self.stream):
                        for ev in job.after:  # on the device: the host goes on staging
                            self.stream.wait_event(ev)
                        start = torch.cuda.Event(enable_timing=True)
                        start.record(self.stream)
                        job.fn()  # enqueues its copies (staging through pinned buffers, memory/streaming.py)
                        end = torch.cuda.Event(enable_timing=True)
                        end.record(self.stream)
                    job.ticket._event = end  # no synchronize: the next job's copies queue right behind
                    self._timed.append((start, end))
                else:
                    job.fn()
                self.bytes += job.ticket.nbytes
                self.copies += 1
            except BaseException as e:  # handed to whoever waits on the ticket
                job.ticket._error = e
            t1 = time.perf_counter()
            if not self.cuda:
                self._copy_s += t1 - t0
            trace = self.trace
            if trace is not None:
                trace.copy_done(job.ticket, t0, t1)
            job.ticket._done.set()

    def drain(self) -> None:
        """Wait for every queued transfer (at the end of a job, or before tearing down)."""
        t = self.submit("drain", 0, lambda: None)
        t._done.wait()
        if self.stream is not None:
            self.stream.synchronize()  # the enqueued copies themselves

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)


class DeviceToHost:
    """CUDA: device->host copies on a dedicated stream into pinned host memory, each batch
    closed by an event. The stream first waits for the compute stream (the values are
    computed); each source is marked used on this stream, so the caching allocator does not
    hand its memory to compute before the copy has read it. Readers wait on the event:
    `event.synchronize()` before the host reads the copy, or the compute stream's
    `wait_event` before a copy back to the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
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
            ev = torch.cuda.Event()
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
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.bytes += x.numel() * x.element_size()
        self.copies += 1
        return ev

    def synchronize(self) -> None:
        self.stream.synchronize()
