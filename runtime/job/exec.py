"""`moecc exec`: run a plan over a JSONL file of requests (moecc's simple form or OpenAI's
Batch API form) and write one result line per request as it finishes.

What a long job can count on:
  * results are appended as each request finishes and handed to the OS at once; the files
    are fsync'ed every few seconds and at exit (job/results.py);
  * a bad request fails alone: it becomes an error record (file, line, field) in the errors
    file and on stderr, the others run, and the summary and exit status say how many failed;
  * `resume=True` continues the job an earlier run started and skips what it already wrote
    (after cutting a torn last line), so a killed job resumed ends with each request once.
    It refuses files another plan (or program) wrote, reruns requests changed since their
    result or error was written, and moves stale and corrupt lines aside, never losing one
    (job/results.py); every file the job writes is locked for its life (job/lock.py);
  * with `handle_signals`, the first Ctrl-C (SIGINT) stops admitting requests and lets those
    in flight finish, a second one (or SIGTERM) stops after the current step; either way the
    finished results are on disk and the job is resumable.
"""

from __future__ import annotations

import gc
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import torch

from moecc_runtime.engine import Engine, generate
from moecc_runtime.job.integrity import verify_sidecar
from moecc_runtime.job.lock import JobFiles, check_distinct, open_job_files
from moecc_runtime.job.progress import Progress
from moecc_runtime.job.paths import PathError, check_file_writable
from moecc_runtime.job.reader import RequestReader
from moecc_runtime.job.requests import iter_identified
from moecc_runtime.job.results import Done, InputKeys, ResultWriter, error_key, plan_identity, resume_scan
from moecc_runtime.job.source import PromptSource, prompt_source
from moecc_runtime.job.writer import JobWriter
from moecc_runtime.plan import PlanError, check_checkpoint, load_plan
from moecc_runtime.scheduler.sequence import GenRequest, GenResult
from moecc_runtime.structured import Grammars
from moecc_runtime.tokenizer import Tokenizer
from moecc_runtime.worker.worker import refuse_unbudgeted_cuda

DEFAULT_MAX_TOKENS = 256
STREAM_SHARD_HINT = 4096  # requests a stream is taken to hold, for the Ray shard size (its total is unknown)


@dataclass
class JobSummary:
    requests: int = 0  # lines with a request (or a bad line) in the input
    succeeded: int = 0
    failed: int = 0
    skipped: int = 0  # already done by an earlier run (resume)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0  # engine time (model load to last step)
    load_seconds: float = 0.0  # of which loading the model (weights read, packed); the rest is the run
    wall_seconds: float = 0.0  # the whole job, reading the input included
    status: str = "done"  # "done" | "interrupted" (stopped early; resumable)
    errors: list[dict[str, Any]] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)  # files whose torn last line was cut on resume
    changed: int = 0  # resume: requests rerun because they changed since their result was written
    retried: int = 0  # resume: error records dropped because their request was fixed or changed since
    corrupt: list[str] = field(default_factory=list)  # resume: "file:line: why" of unreadable lines moved aside
    plan: str = ""  # the plan identity every line of this job records
    engine: dict[str, Any] = field(default_factory=dict)  # EngineStats as plain data

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def unfinished(self) -> int:
        return self.requests - self.succeeded - self.failed - self.skipped

    def report(self) -> str:
        """The end-of-run summary line."""
        text = (f"{self.succeeded} ok, {self.failed} failed" + (f", {self.skipped} already done" if self.skipped else "")
                + (f", {self.unfinished} not run (interrupted; rerun with --resume)" if self.unfinished > 0 else "")
                + f" of {self.requests} requests; tokens in {self.prompt_tokens}, out {self.completion_tokens}; "
                f"wall {self.wall_seconds:.2f}s; {self.tokens_per_second:.1f} tok/s generated")
        if self.changed or self.retried:
            text += f"; {_n(self.changed + self.retried, 'request')} changed since an earlier run, run again"
        if self.corrupt:
            text += f"; {_n(len(self.corrupt), 'corrupt line')} moved aside (first: {self.corrupt[0]})"
        return text


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def pick_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class _Signals:
    """SIGINT: drain (first), stop (second); SIGTERM: stop. Installed only in the main thread."""

    def __init__(self, log: IO[str] | None, enabled: bool):
        self.mode = "run"
        self.log = log
        self._old: dict[int, Any] = {}
        if enabled and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.mode == "run":
            self.mode = "drain"
            msg = "interrupt: admitting no more requests, finishing those in flight (Ctrl-C again to stop now)"
        else:
            self.mode = "stop"
            msg = "stopping after this step; finished results are written (rerun with --resume)"
        if self.log is not None:
            print(f"moecc: {msg}", file=self.log, flush=True)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def run_job(
    plan_path: str | Path,
    prompts_path: str | Path,
    output: IO[str] | str | Path,
    *,
    errors_path: str | Path | None = None,
    model_dir: str | Path | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    device: str | None = None,
    max_batch: int | None = None,
    log: IO[str] | None = sys.stderr,
    stats_path: str | Path | None = None,
    fmt: str = "moecc",
    resume: bool = False,
    progress: str = "quiet",
    handle_signals: bool = False,
    ray: Any = None,
    replan: Callable[[dict[str, Any], Path, torch.device], dict[str, Any] | None] | None = None,
    share_prefixes: bool = True,
) -> JobSummary:
    """Run every request of `prompts_path` through the plan, writing results to `output` (a
    stream, or a path: appended to with `resume`, else replaced) as they finish, in `fmt`
    ("moecc" or "openai"). `progress`: "auto", "rich", "plain" or "quiet". With
    `stats_path`, write the job summary and per-step engine records (JSON). With `ray`
    (distributed.RayOptions), the requests run on a pool of Ray actors instead of here.
    Before any model load: the output and errors files are locked and opened (an unwritable
    one fails at once, naming it) and, with `resume`, checked to be this job's (JobIdentityError
    otherwise, changing nothing).
    `replan(plan, checkpoint dir, device)`: asked (for a local run) before anything is opened;
    a plan it returns runs instead of the file's (the CLI's recompiles a plan without a device
    arena for a CUDA device: moecc/replan.py); the job's identity stays the file's. On CUDA a
    plan without a device arena is refused (PlanError: compile it with --gpu-mem).
    `share_prefixes`: KV blocks of prompt prefixes an earlier request computed are shared
    (False: every prompt is computed whole)."""
    wall0 = time.perf_counter()
    plan = load_plan(plan_path)
    mdir = check_checkpoint(plan, model_dir, plan_path)
    verify_sidecar(plan, mdir, plan_path, log=None if log is None else lambda m: print(m, file=log))
    _check_runnable(plan, plan_path)
    identity = plan_identity(plan, mdir)
    if ray is None:
        dev = pick_device(device)
        new = replan(plan, mdir, dev) if replan is not None else None
        if new is not None:
            plan = new
            _check_runnable(plan, plan_path)
        refuse_unbudgeted_cuda(plan, dev)  # before any file is opened (the engine checks it too)
    planned_B = int(plan["batch"]["decode"]["B"])
    if plan.get("arena") and max_batch is not None and max_batch > planned_B:
        raise PlanError(f"--max-batch {max_batch} exceeds the B={planned_B} the plan sized its device arena for "
                        f"(staging for B + prefill rows); recompile with `moecc compile ... --max-batch {max_batch}`")
    if resume and not isinstance(output, (str, Path)):
        raise ValueError("resume needs the output file's path (results are appended to it)")
    if ray is not None:
        from moecc_runtime.job.distributed import import_ray

        import_ray()  # fail before opening or reading anything when Ray is not installed
    source = prompt_source(prompts_path)  # stdin, a pipe or a FIFO: read once, as it comes (job/source.py)
    if resume:
        source.refuse_resume()  # before anything is opened: resume reads the input twice
    if not source.stream:
        with open(prompts_path, "rb"):
            pass  # a missing or unreadable prompts file fails here, before any output file is created
    out_path = Path(output) if isinstance(output, (str, Path)) else None
    err_path = Path(errors_path) if errors_path else None
    if out_path is not None:
        check_distinct(Path(prompts_path), out_path, err_path)
    if stats_path is not None:  # written at the end: checked now, before any work
        check_file_writable(stats_path, "stats file", "--stats")
    files = open_job_files(out_path, err_path, resume)  # this run owns the files now
    try:
        if source.stream:
            source.open_stream()  # once (a FIFO: waits for its writer); Job.read reads it
        summary = JobSummary(plan=identity)
        done = _resume(files, prompts_path, max_tokens, summary, log) if resume else Done()
        tok = Tokenizer(mdir)
    except BaseException:
        files.abort()
        raise
    out_file = files.out if files.out is not None else output
    writer = ResultWriter(out_file, files.err, fmt, plan=summary.plan,  # type: ignore[arg-type]
                          model=Path(str(plan["model"]["dir"])).name)
    try:
        job = Job(plan, prompts_path, writer, tok, summary, done, log, max_tokens, plan_path=plan_path,
                  share_prefixes=share_prefixes, source=source)
        runner = _run if ray is None else _run_ray
        return runner(job, mdir, wall0, device=device, max_batch=max_batch, stats_path=stats_path,
                      progress=progress, handle_signals=handle_signals, **({} if ray is None else {"options": ray}))
    finally:
        try:
            writer.close()
        finally:
            source.close()
            files.close()


def _check_runnable(plan: dict[str, Any], plan_path: str | Path) -> None:
    """Refuse (PlanError naming the field) plan values the schema's types admit but no job
    can run on: a batch size below 1 (the scheduler would never admit a request), a schedule
    without the head module that yields the logits."""
    for phase in ("prefill", "decode"):
        for key, value in plan["batch"][phase].items():
            if isinstance(value, (int, float)) and value < 1:  # (`attention` is a placement, not a size)
                raise PlanError(f"{plan_path}: plan.batch.{phase}.{key} is {value}, it must be at least 1; "
                                f"this plan is not one moecc compile wrote: recompile it")
    if not any(m["kind"] == "head" for m in plan["schedule"]):
        raise PlanError(f"{plan_path}: plan.schedule has no head module (nothing computes the logits); "
                        f"this plan is not one moecc compile wrote: recompile it")


def _resume(files: JobFiles, prompts_path: str | Path, max_tokens: int, summary: JobSummary,
            log: IO[str] | None) -> Done:
    """Needs: `files` locked and open, `summary.plan` set. Does: checks the output and errors
    files are this job's and drops what no longer stands (results.resume_scan; one extra
    pass over the input for its request hashes), reopens the files, says what it did on
    `log` and in `summary`. Guarantees: JobIdentityError before anything changed when
    another job wrote the files."""
    assert files.output is not None
    inputs = InputKeys.of((item.custom_id, request) for item, request in iter_identified(prompts_path, max_tokens))
    done = _Resumed.of(resume_scan(files.output, files.errors, summary.plan, inputs), inputs)
    files.reopen()
    summary.repaired, summary.changed, summary.retried = done.repaired, done.changed, done.retried
    summary.corrupt = [f"{path}:{line}: {why}" for path, line, why in done.corrupt]
    if log is not None:
        for p in done.repaired:
            print(f"moecc: {p}: cut a torn last line left by an interrupted run", file=log)
        for path, line, why in done.corrupt:
            print(f"moecc: {path}:{line}: corrupt line ({why}), not one moecc exec writes; moved to "
                  f"{done.replaced[path]} (its request, if in the input, runs again)", file=log)
        if done.changed:
            print(f"moecc: {_n(done.changed, 'request')} changed since their results were written; rerunning "
                  f"them (the old results are in {done.replaced[str(files.output)]})", file=log)
        if done.retried:
            print(f"moecc: {_n(done.retried, 'error record')} no longer match a request in {prompts_path} (fixed "
                  f"or changed since); retrying those requests (the old records are in "
                  f"{done.replaced[str(files.errors)]})", file=log)
    return done


@dataclass
class _Resumed(Done):
    """`Done` with the number of input lines a resumed job will skip (`standing`: a result or
    error of the same request stands), counted once from what resume already read, so the
    progress total and an interrupted run's summary need no second pass over the input."""

    standing: int = 0

    @classmethod
    def of(cls, done: Done, inputs: InputKeys) -> "_Resumed":
        # Job.read's skip rule per line: its error_key among the errors that stand, or (a valid
        # line: the first of its custom_id) its result standing with the same request hash
        standing = len(inputs.keys & done.errors) + sum(
            1 for cid, request in done.results.items()
            if inputs.first.get(cid) == request and error_key(cid, request) not in done.errors)
        return cls(**{f.name: getattr(done, f.name) for f in fields(done)}, standing=standing)


class Job:
    """A job as the local runner and the Ray one both see it: its reader (requests in,
    encoded: job/reader.py), its writer (results and errors out: job/writer.py), its progress
    display (job/progress.py), its grammars (structured.Grammars, the one owner of its
    compiler) and its summary, composed here."""

    def __init__(self, plan: dict[str, Any], prompts_path: str | Path, lines: ResultWriter, tok: Tokenizer,
                 summary: JobSummary, done: Done, log: IO[str] | None, max_tokens: int,
                 plan_path: str | Path | None = None, share_prefixes: bool = True,
                 source: PromptSource | None = None):
        self.plan, self.tok, self.summary, self.log, self.max_tokens = plan, tok, summary, log, max_tokens
        self.plan_path = plan_path  # where the plan was read (its quantized weights, if any, are beside it)
        self.share_prefixes = share_prefixes  # the engine shares KV blocks of common prompt prefixes
        source = source if source is not None else prompt_source(prompts_path)
        self.grammars = Grammars(tok, plan)  # built when the first response_format is read
        self.writer = JobWriter(lines, tok, self.grammars, summary, log, source.name)
        self.reader = RequestReader(plan, source, prompts_path, tok, self.grammars, summary, done, max_tokens,
                                    self.writer.fail)
        self.prog: Progress | None = None

    def read(self) -> Iterator[GenRequest]:
        """The requests still to run, encoded, as the runner pulls them (RequestReader.read)."""
        return self.reader.read()

    def start_progress(self, mode: str) -> Progress:
        """The progress display, before the first request is read: its total is the requests
        the reader expects to run; the tokens per request for the ETA start at the default
        max_tokens and follow the running mean of the requests read (Progress.expect)."""
        self.prog = Progress(self.reader.expected(), float(self.max_tokens),
                             self.plan.get("predicted", {}).get("job_tokens_per_s"),
                             mode=mode, stream=self.log or sys.stderr)
        self.reader.prog = self.writer.prog = self.prog
        return self.prog

    def on_finish(self, r: GenResult) -> None:
        """generate's on_finish (once per request, all its completions in `r`): written, then
        the request's bookkeeping dropped."""
        self.writer.finished(r, self.reader.pending[r.key])
        self.reader.forget(r.key)

    def on_error(self, r: GenRequest, message: str) -> None:
        """generate's on_error: the failure written, then the request's bookkeeping dropped."""
        self.writer.failed(r, message, self.reader.pending[r.key])
        self.reader.forget(r.key)

    def settle_counts(self) -> None:
        """Count what an interrupted run did not read (RequestReader.settle_counts)."""
        self.reader.settle_counts()

    def control(self, signals: "_Signals") -> str:
        """What the runner should do now (see generate's `control`), noted on the progress."""
        if signals.mode == "drain" and self.prog is not None and self.prog.note == "":
            self.prog.set_note("interrupted: finishing requests in flight")
        return signals.mode

    def end(self, outcome: str | None, signals: "_Signals", start: float, wall0: float, engine: dict[str, Any],
            stats_path: str | Path | None) -> None:
        """Close the run: status, timings, engine figures, progress, signal handlers, stats file."""
        if outcome != "done":
            self.summary.status = "interrupted"
        signals.restore()
        if self.prog is not None:
            self.prog.close()
        self.summary.seconds = time.perf_counter() - start
        self.summary.wall_seconds = time.perf_counter() - wall0
        self.summary.engine = engine
        if stats_path is not None:
            import json

            try:
                Path(stats_path).write_text(json.dumps(asdict(self.summary), indent=1) + "\n", encoding="utf-8")
            except OSError as e:
                raise PathError(f"cannot write the stats file {stats_path}: {e.strerror or e} (every result is "
                                f"written; only the stats are lost)") from None


@contextmanager
def _gc_frozen() -> Iterator[None]:
    """The objects alive now (the loaded engine, plan, tokenizer: ~200k) out of the garbage
    collector's full passes while the run goes on (each walked them all: 60 ms, a few times a
    job), back in afterwards so a process that runs job after job frees them as before."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _run(job: Job, mdir: Path, wall0: float, *, device: str | None, max_batch: int | None,
         stats_path: str | Path | None, progress: str, handle_signals: bool) -> JobSummary:
    """Run `job` here, on one device. The requests are read as the scheduler admits them
    (Job.read), so the first results come while the input is still being read."""
    prog = job.start_progress(progress)
    requests = job.read()
    signals = _Signals(job.log, handle_signals)
    start = time.perf_counter()
    engine = Engine(job.plan, mdir, pick_device(device), record_steps=stats_path is not None,
                    plan_path=job.plan_path, share_prefixes=job.share_prefixes)
    wave = min((n for n in (prog.total, max_batch) if n is not None), default=None)  # None: the plan's B
    engine.prefault_kv(wave)  # start-up: the first wave's KV pages (--max-batch caps it), before the first step
    job.summary.load_seconds = time.perf_counter() - start

    outcome = None
    try:
        with _gc_frozen():
            outcome = generate(engine, requests, job.on_finish, max_batch=max_batch, on_error=job.on_error,
                               stop_check=job.tok.stop_check, control=lambda: job.control(signals),
                               on_step=prog.step, grammar=job.grammars)
    finally:
        requests.close()  # an interrupted run: the input file is closed now
        job.settle_counts()
        stats = asdict(engine.stats)
        stats["overlap_efficiency"] = engine.stats.overlap_efficiency
        try:
            job.end(outcome, signals, start, wall0, stats, stats_path)
        finally:
            engine.close()
    return job.summary


def _run_ray(job: Job, mdir: Path, wall0: float, *, device: str | None, max_batch: int | None,
             stats_path: str | Path | None, progress: str, handle_signals: bool, options: Any) -> JobSummary:
    """Run `job` on a pool of Ray actors (job/distributed.py); the bookkeeping stays here."""
    from moecc_runtime.job.distributed import run_on_ray

    prog = job.start_progress(progress)
    requests = job.read()  # read lazily, a shard at a time (run_on_ray)
    signals = _Signals(job.log, handle_signals)
    start = time.perf_counter()
    dev = pick_device(device).type
    outcome = None
    try:
        outcome = run_on_ray(job, requests, job.plan, mdir, device=dev, max_batch=max_batch,
                             options=replace(options, share_prefixes=job.share_prefixes),
                             control=lambda: job.control(signals),
                             total=prog.total if prog.total is not None else STREAM_SHARD_HINT)
    finally:
        requests.close()
        job.settle_counts()
        job.end(outcome, signals, start, wall0, {"ray": {"address": options.address, "workers": options.workers}},
                stats_path)
    return job.summary
