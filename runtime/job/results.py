"""Where a job's results go, durably: one JSON line per finished request, appended as it
finishes, and one per failed request in an errors file beside it.

- Durable: every line is handed to the OS as soon as it is written (a killed process loses
  nothing it wrote), and the files are fsync'ed at least every `sync_every` seconds and
  on close (a machine crash loses at most those seconds).
- Formats: "moecc" (custom_id, text, token_ids, finish_reason, usage) or "openai" (the
  Batch API's output lines: id, custom_id, response {status_code, request_id, body}, error;
  a chat.completion or text_completion body for successes, an error body for failures).
- Resume: `scan_done` reads what an earlier run of the job already wrote, after cutting a
  torn last line (a run killed mid-write) back to the last complete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

FORMATS = ("moecc", "openai")


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode("utf-8")).hexdigest()[:24]


def error_key(record: dict[str, Any]) -> str:
    """What identifies a failed request across runs of the same input: its line (a duplicate
    custom_id's error must not stand for the first, valid request), else its custom_id."""
    line = (record.get("error") or {}).get("line")
    if line is not None:
        return f"line:{line}"
    return f"id:{record.get('custom_id')}"


@dataclass
class Done:
    """What an earlier run of this job wrote: custom_ids with a result, failures by error_key."""

    results: set[str] = field(default_factory=set)
    errors: set[str] = field(default_factory=set)
    repaired: list[str] = field(default_factory=list)  # files whose torn last line was cut


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


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not path.is_file():
        return out
    with open(path, "rb") as f:
        for raw in f:
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # not ours; never fatal
            if isinstance(obj, dict):
                out.append(obj)
    return out


def scan_done(output: Path, errors: Path | None) -> Done:
    """custom_ids already in `output` and failures already in `errors` (torn tails cut first)."""
    done = Done()
    for p in (output, errors):
        if p is not None and repair_torn_tail(p):
            done.repaired.append(str(p))
    for rec in _read_jsonl(output):
        cid = rec.get("custom_id")
        if isinstance(cid, str):
            done.results.add(cid)
    if errors is not None:
        for rec in _read_jsonl(errors):
            done.errors.add(error_key(_plain_error(rec)))
    return done


def _plain_error(rec: dict[str, Any]) -> dict[str, Any]:
    """An errors-file line in either format, as {custom_id, error: {line, ...}}."""
    if "response" in rec:  # openai format: the line number rides in the error body
        body = ((rec.get("response") or {}).get("body") or {}).get("error") or {}
        return {"custom_id": rec.get("custom_id"), "error": {"line": body.get("line")}}
    return rec


class ResultWriter:
    """Appends result and error lines in one of FORMATS; see the module docstring."""

    def __init__(self, output: IO[str], errors_path: Path | None, fmt: str = "moecc", *, model: str = "",
                 sync_every: float = 2.0, append_errors: bool = False):
        if fmt not in FORMATS:
            raise ValueError(f"unknown output format {fmt!r}; expected one of {', '.join(FORMATS)}")
        self.out = output
        self.errors_path = errors_path
        self.fmt = fmt
        self.model = model
        self.sync_every = sync_every
        self._err: IO[str] | None = None
        self._append_errors = append_errors
        self._last_sync = time.monotonic()
        self.created = int(time.time())

    # -- lines ------------------------------------------------------------------------------
    def result(self, custom_id: str, api: str, text: str, token_ids: list[int], finish_reason: str,
               prompt_tokens: int, model: str | None = None) -> None:
        if self.fmt == "moecc":
            line = {"custom_id": custom_id, "text": text, "token_ids": token_ids, "finish_reason": finish_reason,
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(token_ids)}}
        else:
            line = self._openai_result(custom_id, api, text, finish_reason, prompt_tokens, len(token_ids), model)
        self._write(self.out, line)

    def error(self, record: dict[str, Any], api: str = "simple") -> None:
        """`record` = {custom_id, error: {line, field, message}}."""
        if self.errors_path is None:
            return
        if self._err is None:
            self._err = open(self.errors_path, "a" if self._append_errors else "w", encoding="utf-8")
        line = record if self.fmt == "moecc" else self._openai_error(record)
        self._write(self._err, line)

    def _openai_result(self, custom_id: str, api: str, text: str, finish_reason: str, prompt_tokens: int,
                       completion_tokens: int, model: str | None) -> dict[str, Any]:
        rid = _digest("request", custom_id)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        if api == "completions":
            body = {"id": f"cmpl-{rid}", "object": "text_completion", "created": self.created,
                    "model": model or self.model,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
                    "usage": usage}
        else:  # chat, and simple-form lines written in this format
            body = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": self.created,
                    "model": model or self.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": finish_reason}],
                    "usage": usage}
        return {"id": f"batch_req_{rid}", "custom_id": custom_id,
                "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}

    def _openai_error(self, record: dict[str, Any]) -> dict[str, Any]:
        err = record.get("error") or {}
        cid = record.get("custom_id")
        rid = _digest("error", str(cid), str(err.get("line")))
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
        for f in (self.out, self._err):
            if f is None:
                continue
            f.flush()
            try:
                os.fsync(f.fileno())
            except (OSError, ValueError, AttributeError):
                pass  # stdout, a pipe, a StringIO: nothing to sync
        self._last_sync = time.monotonic()

    def close(self) -> None:
        self.sync()
        if self._err is not None:
            self._err.close()
            self._err = None
