"""A batch's input split per model before it runs, and its results merged after.

Needs: the batch's work directory (blobs.Blobs.work_dir) and the served models' names.
Does: `split` reads the input file once, line by line: a file that is not JSONL fails the
batch (OpenAI's `invalid_json_line`, or `empty_file`); a line whose `url` is not the batch's
endpoint, whose `body.model` no model here serves, or whose `custom_id` repeats fails alone,
in OpenAI's error-line shape (`preflight.err.jsonl`); every other line goes verbatim to its
model's part file, in which the other lines are blank, so the runtime's line numbers are
the input's. `merge` concatenates the parts' complete result and error lines into an output
and an error file. Guarantees: `split` publishes its manifest last and atomically, so a
batch is split once, whatever crashes; `merge` reads only and can be redone.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator

MANIFEST = "split.json"
PREFLIGHT = "preflight.err.jsonl"
MAX_ERRORS = 100  # error objects a failed batch lists


class BatchInvalid(Exception):
    """The input cannot run as a batch: OpenAI's `errors.data` list says why."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(errors[0]["message"] if errors else "invalid batch")
        self.errors = errors


@dataclass
class Manifest:
    """What `split` made: the input's request lines and, per model, its part file."""

    total: int
    parts: list[dict[str, str]]  # {"model": name, "input", "output", "errors"}: file names in the work dir
    preflight_failed: int = 0

    @classmethod
    def load(cls, work: Path) -> "Manifest | None":
        p = work / MANIFEST
        if not p.is_file():
            return None
        d = json.loads(p.read_text(encoding="utf-8"))
        return cls(int(d["total"]), list(d["parts"]), int(d["preflight_failed"]))


def error_line(batch_id: str, custom_id: Any, line: int, status: int, message: str, param: str | None,
               code: str | None) -> dict[str, Any]:
    """One failed request, as the runtime writes them (`exec --format openai`), with `code`."""
    rid = hashlib.sha256(f"{batch_id}\x00{line}".encode()).hexdigest()[:24]
    return {"id": f"batch_req_{rid}", "custom_id": custom_id if isinstance(custom_id, str) else None,
            "response": {"status_code": status, "request_id": rid,
                         "body": {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                            "code": code, "line": line}}},
            "error": None}


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            raw = raw.rstrip(b"\n").rstrip(b"\r")
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            yield number, raw


@dataclass
class _Splitter:
    batch_id: str
    endpoint: str
    models: list[str]
    outs: dict[str, IO[bytes]]
    pre: IO[bytes]
    seen: set[str] = field(default_factory=set)
    bad: list[dict[str, Any]] = field(default_factory=list)
    total: int = 0
    failed: int = 0

    def line(self, number: int, raw: bytes) -> None:
        """Route one input line (see the module docstring)."""
        if not raw.strip():
            self._to(None, b"")
            return
        self.total += 1
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            obj = None
        if not isinstance(obj, dict):
            if len(self.bad) < MAX_ERRORS:
                self.bad.append({"code": "invalid_json_line", "line": number, "param": None,
                                 "message": f"This line is not parseable as a JSON object (line {number}): the "
                                            f"input file must be JSONL, one request object a line."})
            self._to(None, b"")
            return
        cid, why = obj.get("custom_id"), self._refusal(obj)
        if why is None and isinstance(cid, str):
            if cid in self.seen:
                why = (400, f"custom_id {cid!r} is used by an earlier line; custom_id must be unique in a batch",
                       "custom_id", "duplicate_custom_id")
            self.seen.add(cid)
        if why is not None:
            self.failed += 1
            rec = error_line(self.batch_id, cid, number, why[0], why[1], why[2], why[3])
            self.pre.write(json.dumps(rec, ensure_ascii=False).encode() + b"\n")
            self._to(None, b"")
            return
        body = obj.get("body")
        model = body.get("model") if isinstance(body, dict) else None
        self._to(model if isinstance(model, str) else self.models[0], raw)

    def _refusal(self, obj: dict[str, Any]) -> tuple[int, str, str, str] | None:
        """Why a line fails before it reaches a model: (status, message, param, code), or None."""
        if obj.get("url") != self.endpoint:
            return (400, f"the line's url {obj.get('url')!r} is not this batch's endpoint {self.endpoint!r}; "
                         f"every line of a batch must use its endpoint", "url", "invalid_url")
        body = obj.get("body")
        model = body.get("model") if isinstance(body, dict) else None
        if model is not None and model not in self.outs:
            return (404, f"The model `{model}` does not exist or you do not have access to it. This server "
                         f"serves: {', '.join(self.models)} (GET /v1/models)", "body.model", "model_not_found")
        return None

    def _to(self, model: str | None, raw: bytes) -> None:
        for name, f in self.outs.items():
            f.write((raw if name == model else b"") + b"\n")


def split(input_path: Path, work: Path, batch_id: str, endpoint: str, models: list[str]) -> Manifest:
    """Split the batch's input into one part per model (see the module docstring); the
    manifest when already split; BatchInvalid for an input that is not a batch."""
    done = Manifest.load(work)
    if done is not None:
        return done
    parts = [{"model": m, "input": f"part-{i}.jsonl", "output": f"part-{i}.out.jsonl",
              "errors": f"part-{i}.err.jsonl"} for i, m in enumerate(models)]
    outs = {p["model"]: open(work / p["input"], "wb") for p in parts}
    try:
        with open(work / PREFLIGHT, "wb") as pre:
            s = _Splitter(batch_id, endpoint, models, outs, pre)
            for number, raw in _lines(input_path):
                s.line(number, raw)
            for f in (*outs.values(), pre):
                f.flush()
                os.fsync(f.fileno())
    finally:
        for f in outs.values():
            f.close()
    if s.bad:
        raise BatchInvalid(s.bad)
    if s.total == 0:
        raise BatchInvalid([{"code": "empty_file", "line": None, "param": "input_file_id",
                             "message": "The input file holds no request lines."}])
    manifest = Manifest(s.total, parts, s.failed)
    tmp = work / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"total": s.total, "parts": parts, "preflight_failed": s.failed}), encoding="utf-8")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, work / MANIFEST)
    return manifest


@dataclass
class Tally:
    """Complete lines of result and error files, and the tokens their results used."""

    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    done: set[str] = field(default_factory=set)  # custom_ids that have a line

    def add(self, raw: bytes, is_result: bool) -> None:
        try:
            rec = json.loads(raw)
        except ValueError:
            return
        if is_result:
            self.completed += 1
            usage = ((rec.get("response") or {}).get("body") or {}).get("usage") or {}
            self.input_tokens += int(usage.get("prompt_tokens") or 0)
            self.output_tokens += int(usage.get("completion_tokens") or 0)
        else:
            self.failed += 1
        if isinstance(rec.get("custom_id"), str):
            self.done.add(rec["custom_id"])


def complete_lines(path: Path) -> Iterator[bytes]:
    """The newline-terminated, non-blank lines of `path` (a torn last line is not one)."""
    if not path.is_file():
        return
    with open(path, "rb") as f:
        for raw in f:
            if raw.endswith(b"\n") and raw.strip():
                yield raw


def merge(work: Path, manifest: Manifest, out: IO[bytes], err: IO[bytes], batch_id: str,
          expired: bool = False) -> Tally:
    """Write the parts' results to `out` and all error lines to `err`; with `expired`, also
    one `batch_expired` error line for each request that has neither. The tally of both."""
    tally = Tally()
    for raw in complete_lines(work / PREFLIGHT):
        err.write(raw)
        tally.add(raw, False)
    for p in manifest.parts:
        for raw in complete_lines(work / p["output"]):
            out.write(raw)
            tally.add(raw, True)
        for raw in complete_lines(work / p["errors"]):
            err.write(raw)
            tally.add(raw, False)
    if expired:
        for p in manifest.parts:
            for number, raw in _lines(work / p["input"]):
                if not raw.strip():
                    continue
                cid = json.loads(raw).get("custom_id")  # a part holds only lines that parsed as objects
                if cid not in tally.done:
                    rec = {**error_line(batch_id, cid, number, 0, "", None, None), "response": None,
                           "error": {"code": "batch_expired", "message": "This request could not be executed "
                                     "before the completion window expired."}}
                    err.write(json.dumps(rec, ensure_ascii=False).encode() + b"\n")
                    tally.add(json.dumps(rec).encode(), False)
    return tally


class LiveCount:
    """Counts a running part's result and error lines as they are appended (read
    incrementally; recounted from the start when resume rewrote the file)."""

    def __init__(self, path: Path, is_result: bool) -> None:
        self.path, self.is_result = path, is_result
        self.ino: int | None = None
        self.offset = 0
        self.tally = Tally()

    def poll(self) -> Tally:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return self.tally
        if st.st_ino != self.ino or st.st_size < self.offset:
            self.ino, self.offset, self.tally = st.st_ino, 0, Tally()
        if st.st_size == self.offset:
            return self.tally
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read(st.st_size - self.offset)
        end = chunk.rfind(b"\n") + 1
        for raw in chunk[:end].splitlines():
            if raw.strip():
                self.tally.add(raw, self.is_result)
        self.offset += end
        return self.tally
