"""The batch runner: one thread per device that moves batches through their lifecycle and
runs their parts, one at a time, in a worker process (worker.py), so the HTTP event loop
never waits on the engine.

Needs: the store, the blobs, the served models. Does, for the batch `Store.next_batch`
names: validating → split (batches.split) → in_progress; each part through the worker,
counting its result and error lines as they are appended (request_counts, tokens/s and
ETA live); all parts done → finalizing → merged output and error files → completed. A
cancel stops the worker after its current step → cancelled, with what finished; a batch
past its expires_at → expired (its unfinished requests as `batch_expired` error lines); an
input that is not JSONL → failed with `errors`. Guarantees: every step can be redone after
a crash (split is published atomically, parts resume, the merge commits its files and the
final status in one transaction), so a killed server resumed finishes each batch with each
request exactly once.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from moecc.serve.batches import BatchInvalid, LiveCount, Manifest, PREFLIGHT, merge, split
from moecc.serve.blobs import Blobs
from moecc.serve.config import ServeConfig
from moecc.serve.plans import ServedModel
from moecc.serve.store import Store, new_id, now

POLL_S = 0.25  # how often a running part's files and the batch's status are looked at
MAX_CRASHES = 3  # worker deaths on one part (not asked for) before its batch fails


def pause_for_test(stage: str) -> None:
    """Fault injection for the crash tests: sleep at `stage` ("finalizing": the status set,
    nothing merged; "commit": the merged files published, their rows not yet inserted) when
    MOECC_SERVE_PAUSE names it, as "STAGE=SECONDS"."""
    want, _, seconds = os.environ.get("MOECC_SERVE_PAUSE", "").partition("=")
    if want == stage:
        time.sleep(float(seconds or 0))


class WorkerProc:
    """The worker process: started on first use, one job at a time, answers on a queue."""

    def __init__(self, threads: int | None) -> None:
        self.threads = threads
        self.proc: subprocess.Popen[str] | None = None
        self.ready = False
        self.answers: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def ensure(self) -> None:
        """A live worker, started (and waited ready) if there is none."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.wait_ready()

    def start(self) -> None:
        """Start the process (its imports take seconds: `wait_ready` waits for them)."""
        cmd = [sys.executable, "-m", "moecc.serve.worker", "--parent", str(os.getpid())]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.answers = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.answers), daemon=True).start()
        self.ready = False

    def wait_ready(self) -> None:
        if self.ready:
            return
        first = self.answers.get()
        if first is None or not first.get("ready"):
            raise RuntimeError("the worker process did not start (see the server's stderr)")
        self.ready = True

    @staticmethod
    def _read(proc: subprocess.Popen[str], answers: "queue.Queue[dict[str, Any] | None]") -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                answers.put(json.loads(line))
            except ValueError:
                continue
        answers.put(None)  # the process ended

    def submit(self, job: dict[str, Any]) -> None:
        """Send one job (to a fresh worker if the last one died meanwhile)."""
        for attempt in (0, 1):
            self.ensure()
            assert self.proc is not None and self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps(job) + "\n")
                self.proc.stdin.flush()
                return
            except OSError:
                if attempt:
                    raise
                self.proc.kill()
                self.proc.wait()

    def answer(self, timeout: float | None) -> tuple[bool, dict[str, Any] | None]:
        """(an answer or the end came, the answer or None when the process ended)."""
        try:
            return True, self.answers.get(timeout=timeout)
        except queue.Empty:
            return False, None

    def stop(self) -> None:
        """Stop the running job after its current step (SIGTERM: run_job finishes the step)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def close(self, wait: float = 10.0) -> None:
        """End the process: stdin closed (an idle worker exits), SIGTERM (a running job stops
        after its step, then the worker exits), SIGKILL after `wait` seconds."""
        if self.proc is None:
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        self.stop()
        try:
            self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@dataclass
class Live:
    """What the status page shows of the running batch beyond its counts."""

    batch_id: str
    model: str
    started: float = field(default_factory=time.monotonic)
    base_done: int = 0  # requests already done when this run started (a resumed batch)
    base_tokens: int = 0
    done: int = 0
    tokens: int = 0
    total: int = 0

    @property
    def tokens_per_s(self) -> float:
        t = time.monotonic() - self.started
        return (self.tokens - self.base_tokens) / t if t > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        t, ran = time.monotonic() - self.started, self.done - self.base_done
        left = self.total - self.done
        return 0.0 if left <= 0 else (left * t / ran if ran > 0 else None)


class Runner(threading.Thread):
    """The runner thread of one device (see the module docstring)."""

    def __init__(self, store: Store, blobs: Blobs, models: dict[str, ServedModel], cfg: ServeConfig,
                 log: Callable[[str], None]) -> None:
        """`models`: the served models, not yet prepared (`run` prepares them first)."""
        super().__init__(name="moecc-serve-runner", daemon=True)
        self.store, self.blobs, self.models, self.cfg, self.log = store, blobs, models, cfg, log
        self.worker = WorkerProc(cfg.threads)
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.live: Live | None = None
        self.crashes: dict[str, int] = {}
        self.ready = threading.Event()  # the plans are prepared (or failed to be: `broken` says why)
        self.broken: str | None = None
        self._published: tuple[str, int, int, int, int] | None = None  # the counts last written (publish)

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                row = self.store.next_batch()
                if row is None:
                    if not self.ready.is_set():
                        self.prepare()  # idle: get the plans (and the worker) ready for the first batch
                    self.wake.wait(1.0)
                    self.wake.clear()
                    continue
                try:
                    self.step(row)
                except Exception as e:  # a bug or a disk problem: this batch fails, the server goes on
                    self.log(f"moecc serve: batch {row['id']} failed: {type(e).__name__}: {e}")
                    try:
                        self.fail(row, "server_error", f"{type(e).__name__}: {e}")
                    except Exception as again:  # the store itself fails: wait, then try again
                        self.log(f"moecc serve: cannot record it: {type(again).__name__}: {again}")
                        self.wake.wait(5.0)
        finally:
            self.worker.close()

    def prepare(self) -> str | None:
        """Each model's plan, from the cache or compiled (plans.prepare), in the worker process
        (this one never imports torch or the compiler); done once, when the first batch needs
        it or the runner is idle (a restart that only finalizes starts no worker). Why not, if
        one failed (the batches that would run then fail, naming it)."""
        if self.ready.is_set():
            return self.broken
        budgets = {"gpu_mem": self.cfg.gpu_mem, "host_mem": self.cfg.host_mem, "hardware": self.cfg.hardware,
                   "max_batch": self.cfg.max_batch}
        for spec in self.cfg.models:
            answer = self.ask({"op": "prepare", "name": spec.name, "path": str(spec.path.resolve()),
                               "data_dir": str(self.cfg.data_dir), "budgets": budgets})
            if self.stopping.is_set():
                return "the server is stopping"
            if answer is None or not answer.get("ok"):
                self.broken = (f"model {spec.name} could not be compiled for this server: "
                               f"{(answer or {}).get('error', 'the worker process ended')}")
                self.log(f"moecc serve: {self.broken}")
                break
            m = self.models[spec.name]
            m.explain, m.timeline_svg = answer["explain"], answer["timeline_svg"]
            m.fingerprint, m.plan_path = answer["fingerprint"], Path(answer["plan_path"])
        self.ready.set()
        return self.broken

    def ask(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """One request to the worker and its answer (None: the worker ended, or the server is
        stopping)."""
        self.worker.submit(request)
        while not self.stopping.is_set():
            ended, answer = self.worker.answer(POLL_S)
            if ended:
                return answer
        return None

    def shutdown(self) -> None:
        """Stop after the current step of the running job (resumed at the next start)."""
        self.stopping.set()
        self.worker.stop()
        self.wake.set()

    # -- the lifecycle ----------------------------------------------------------------------
    def step(self, row: dict[str, Any]) -> None:
        """Move batch `row` on by one stage of its lifecycle."""
        status = row["status"]
        if status == "cancelling":
            self.finish(row, "cancelled")
        elif status in ("validating", "in_progress") and row["expires_at"] and now() >= row["expires_at"]:
            self.finish(row, "expired")
        elif status == "validating":
            self.validate(row)
        elif status == "in_progress":
            self.execute(row)
        elif status == "finalizing":
            self.finish(row, "completed")

    def validate(self, row: dict[str, Any]) -> None:
        """Split the input per model (batches.split) → in_progress; failed when it is not a batch."""
        f = self.store.file(row["owner"], row["input_file_id"])
        if f is None:
            self.fail(row, "invalid_file", f"the input file {row['input_file_id']} was deleted before the batch "
                                           f"started; upload it again and create a new batch")
            return
        try:
            m = split(self.blobs.path(f["blob"]), self.blobs.work_dir(row["id"]), row["id"], row["endpoint"],
                      list(self.models))
        except BatchInvalid as e:
            self.fail(row, errors=e.errors)
            return
        self.store.transition(row["id"], ("validating",), "in_progress", in_progress_at=now(), total=m.total,
                              failed=m.preflight_failed)

    def fail(self, row: dict[str, Any], code: str = "", message: str = "",
             errors: list[dict[str, Any]] | None = None) -> None:
        """The batch failed as a whole: `errors` (or one of `code` and `message`)."""
        data = errors if errors is not None else [{"code": code, "message": message, "param": None, "line": None}]
        if self.store.transition(row["id"], ("validating", "in_progress", "finalizing", "cancelling"), "failed",
                                 failed_at=now(), errors={"object": "list", "data": data}):
            shutil.rmtree(self.blobs.work / row["id"], ignore_errors=True)

    def execute(self, row: dict[str, Any]) -> None:
        """Run the batch's parts not yet done; then finalizing (or leave it to a cancel,
        an expiry or the shutdown)."""
        work = self.blobs.work_dir(row["id"])
        m = Manifest.load(work)
        if m is None:  # cannot happen after validate; be safe: split again
            self.store.transition(row["id"], ("in_progress",), "validating")
            return
        broken = self.prepare()
        if self.stopping.is_set():
            return
        if broken is not None:
            self.fail(row, "server_error", broken)
            return
        for part in m.parts:
            if (work / (part["input"] + ".done")).exists():
                continue
            if part["model"] not in self.models:
                self.fail(row, "model_not_found", f"model {part['model']} is no longer served by this server")
                return
            if not self.run_part(row, m, part, work):
                return
        if self.store.transition(row["id"], ("in_progress",), "finalizing", finalizing_at=now()):
            pause_for_test("finalizing")

    def run_part(self, row: dict[str, Any], m: Manifest, part: dict[str, str], work: Path) -> bool:
        """One part through the worker, its counts live; whether it finished."""
        with open(work / part["input"], "rb") as f:
            empty = not any(raw.strip() for raw in f)
        if empty:  # no line of this batch is for this model
            (work / (part["input"] + ".done")).touch()
            return True
        model = self.models[part["model"]]
        self.worker.submit({"plan": str(model.plan_path), "prompts": str(work / part["input"]),
                            "output": str(work / part["output"]), "errors": str(work / part["errors"]),
                            "max_tokens": self.cfg.max_tokens, "device": self.cfg.device})
        counts = [LiveCount(work / PREFLIGHT, False)] + [
            LiveCount(work / p[k], k == "output") for p in m.parts for k in ("output", "errors")]
        self.live = Live(row["id"], part["model"], total=m.total)
        first, asked_stop = True, False
        try:
            while True:
                ended, answer = self.worker.answer(POLL_S)
                self.publish(row["id"], counts, first)
                first = False
                if ended and answer is not None and "ready" in answer:
                    continue  # a fresh worker's first line (submit restarted one)
                if ended:
                    return self.part_ended(row, part, work, answer, asked_stop)
                if not asked_stop and self.should_stop(row):
                    self.worker.stop()
                    asked_stop = True
        finally:
            self.live = None

    def recount(self) -> None:
        """The counts of every in-progress batch from its files (at a start: a killed server
        last stored them up to a poll before it died)."""
        for row in self.store.in_status("in_progress"):
            m = Manifest.load(self.blobs.work / row["id"])
            if m is not None:
                work = self.blobs.work / row["id"]
                self.publish(row["id"], [LiveCount(work / PREFLIGHT, False)] + [
                    LiveCount(work / p[k], k == "output") for p in m.parts for k in ("output", "errors")], False)

    def should_stop(self, row: dict[str, Any]) -> bool:
        """A cancel, the batch's expiry or the server's shutdown."""
        cur = self.store.batch(row["id"])
        return (self.stopping.is_set() or cur is None or cur["status"] != "in_progress"
                or (bool(cur["expires_at"]) and now() >= cur["expires_at"]))

    def publish(self, batch_id: str, counts: list[LiveCount], first: bool) -> None:
        """The live counts into the store (and the Live figures of the status page)."""
        tallies = [c.poll() for c in counts]
        done = sum(t.completed for t in tallies)
        failed = sum(t.failed for t in tallies)
        tin, tout = sum(t.input_tokens for t in tallies), sum(t.output_tokens for t in tallies)
        live = self.live
        if live is not None:
            if first:
                live.base_done, live.base_tokens = done + failed, tout
            live.done, live.tokens = done + failed, tout
        figures = (batch_id, done, failed, tin, tout)
        if figures != self._published:  # a write (and its fsync) only when something changed
            self.store.set_counts(batch_id, completed=done, failed=failed, input_tokens=tin, output_tokens=tout)
            self._published = figures

    def part_ended(self, row: dict[str, Any], part: dict[str, str], work: Path, answer: dict[str, Any] | None,
                   asked_stop: bool) -> bool:
        """The worker answered (or died): whether the part is done."""
        if answer is not None and answer.get("ok") and answer.get("status") == "done":
            (work / (part["input"] + ".done")).touch()
            return True
        if answer is not None and not answer.get("ok"):
            self.fail(row, "server_error", f"{answer.get('kind')}: {answer.get('error')}")
            return False
        if not asked_stop:  # the worker died unasked: try again (it resumes), a few times
            n = self.crashes[row["id"]] = self.crashes.get(row["id"], 0) + 1
            self.log(f"moecc serve: the worker process ended during batch {row['id']} ({n} of {MAX_CRASHES})")
            if n >= MAX_CRASHES:
                self.fail(row, "server_error", "the worker process kept dying on this batch (see the server's log)")
        return False

    def finish(self, row: dict[str, Any], final: str) -> None:
        """Merge what the batch's parts wrote into its output and error files and give it its
        final status, in one transaction (redone from scratch if interrupted)."""
        work = self.blobs.work / row["id"]
        m = Manifest.load(work) if work.is_dir() else None
        new_files: list[dict[str, Any]] = []
        fields: dict[str, Any] = {f"{final}_at": now()}
        with self.blobs.writing() as (out, out_tmp), self.blobs.writing() as (err, err_tmp):
            tally = merge(work, m, out, err, row["id"], expired=final == "expired") if m is not None else None
        published: list[str] = []
        for kind, tmp, n in (("output", out_tmp, tally.completed if tally else 0),
                             ("error", err_tmp, tally.failed if tally else 0)):
            if n == 0:
                tmp.unlink(missing_ok=True)
                continue
            fid = new_id("file-")
            self.blobs.commit(tmp, fid)
            published.append(fid)
            new_files.append({"id": fid, "owner": row["owner"], "bytes": self.blobs.path(fid).stat().st_size,
                              "created_at": now(), "filename": f"{row['id']}_{kind}.jsonl",
                              "purpose": "batch_output", "blob": fid})
            fields[f"{kind}_file_id"] = fid
        if tally is not None:
            fields.update(completed=tally.completed, failed=tally.failed, input_tokens=tally.input_tokens,
                          output_tokens=tally.output_tokens)
            if m is not None:
                fields["total"] = m.total
        pause_for_test("commit")
        leaving = {"completed": ("finalizing",), "cancelled": ("cancelling",),
                   "expired": ("validating", "in_progress")}[final]
        if not self.store.transition_with(row["id"], leaving, final, fields, new_files):
            for fid in published:  # the batch moved on meanwhile (a cancel): these files are not its
                self.blobs.remove(fid)
            return
        shutil.rmtree(work, ignore_errors=True)
        self.log(f"moecc serve: batch {row['id']} {final}")
