"""Progress of a job on stderr: a live rich display on a terminal, a plain line every
`interval` seconds otherwise, nothing with quiet.

The ETA starts from the plan's predicted job rate (tokens/s) and moves to the measured one
as the run goes: rate = (predicted * PRIOR_S + measured * elapsed) / (PRIOR_S + elapsed),
so after PRIOR_S seconds measurement weighs as much as the prediction, and soon dominates.
Remaining work is the requests not yet started times the tokens a finished request took on
average (before any finished: the running mean max_tokens of the requests read so far, as
`expect` reports them: a job reads its input as it runs, never holding the whole list), plus
what the requests in flight have left: their max_tokens less what they generated, scaled by
the share of max_tokens finished requests used, and never below what they would still take
at that share (so a long request running alone never reads ETA 0:00:00).
A total of None (a stream: stdin, a pipe) shows counts and rates, and no ETA.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

PRIOR_S = 30.0  # seconds of measurement that weigh as much as the plan's prediction


def _clock(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "--:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    def __init__(self, total: int | None, expected_tokens: float, predicted_rate: float | None, *,
                 mode: str = "auto", stream: IO[str] | None = None, interval: float = 10.0):
        """total: requests to run (None: unknown, a stream); expected_tokens: their mean max_tokens (a prior, see
        expect); predicted_rate:
        the plan's job tokens/s; mode: "auto" (rich on a terminal, else plain), "rich",
        "plain" or "quiet"."""
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "rich" if getattr(self.stream, "isatty", lambda: False)() else "plain"
        self.mode = mode
        self.total, self.expected = total, max(1.0, expected_tokens)
        self._expect_n, self._expect_sum = 0, 0  # max_tokens of the requests read so far (expect)
        self._open, self._open_cap = 0, 0  # requests read and not finished, and their max_tokens summed
        self.finished_caps = 0  # max_tokens summed over the requests finished ok
        self.predicted = predicted_rate if predicted_rate and predicted_rate > 0 else None
        self.interval = interval
        self.ok = self.failed = self.tokens = self.finished_tokens = self.inflight = 0
        self.start = time.monotonic()
        self._last_line = self.start
        self.note = ""
        self._live: Any = None
        if self.mode == "rich":
            try:
                self._start_rich()
            except ImportError:
                self.mode = "plain"

    # -- events -----------------------------------------------------------------------------
    def step(self, tokens: int, inflight: int) -> None:
        self.tokens += tokens
        self.inflight = inflight
        self._show()

    def request(self, ok: bool, tokens: int = 0, cap: int | None = None) -> None:
        """A request finished (`ok`) or failed, with `tokens` generated; `cap`: the max_tokens
        `expect` was given for it (None: it was never read as a request, e.g. a bad line)."""
        if ok:
            self.ok += 1
            self.finished_tokens += tokens
        else:
            self.failed += 1
        if cap is not None:
            self._open = max(0, self._open - 1)
            self._open_cap = max(0, self._open_cap - cap)
            if ok:
                self.finished_caps += cap
        self._show()

    def expect(self, max_tokens: int) -> None:
        """One more request read: its max_tokens joins the running mean the ETA uses before
        any request finished (the constructor's `expected_tokens` until the first)."""
        self._expect_n += 1
        self._expect_sum += max_tokens
        self.expected = max(1.0, self._expect_sum / self._expect_n)
        self._open += 1
        self._open_cap += max_tokens

    def set_total(self, total: int | None) -> None:
        """The requests to run, when it is known better than at the start (the input read)."""
        if total != self.total:
            self.total = total
            if self.mode == "rich" and self._live is not None:
                self._rich.update(self._task, total=None if total is None else max(1, total))

    def log(self, text: str) -> None:
        """A message line (an error record, a warning) printed above the live display."""
        if self.mode == "rich" and self._live is not None:
            self._rich.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def set_note(self, note: str) -> None:
        self.note = note
        self._show(force=True)

    # -- figures ----------------------------------------------------------------------------
    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def rate(self) -> float | None:
        """Tokens/s for the ETA: the prediction, blended into measurement as time passes."""
        t = self.elapsed
        measured = self.tokens / t if t > 0 and self.tokens else None
        if self.predicted is None:
            return measured
        if measured is None:
            return self.predicted
        return (self.predicted * PRIOR_S + measured * t) / (PRIOR_S + t)

    def eta(self) -> float | None:
        """Seconds left (None: unknown total, or no rate yet); see the module docstring."""
        if self.total is None:
            return None
        left = self.total - self.ok - self.failed
        if left <= 0:
            return 0.0
        rate = self.rate()
        return self.tokens_left(left) / rate if rate else None

    def tokens_left(self, left: int) -> float:
        """Tokens still to generate for `left` unfinished requests, those in flight included."""
        per = self.finished_tokens / self.ok if self.ok else self.expected
        share = self.finished_tokens / self.finished_caps if self.finished_caps else 1.0
        unstarted = max(0, left - self._open)
        done_open = max(0, min(self.tokens - self.finished_tokens, self._open_cap))  # generated by those in flight
        open_left = max(self._open_cap * share - done_open, (self._open_cap - done_open) * share)
        return unstarted * per + max(0.0, open_left)

    def line(self) -> str:
        t = self.elapsed
        done = self.ok + self.failed
        rates = f"{self.tokens} tokens, {self.tokens / t if t > 0 else 0.0:.1f} tok/s, {self.inflight} in flight"
        if self.total is None:
            text = (f"{done} requests done ({self.failed} failed), {done / t if t > 0 else 0.0:.1f} req/s, {rates}, "
                    f"elapsed {_clock(t)}; total unknown until the input ends")
        else:
            text = (f"{done}/{self.total} requests ({self.failed} failed), {rates}, "
                    f"elapsed {_clock(t)}, ETA {_clock(self.eta())}")
        return text + (f"; {self.note}" if self.note else "")

    # -- display ----------------------------------------------------------------------------
    def _start_rich(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress as RichProgress, TextColumn

        self._rich = RichProgress(TextColumn("moecc"), BarColumn(), TextColumn("{task.description}"),
                                  console=Console(file=self.stream), transient=False, refresh_per_second=4)
        self._task = self._rich.add_task(self.line(), total=None if self.total is None else max(1, self.total))
        self._rich.start()
        self._live = self._rich

    def _show(self, force: bool = False) -> None:
        if self.mode == "quiet":
            return
        if self.mode == "rich" and self._live is not None:
            self._rich.update(self._task, completed=self.ok + self.failed, description=self.line())
            return
        now = time.monotonic()
        if force or now - self._last_line >= self.interval:
            self._last_line = now
            print(f"moecc: {self.line()}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._rich.update(self._task, completed=self.ok + self.failed, description=self.line())
            self._rich.stop()
            self._live = None
