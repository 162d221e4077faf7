"""File contents on disk under the data directory, written so that none is ever half there.

Layout of `--data-dir`: `server.db` (store.py), `files/<id>` (one blob per file, named by the
server's own id, never by a client string), `tmp/` (uploads and merged outputs being
written), `batches/<batch id>/` (a batch's work: parts, their results), `plans/` (plans.py).

Needs: one server per data directory (main.py holds `server.lock`). Does: a blob is written
to `tmp/`, fsync'ed, renamed into `files/` and its directory fsync'ed; only then does the
caller insert its row. Guarantees: a blob a row names is complete; after a crash, `sweep`
removes what no row names (a half-written upload, a merge interrupted before its commit).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path
from typing import IO, Iterator
from contextlib import contextmanager

_BLOB = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def fsync_dir(d: Path) -> None:
    """fsync a directory (a rename in it is then on disk)."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Blobs:
    """The `files/`, `tmp/` and `batches/` directories of a data directory."""

    def __init__(self, data_dir: Path) -> None:
        self.root = data_dir
        self.files = data_dir / "files"
        self.tmp = data_dir / "tmp"
        self.work = data_dir / "batches"
        for d in (self.files, self.tmp, self.work):
            d.mkdir(parents=True, exist_ok=True)

    def path(self, blob: str) -> Path:
        """Where blob `blob` lives; ValueError for a name the server would never make."""
        if not _BLOB.match(blob):
            raise ValueError(f"not a blob name: {blob!r}")
        return self.files / blob

    def work_dir(self, batch_id: str) -> Path:
        """A batch's work directory (created)."""
        d = self.work / self.path(batch_id).name
        d.mkdir(exist_ok=True)
        return d

    @contextmanager
    def writing(self) -> Iterator[tuple[IO[bytes], Path]]:
        """A new temporary file in `tmp/` (yielded open, with its path), fsync'ed and closed
        on exit; removed if the block raises. `commit` then publishes it."""
        tmp = self.tmp / f"w-{secrets.token_hex(12)}"
        f = open(tmp, "xb")
        try:
            yield f, tmp
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            f.close()
            tmp.unlink(missing_ok=True)
            raise
        f.close()

    def commit(self, tmp: Path, blob: str) -> Path:
        """Move a finished temporary file to blob `blob`, durably."""
        dest = self.path(blob)
        os.replace(tmp, dest)
        fsync_dir(self.files)
        return dest

    def remove(self, blob: str) -> None:
        self.path(blob).unlink(missing_ok=True)

    def sweep(self, known: set[str], batches: set[str]) -> list[str]:
        """Remove every temporary file, every blob no row names (`known`) and the work
        directory of every batch not in `batches` (those still to finish); what it removed."""
        gone = []
        for p in self.tmp.iterdir():
            gone.append(str(p))
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        for p in self.files.iterdir():
            if p.name not in known:
                gone.append(str(p))
                p.unlink(missing_ok=True)
        for p in self.work.iterdir():
            if p.name not in batches:
                shutil.rmtree(p, ignore_errors=True)
        return gone
