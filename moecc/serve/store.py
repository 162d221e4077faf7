"""Files, batches and their state in SQLite (WAL mode, fsync'ed on every commit).

Needs: a data directory of its own (one server at a time: `main.py` locks it). Does: one
connection, shared by the HTTP threads and the runner under a lock; every change is one
transaction; batch state moves only by `transition`, which names the states it may leave
(a cancel racing the runner cannot be overwritten). Guarantees: what a call returned as
committed survives a SIGKILL of the process (synchronous=FULL); ids are 24 random base62
characters after their prefix (`file-`, `batch_`), unguessable.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import string
import threading
import time
from pathlib import Path
from typing import Any, Iterable

_ALPHABET = string.ascii_letters + string.digits
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # not finished
TERMINAL = ("completed", "failed", "expired", "cancelled")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, owner TEXT NOT NULL, bytes INTEGER NOT NULL,
  created_at INTEGER NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL, blob TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, owner TEXT NOT NULL, endpoint TEXT NOT NULL,
  input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL, metadata TEXT,
  errors TEXT, output_file_id TEXT, error_file_id TEXT, created_at INTEGER NOT NULL, in_progress_at INTEGER,
  expires_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER,
  cancelling_at INTEGER, cancelled_at INTEGER, total INTEGER NOT NULL DEFAULT 0,
  completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
  input_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0,
  run_seconds REAL NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS batches_owner ON batches(owner, seq);
CREATE INDEX IF NOT EXISTS batches_status ON batches(status, seq);
CREATE INDEX IF NOT EXISTS files_owner ON files(owner, seq);
"""
_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
          "cancelling_at", "cancelled_at")


def new_id(prefix: str) -> str:
    """`prefix` + 24 random base62 characters (143 bits)."""
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(24))


def now() -> int:
    return int(time.time())


class Store:
    """The server's database at `path` (created on first use)."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self, statements: Iterable[tuple[str, tuple[Any, ...]]]) -> list[int]:
        """Run `statements` in one transaction; the rows each changed."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                counts = [self._db.execute(sql, args).rowcount for sql, args in statements]
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return counts

    def _all(self, sql: str, args: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(r) for r in self._db.execute(sql, args).fetchall()]

    # -- files ------------------------------------------------------------------------------
    def add_file(self, row: dict[str, Any]) -> None:
        """Insert a file row (id, owner, bytes, created_at, filename, purpose, blob)."""
        self._tx([(_insert("files", row), tuple(row.values()))])

    def file(self, owner: str, file_id: str) -> dict[str, Any] | None:
        rows = self._all("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner))
        return rows[0] if rows else None

    def files(self, owner: str, *, purpose: str | None, after: str | None, limit: int,
              order: str) -> tuple[list[dict[str, Any]], bool]:
        """A page of `owner`'s files by creation (order "asc" or "desc"), after the file `after`;
        and whether more follow."""
        op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        where, args = "owner = ?", [owner]
        if purpose is not None:
            where += " AND purpose = ?"
            args.append(purpose)
        if after is not None:
            where += f" AND seq {op} COALESCE((SELECT seq FROM files WHERE id = ? AND owner = ?), -1)"
            args += [after, owner]
        rows = self._all(f"SELECT * FROM files WHERE {where} ORDER BY seq {direction} LIMIT ?", (*args, limit + 1))
        return rows[:limit], len(rows) > limit

    def delete_file(self, owner: str, file_id: str) -> dict[str, Any] | None:
        """Remove a file's row; the row removed (its blob is the caller's to unlink), or None."""
        row = self.file(owner, file_id)
        if row is not None and self._tx([("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner))])[0]:
            return row
        return None

    def blobs(self) -> set[str]:
        """Every blob name a file row names."""
        return {r["blob"] for r in self._all("SELECT blob FROM files")}

    # -- batches ----------------------------------------------------------------------------
    def add_batch(self, row: dict[str, Any], owner: str, limit: int) -> bool:
        """Insert a batch unless `owner` already has `limit` unfinished ones (False then)."""
        with self._lock:
            active = self._all(f"SELECT COUNT(*) AS n FROM batches WHERE owner = ? AND status IN "
                               f"({','.join('?' * len(ACTIVE))})", (owner, *ACTIVE))[0]["n"]
            if active >= limit:
                return False
            self._tx([(_insert("batches", row), tuple(row.values()))])
            return True

    def batch(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        """A batch by id (None: any owner's, for the runner)."""
        if owner is None:
            rows = self._all("SELECT * FROM batches WHERE id = ?", (batch_id,))
        else:
            rows = self._all("SELECT * FROM batches WHERE id = ? AND owner = ?", (batch_id, owner))
        return rows[0] if rows else None

    def batches(self, owner: str | None, *, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """A page of batches, newest first, after the batch `after` (None owner: everyone's)."""
        where, args = ("1", []) if owner is None else ("owner = ?", [owner])
        if after is not None:
            where += " AND seq < COALESCE((SELECT seq FROM batches WHERE id = ?" + \
                     ("" if owner is None else " AND owner = ?") + "), -1)"
            args += [after] + ([] if owner is None else [owner])
        rows = self._all(f"SELECT * FROM batches WHERE {where} ORDER BY seq DESC LIMIT ?", (*args, limit + 1))
        return rows[:limit], len(rows) > limit

    def active_ids(self) -> set[str]:
        """The ids of every batch not yet finished (their work directories are kept)."""
        marks = ",".join("?" * len(ACTIVE))
        return {r["id"] for r in self._all(f"SELECT id FROM batches WHERE status IN ({marks})", ACTIVE)}

    def in_status(self, status: str) -> list[dict[str, Any]]:
        """Every batch in `status`, oldest first."""
        return self._all("SELECT * FROM batches WHERE status = ? ORDER BY seq", (status,))

    def next_batch(self) -> dict[str, Any] | None:
        """The batch the runner should work on now: a cancelling one first, then the oldest
        finalizing, in-progress, then validating one."""
        for status in ("cancelling", "finalizing", "in_progress", "validating"):
            rows = self._all("SELECT * FROM batches WHERE status = ? ORDER BY seq LIMIT 1", (status,))
            if rows:
                return rows[0]
        return None

    def transition(self, batch_id: str, leaving: tuple[str, ...], status: str, **fields: Any) -> bool:
        """Set the batch's status (and `fields`) if it is in one of `leaving`; whether it was."""
        return self.transition_with(batch_id, leaving, status, fields, [])

    def transition_with(self, batch_id: str, leaving: tuple[str, ...], status: str, fields: dict[str, Any],
                        new_files: list[dict[str, Any]]) -> bool:
        """`transition` and the insertion of `new_files`, in one transaction (a finalized
        batch's output and error files appear together with its final status, or not at all)."""
        sets = ", ".join(f"{k} = ?" for k in ("status", *fields))
        sql = f"UPDATE batches SET {sets} WHERE id = ? AND status IN ({','.join('?' * len(leaving))})"
        values = tuple(json.dumps(v) if k in ("errors", "metadata") and v is not None else v
                       for k, v in fields.items())
        with self._lock:
            row = self.batch(batch_id)
            if row is None or row["status"] not in leaving:
                return False
            stmts = [(sql, (status, *values, batch_id, *leaving))]
            stmts += [(_insert("files", f), tuple(f.values())) for f in new_files]
            return self._tx(stmts)[0] == 1

    def set_counts(self, batch_id: str, **counts: Any) -> None:
        """Live figures of a running batch (total, completed, failed, tokens, run_seconds)."""
        sets = ", ".join(f"{k} = ?" for k in counts)
        self._tx([(f"UPDATE batches SET {sets} WHERE id = ?", (*counts.values(), batch_id))])


def _insert(table: str, row: dict[str, Any]) -> str:
    return f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})"


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    """A file row as OpenAI's File object."""
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "status_details": None,
            "expires_at": None}


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    """A batch row as OpenAI's Batch object."""
    out: dict[str, Any] = {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
                           "errors": json.loads(row["errors"]) if row["errors"] else None,
                           "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
                           "status": row["status"], "output_file_id": row["output_file_id"],
                           "error_file_id": row["error_file_id"]}
    out.update({k: row[k] for k in _TIMES})
    out["request_counts"] = {"total": row["total"], "completed": row["completed"], "failed": row["failed"]}
    out["metadata"] = json.loads(row["metadata"]) if row["metadata"] else None
    out["usage"] = {"input_tokens": row["input_tokens"], "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens": row["output_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": row["input_tokens"] + row["output_tokens"]}
    return out
