"""The measured timeline of one worker step: what the compute thread and the copy engine did,
job by job, in the same rows the planner's predicted timeline uses
([name, lane, kind, layer, start_s, seconds], start relative to the step's start), so
`moecc explain --timeline --measured stats.json` draws them one above the other.

The worker keeps one decode step (the first at the largest batch seen, past the first steps)
and one prefill step (the first past the warm-up that is at least 90% prompt tokens); see
`pick_trace`. Recording costs two perf_counter calls per job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class StepTrace:
    """Jobs of one step as they run. Lists append atomically, so the copy engine's thread
    records into the same trace."""

    phase: str
    step: int
    t0: float = field(default_factory=time.perf_counter)
    jobs: list[list[Any]] = field(default_factory=list)

    def add(self, name: str, lane: str, kind: str, layer: int | None, start: float, end: float) -> None:
        self.jobs.append([name, lane, kind, layer, start - self.t0, end - start])

    def copy_done(self, ticket: Any, start: float, end: float) -> None:
        """A copy-engine transfer finished (called on the engine's thread); bookkeeping jobs
        (no kind: drains, cached slots) are not drawn."""
        if ticket.kind is not None and end > self.t0:
            self.add(ticket.what, "copy", ticket.kind, ticket.layer, max(start, self.t0), end)

    def experts(self, it: Iterator[Any], layer: int | None, used: list[int]) -> Iterator[Any]:
        """Wrap an expert-weights iterator: the time between handing out expert e's weights
        and being asked for the next is expert e's compute (where experts run one by one; a
        layer run as one call is recorded as one job by the worker instead)."""
        k = 0
        for w in it:
            t = time.perf_counter()
            yield w
            self.add(f"L{layer}.expert.{used[k] if k < len(used) else k}", "compute", "gemm", layer, t,
                     time.perf_counter())
            k += 1

    def finish(self, seconds: float, sequences: int, tokens: int, prefill_tokens: int, context: float = 0.0,
               head_rows: int = 0) -> dict[str, Any]:
        """The step as plain data: its shape (sequences, rows, prompt rows, the mean context a
        sequence's rows attend to, rows reaching the head) and its jobs in start order."""
        jobs = sorted(self.jobs, key=lambda j: (j[4], j[1]))
        return {"step": self.step, "step_s": seconds, "sequences": sequences, "tokens": tokens,
                "prefill_tokens": prefill_tokens, "context": context, "head_rows": head_rows, "jobs": jobs,
                "layers": 1 + max((j[3] for j in jobs if j[3] is not None), default=-1)}


def pick_trace(kept: dict[str, Any] | None, phase: str, step_no: int, tokens: int, prefill_tokens: int,
               sequences: int, t0: float) -> StepTrace | None:
    """A trace for step `step_no` when it ranks above `kept`, the phase's step kept so far
    (as `StepTrace.finish` wrote it; None: none yet). Prefill steps rank by (past the first
    step, which pays first touches, and >= 90% prompt tokens; then the prompt share),
    decode-only steps by (past the first two steps; then sequences: the first step at the
    largest batch); a decode step with prompt tokens is never traced."""
    if phase == "prefill":
        share = prefill_tokens / max(1, tokens)
        rank = (step_no > 1 and share >= 0.9, share)
        old = (kept["step"] > 1 and kept["prefill_tokens"] >= 0.9 * kept["tokens"],
               kept["prefill_tokens"] / max(1, kept["tokens"])) if kept else None
    else:
        if prefill_tokens:
            return None
        rank = (step_no > 2, sequences)
        old = (kept["step"] > 2, kept["sequences"]) if kept else None
    return StepTrace(phase, step_no, t0) if old is None or rank > old else None
