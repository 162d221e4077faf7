"""The copy engine: runs the plan's transfers (weights into slots, KV into micro-batch
buffers) ahead of the compute that needs them, on its own worker thread.

On CUDA the worker stages host bytes into pinned memory and issues the host->device copy
on a side stream, recording an event the compute stream waits on; a slot is overwritten
only after the compute that used it has passed the release event recorded on the compute
stream. On a CPU the worker copies into the (host) arena directly.

Accounting: `copy_s` is the worker's busy time, `wait_s` the time compute spent blocked
on a ticket; the share of copy time hidden behind compute is 1 - wait_s / copy_s.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
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
            self.engine.wait_s += time.perf_counter() - t0
        if self._error is not None:
            err = self._error
            if isinstance(err, CopyError):
                raise err
            raise CopyError(f"copy engine: transfer of {self.what} failed: {err}") from err
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            self._event = None

    @property
    def done(self) -> bool:
        return self._done.is_set()


@dataclass
class _Job:
    ticket: Ticket
    fn: Callable[[], None]  # does the copy (on CUDA: enqueues it on the copy stream)


class CopyEngine:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.copy_s = 0.0  # worker busy time
        self.wait_s = 0.0  # compute blocked on tickets
        self.bytes = 0
        self.copies = 0
        self.trace: Any = None  # a timeline.StepTrace recording this step's copies, if any
        self._q: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="moecc-copy", daemon=True)
        self._thread.start()

    def submit(self, what: str, nbytes: int, fn: Callable[[], None], kind: str | None = None,
               layer: int | None = None) -> Ticket:
        """Queue `fn` (which copies `nbytes` for `what`); transfers run in submission order.
        `kind` and `layer` place the transfer on a recorded step timeline."""
        t = Ticket(self, what, nbytes, kind, layer)
        self._q.put(_Job(t, fn))
        return t

    def _work(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                if self.cuda:
                    with torch.cuda.stream(self.stream):
                        job.fn()
                        ev = torch.cuda.Event()
                        ev.record(self.stream)
                    ev.synchronize()  # busy time covers the copy itself, not just its launch
                    job.ticket._event = ev
                else:
                    job.fn()
                self.bytes += job.ticket.nbytes
                self.copies += 1
            except BaseException as e:  # handed to whoever waits on the ticket
                job.ticket._error = e
            t1 = time.perf_counter()
            self.copy_s += t1 - t0
            trace = self.trace
            if trace is not None:
                trace.copy_done(job.ticket, t0, t1)
            job.ticket._done.set()

    def drain(self) -> None:
        """Wait for every queued transfer (at the end of a job, or before tearing down)."""
        t = self.submit("drain", 0, lambda: None)
        t._done.wait()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)
