"""Where a job's results go, durably: one JSON line per finished request, appended as it
finishes, and one per failed request in an errors file beside it.

- Durable: every line is handed to the OS as soon as it is written (a killed process loses
  nothing it wrote), and the files are fsync'ed at least every `sync_every` seconds and
  on close (a machine crash loses at most those seconds).
- Formats: "moecc" (custom_id, text, token_ids, finish_reason, usage) or "openai" (the
  Batch API's output lines: id, custom_id, response {status_code, request_id, body}, error;
  a chat.completion or text_completion body for successes, an error body for failures).
- Identity: every result and error line, in both formats, carries the job that wrote it,
  `"moecc": {"plan": <16 hex>, "request": <16 hex>}`: the plan's identity (`plan_identity`)
  and the request's hash (requests.request_hash: its line's canonical JSON, its custom_id's
  occurrence, the default max_tokens when it matters).
- Resume (`resume_scan`): refuses files that another plan (or another program) wrote; a
  result stands while its custom_id's request is unchanged, an error record while the input
  holds its exact request (errors are keyed by custom_id and request hash, never by line
  number). Results of changed requests, error records that no longer match a request, and
  corrupt lines are moved, verbatim, to `<file>.replaced.jsonl` beside each file (nothing is
  lost); a torn last line (a run killed mid-write) is cut.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from moecc_runtime.job.lock import JobIdentityError

FORMATS = ("moecc", "openai")
IDENTITY_KEY = "moecc"
#: Plan fields that do not change what a job computes: predictions, the memory accounting, and
#: the KV pool's size (sized by the memory free at compile when --host-mem is unset)
RUN_ONLY_FIELDS: tuple[tuple[str, ...], ...] = (("predicted",), ("timeline",), ("memory",),
                                                 ("batch", "kv", "num_blocks"))
_WHAT_TO_DO = ("resume with the plan that started this job, or give a new -o (and --errors) file, or drop "
               "--resume and pass --overwrite to start over; nothing was changed")


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode("utf-8")).hexdigest()[:24]


def plan_identity(plan: dict[str, Any], model_dir: str | Path | None = None) -> str:
    """16 hex digits naming what a job on this plan computes: sha256 of the plan's canonical
    JSON (sorted keys, tensors by dtype, shape and values) without RUN_ONLY_FIELDS, with
    `model.dir` the resolved checkpoint directory the job reads (`model_dir`, exec's --model;
    default the plan's): the fingerprint records a checkpoint's layout, not its weights, so
    two fine-tunes of one base differ only there. Guarantees: recompiling the same
    checkpoint with the same options gives the same identity; another checkpoint, budget or
    batch gives another."""
    content = _without(plan, RUN_ONLY_FIELDS)
    if isinstance(content.get("model"), dict):
        where = model_dir if model_dir is not None else content["model"].get("dir", "")
        content["model"] = {**content["model"], "dir": str(Path(str(where)).resolve())}
    text = json.dumps(content, sort_keys=True, default=_plain)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _without(d: dict[str, Any], paths: tuple[tuple[str, ...], ...]) -> dict[str, Any]:
    """A copy of `d` without the fields at `paths` (copied only along those paths)."""
    out = dict(d)
    for path in paths:
        if len(path) == 1:
            out.pop(path[0], None)
        elif isinstance(out.get(path[0]), dict):
            out[path[0]] = _without(out[path[0]], (path[1:],))
    return out


def _plain(x: Any) -> Any:
    if hasattr(x, "tolist") and hasattr(x, "dtype"):  # a tensor: its values, exactly
        return {"dtype": str(x.dtype), "shape": list(getattr(x, "shape", ())), "values": x.tolist()}
    return str(x)


def error_key(custom_id: str | None, request: str) -> str:
    """What identifies a failed request across runs: its custom_id and its request hash
    (which counts the custom_id's occurrence: a duplicate's error never stands for the first,
    valid request); a line whose custom_id could not be read, by its hash alone."""
    return f"{custom_id if custom_id is not None else ''}\x00{request}"


@dataclass
class InputKeys:
    """The job's input as resume needs it: each custom_id's first request hash, and the
    error_key of every line."""

    first: dict[str, str] = field(default_factory=dict)
    keys: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, lines: Iterable[tuple[str | None, str]]) -> InputKeys:
        """From (custom_id or None, request hash) per input line, in file order."""
        out = cls()
        for cid, request in lines:
            if cid is not None:
                out.first.setdefault(cid, request)
            out.keys.add(error_key(cid, request))
        return out


@dataclass
class Done:
    """What an earlier run of this job wrote that still stands, and what resume changed."""

    results: dict[str, str] = field(default_factory=dict)  # custom_id -> request hash of its result
    errors: set[str] = field(default_factory=set)  # error_key of failures that stand
    repaired: list[str] = field(default_factory=list)  # files whose torn last line was cut
    changed: int = 0  # result lines moved aside: their request changed since
    retried: int = 0  # error lines moved aside: their request was fixed, changed or removed since
    corrupt: list[tuple[str, int, str]] = field(default_factory=list)  # (file, line, why): unreadable, moved aside
    replaced: dict[str, str] = field(default_factory=dict)  # file -> the side file its lines went to


@dataclass
class Scan:
    """One file of an earlier run, read without changing it."""

    path: Path
    kind: str  # "output" | "errors"
    results: dict[str, str] = field(default_factory=dict)
    errors: set[str] = field(default_factory=set)
    moved: dict[int, str] = field(default_factory=dict)  # 1-based line -> "changed" | why it is corrupt
    torn: bool = False


def replaced_path(path: Path) -> Path:
    """Where resume moves the lines it takes out of `path`: `<path>.replaced.jsonl`."""
    return path.with_name(path.name + ".replaced.jsonl")


def resume_scan(output: Path, errors: Path | None, plan: str, inputs: InputKeys) -> Done:
    """Needs: the locks on `output` and `errors` (lock.open_job_files). Does: reads both
    files whole first (refusing, with JobIdentityError naming file, line and both plan
    identities, any line another plan or program wrote: then nothing is changed), then moves
    aside what no longer stands (see the module docstring) and cuts torn last lines.
    Guarantees: the files then hold only lines of this job that stand, each moved line is in
    its side file first; the caller must reopen its handles (the files may be replaced)."""
    scans = [scan_file(output, "output", plan, inputs)]
    if errors is not None:
        scans.append(scan_file(errors, "errors", plan, inputs))
    done = Done()
    for scan in scans:
        if scan.moved:
            side = replaced_path(scan.path)
            move_aside(scan.path, scan.moved, side)
            done.replaced[str(scan.path)] = str(side)
            if scan.torn:
                done.repaired.append(str(scan.path))
        elif scan.torn and repair_torn_tail(scan.path):
            done.repaired.append(str(scan.path))
        done.results.update(scan.results)
        done.errors |= scan.errors
        changed = sum(1 for why in scan.moved.values() if why == "changed")
        if scan.kind == "output":
            done.changed += changed
        else:
            done.retried += changed
        done.corrupt += [(str(scan.path), n, why) for n, why in scan.moved.items() if why != "changed"]
    return done


def scan_file(path: Path, kind: str, plan: str, inputs: InputKeys) -> Scan:
    """What stands in one file of an earlier run and what moves aside; JobIdentityError for
    a line of another job. Reads only."""
    scan = Scan(path, kind)
    if not path.is_file():
        return scan
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                scan.torn = True  # the last line, cut short by a kill mid-write
                break
            if not raw.strip():
                continue
            record, why = _record(raw, kind)
            if record is None:
                scan.moved[number] = why
                continue
            request = _request_of(record, path, number, plan)
            cid = record["custom_id"]
            if kind == "output":
                if inputs.first.get(cid, request) != request:
                    scan.moved[number] = "changed"
                else:
                    scan.results[cid] = request
            elif error_key(cid, request) in inputs.keys:
                scan.errors.add(error_key(cid, request))
            else:
                scan.moved[number] = "changed"
    return scan


def _record(raw: bytes, kind: str) -> tuple[dict[str, Any] | None, str]:
    """A line as a result (custom_id a string) or error record (custom_id a string or null),
    or None and why it is neither."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None, "not valid JSON"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    cid = obj.get("custom_id")
    if not isinstance(cid, str) and not (kind == "errors" and "custom_id" in obj and cid is None):
        return None, "no custom_id"
    return obj, ""


def _request_of(record: dict[str, Any], path: Path, number: int, plan: str) -> str:
    """The request hash a line records; JobIdentityError if another plan, or something that
    is not moecc exec, wrote it."""
    ident = record.get(IDENTITY_KEY)
    if not (isinstance(ident, dict) and isinstance(ident.get("plan"), str) and isinstance(ident.get("request"), str)):
        raise JobIdentityError(
            f"{path}:{number}: this line carries no moecc job identity (no \"{IDENTITY_KEY}\": {{\"plan\", "
            f"\"request\"}} key): another program, or an older moecc, wrote it, so --resume cannot tell it belongs "
            f"to this job (plan {plan}); {_WHAT_TO_DO}")
    if ident["plan"] != plan:
        raise JobIdentityError(
            f"{path}:{number}: written by plan {ident['plan']}, but this job's plan is {plan}: --resume "
            f"continues a job only with the plan that wrote its files; {_WHAT_TO_DO}")
    return ident["request"]


def move_aside(path: Path, lines: Collection[int], side: Path) -> None:
    """Needs: the lock on `path`. Does: appends lines `lines` (1-based) of `path`, verbatim,
    to `side`, then replaces `path` by a copy without them and without a torn last line.
    Guarantees: `side` is fsync'ed before the replace, so every moved line is on disk in one
    of the two files at every instant; `path` is always the old or the new whole file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(path, "rb") as src, open(side, "ab") as aside, open(tmp, "wb") as new:
            for number, raw in enumerate(src, start=1):
                if not raw.endswith(b"\n"):
                    break  # a torn last line: cut
                (aside if number in lines else new).write(raw)
            for f in (aside, new):
                f.flush()
                os.fsync(f.fileno())
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def repair_torn_tail(path: Path) -> bool:
    """Cut a file back to its last newline when its last line is incomplete (the writer was
    killed mid-line). Returns True if it cut anything."""
    if not path.is_file():
        return False
    size = path.stat().st_size
    if size == 0:
        return False
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return False
        # walk back to the last newline, in blocks
        pos, block = size, 1 << 16
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                f.truncate(start + i + 1)
                return True
            pos = start
        f.truncate(0)
        return True


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob, as the writers report it: its id, its text (decoded
    alone), its logprob, and the top N as (id, text, logprob), best first."""

    token_id: int
    token: str
    logprob: float | None  # None: an echoed prompt's first token (nothing precedes it)
    top: list[tuple[int, str, float]]


@dataclass(frozen=True)
class Completion:
    """One completion (choice) of a finished request, as the writers report it."""

    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None  # one entry per token, when the request asked


def _moecc_choice(c: Completion) -> dict[str, Any]:
    """A completion's fields in the moecc format."""
    out: dict[str, Any] = {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
    if c.logprobs is not None:
        out["logprobs"] = [{"token_id": e.token_id, "logprob": e.logprob, "top": [[i, v] for i, _, v in e.top]}
                           for e in c.logprobs]
    return out


def _chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's `logprobs`, shaped as OpenAI's ChoiceLogprobs."""
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for _, t, v in e.top]}
                        for e in entries], "refusal": None}


def _completion_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """A completions choice's `logprobs` (the legacy API's shape; with echo the prompt's tokens
    first); text_offset counts characters into the choice's text, from 0. Two top tokens with the same text keep
    the more likely one (the legacy shape keys them by text)."""
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    tops: list[dict[str, float] | None] = []
    for e in entries:
        top: dict[str, float] = {}
        for _, t, v in e.top:
            top.setdefault(t, v)
        tops.append(None if e.logprob is None else top)  # an echoed prompt's first token: null, as OpenAI
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


class ResultWriter:
    """Appends result and error lines in one of FORMATS, each with the job's identity; see
    the module docstring. The files are the caller's (lock.JobFiles opens and closes them)."""

    def __init__(self, output: IO[str], errors: IO[str] | None, fmt: str = "moecc", *, plan: str, model: str = "",
                 sync_every: float = 2.0):
        if fmt not in FORMATS:
            raise ValueError(f"unknown output format {fmt!r}; expected one of {', '.join(FORMATS)}")
        self.out = output
        self.err = errors
        self.fmt = fmt
        self.plan = plan
        self.model = model
        self.sync_every = sync_every
        self._last_sync = time.monotonic()
        self.created = int(time.time())

    # -- lines ------------------------------------------------------------------------------
    def result(self, custom_id: str, api: str, completions: list[Completion], prompt_tokens: int,
               model: str | None = None, *, request: str) -> None:
        """A finished request's line, with its `completions` in order (n of them: the OpenAI
        shapes list them as choices; the moecc line has the first at the top and, for n > 1,
        all under "choices"); `request`: its request hash. usage counts the prompt once and
        every completion's tokens, as the API reports it."""
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sum(len(c.token_ids) for c in completions)}
        if self.fmt == "moecc":
            first = completions[0]
            line = {"custom_id": custom_id, **_moecc_choice(first), "usage": usage}
            if len(completions) > 1:
                line["choices"] = [_moecc_choice(c) for c in completions]
        else:
            line = self._openai_result(custom_id, api, completions, usage, model)
        line[IDENTITY_KEY] = {"plan": self.plan, "request": request}
        self._write(self.out, line)

    def error(self, record: dict[str, Any], request: str, api: str = "simple") -> None:
        """`record` = {custom_id, error: {line, field, message}}; `request`: its request hash."""
        if self.err is None:
            return
        line = dict(record) if self.fmt == "moecc" else self._openai_error(record, request)
        line[IDENTITY_KEY] = {"plan": self.plan, "request": request}
        self._write(self.err, line)

    def _openai_result(self, custom_id: str, api: str, completions: list[Completion], usage: dict[str, int],
                       model: str | None) -> dict[str, Any]:
        rid = _digest("request", custom_id)
        usage = {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}
        if api == "completions":
            choices = [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
                        "logprobs": None if c.logprobs is None else _completion_logprobs(c.logprobs)}
                       for i, c in enumerate(completions)]
            body = {"id": f"cmpl-{rid}", "object": "text_completion", "created": self.created,
                    "model": model or self.model, "choices": choices, "usage": usage}
        else:  # chat, and simple-form lines written in this format
            choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                        "logprobs": None if c.logprobs is None else _chat_logprobs(c.logprobs),
                        "finish_reason": c.finish_reason} for i, c in enumerate(completions)]
            body = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": self.created,
                    "model": model or self.model, "choices": choices, "usage": usage}
        return {"id": f"batch_req_{rid}", "custom_id": custom_id,
                "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}

    def _openai_error(self, record: dict[str, Any], request: str) -> dict[str, Any]:
        err = record.get("error") or {}
        cid = record.get("custom_id")
        rid = _digest("error", str(cid), request)
        body = {"error": {"message": err.get("message"), "type": "invalid_request_error", "param": err.get("field"),
                          "code": err.get("code"), "line": err.get("line")}}
        return {"id": f"batch_req_{rid}", "custom_id": cid,
                "response": {"status_code": int(err.get("status", 400)), "request_id": rid, "body": body},
                "error": None}

    def _write(self, f: IO[str], line: dict[str, Any]) -> None:
        f.write(json.dumps(line, ensure_ascii=False) + "\n")
        f.flush()  # to the OS now: a killed process loses nothing it wrote
        if time.monotonic() - self._last_sync >= self.sync_every:
            self.sync()

    # -- durability -------------------------------------------------------------------------
    def sync(self) -> None:
        """fsync both files (a machine crash then loses nothing written before this)."""
        for f in (self.out, self.err):
            if f is None:
                continue
            f.flush()
            try:
                os.fsync(f.fileno())
            except (OSError, ValueError, AttributeError):
                pass  # stdout, a pipe, a StringIO: nothing to sync
        self._last_sync = time.monotonic()

    def close(self) -> None:
        """Flush and fsync both files (closing them is the caller's)."""
        self.sync()
