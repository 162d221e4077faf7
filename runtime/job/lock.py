"""A job owns its files: an exclusive lock on each file it writes (results and errors) for
the run's life, so two runs on one file cannot interleave, duplicate or tear its lines.

The lock is `flock` on a lock file beside each, `<file>.lock`, never on the file itself, so
a resumed job may replace its output (os.replace, to drop stale lines) without ever leaving
the new file unlocked. The OS releases a flock when its holder dies, so a kill -9 never
leaves a stale lock (a stale `.lock` file is just taken over). The lock file also says who
holds it (pid, host, since), so a refused second run can name the holder.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


class JobLockError(RuntimeError):
    """Another run holds the output file, or the job's files collide."""


class JobFileError(JobLockError):
    """A file the job writes cannot be opened for writing (the message names it and why)."""


class JobIdentityError(JobLockError):
    """`--resume` on files that another job wrote (another plan, or not moecc exec)."""


def check_distinct(prompts: Path, output: Path, errors: Path | None) -> None:
    """Refuse a job whose input, output and errors files are one file."""
    named = [("prompts", prompts), ("output", output)] + ([("errors", errors)] if errors is not None else [])
    for i, (a, pa) in enumerate(named):
        for b, pb in named[i + 1:]:
            if _same(pa, pb):
                raise JobLockError(f"the {a} file and the {b} file are the same file ({pa}); "
                                   f"write results to another path")


def _same(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


@dataclass
class Lock:
    """A held lock: the flock'ed descriptor of `<target>.lock`."""

    target: Path
    fd: int


def acquire(target: Path, role: str) -> Lock:
    """Needs: `target`'s directory writable. Does: flock (exclusive, non-blocking) the lock
    file `<target>.lock`, creating it, and writes the holder (pid, host, since) into it.
    Guarantees: while the Lock is held no other moecc exec holds `target`; the OS drops it
    when this process dies. JobLockError naming the holder when another run has it,
    JobFileError naming `target` and its lock file when that cannot be created."""
    path = holder_path(target)
    for _ in range(100):  # retried only when a holder released (unlinked) the lock file under us
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise JobFileError(f"cannot write the {role} file {target}: {e.strerror or e} (creating its lock "
                               f"file {path}); give {_flag(role)} a path in a directory this user can write") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise JobLockError(f"{target} is being written by another moecc exec ({_holder(target)}); "
                               f"wait for it to finish, or write to another file") from None
        if _still_named(fd, path):
            note = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n"
            os.ftruncate(fd, 0)
            os.pwrite(fd, note.encode(), 0)
            return Lock(target, fd)
        os.close(fd)  # we locked a lock file its holder had just unlinked: take the new one
    raise JobLockError(f"could not lock {path}: it keeps being replaced; is another moecc exec starting "
                       f"and stopping on {target}?")


def _still_named(fd: int, path: Path) -> bool:
    """The descriptor is still the file at `path` (not one unlinked since it was opened)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def release(lock: Lock) -> None:
    """Unlink the lock file, then drop the flock (a run that opened the old file meanwhile
    finds it unlinked once it gets the flock, and takes a fresh one)."""
    try:
        holder_path(lock.target).unlink(missing_ok=True)
    finally:
        os.close(lock.fd)


def holder_path(target: Path) -> Path:
    """The lock file of `target`: `<target>.lock`."""
    return target.with_name(target.name + ".lock")


def _holder(target: Path) -> str:
    try:
        h = json.loads(holder_path(target).read_text())
        return f"pid {h['pid']} on {h['host']}, since {h['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


@dataclass
class JobFiles:
    """The files a job writes (results, errors), open for appending and locked, and what
    this run created (removed again if the job is refused before it runs)."""

    output: Path | None
    errors: Path | None
    out: IO[str] | None = None
    err: IO[str] | None = None
    locks: list[Lock] = field(default_factory=list)
    created: list[Path] = field(default_factory=list)

    def reopen(self) -> None:
        """Open the files afresh (after a resume replaced them on disk)."""
        if self.out is not None and self.output is not None:
            self.out.close()
            self.out = open(self.output, "a", encoding="utf-8")
        if self.err is not None and self.errors is not None:
            self.err.close()
            self.err = open(self.errors, "a", encoding="utf-8")

    def close(self) -> None:
        """Close the files (an errors file left empty is removed: no errors, no file) and
        release the locks."""
        try:
            for f in (self.out, self.err):
                if f is not None:
                    f.close()
            if self.errors is not None and self.err is not None and _empty(self.errors):
                self.errors.unlink(missing_ok=True)
        finally:
            self.out = self.err = None
            for lock in reversed(self.locks):
                release(lock)
            self.locks = []

    def abort(self) -> None:
        """Remove the (still empty) files this run created, close and unlock: a job refused
        before it ran leaves the directory as it found it. (Files are only ever created under
        their lock, so removing them here cannot pull a file from under another run.)"""
        try:
            for p in self.created:
                if _empty(p):
                    p.unlink(missing_ok=True)
        finally:
            self.close()


def _empty(p: Path) -> bool:
    """An empty regular file (never a device such as /dev/null given as a path)."""
    try:
        st = p.stat()
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == 0


def open_job_files(output: Path | None, errors: Path | None, resume: bool) -> JobFiles:
    """Needs: check_distinct passed. Does: locks the output and errors files, then opens
    the errors file (an unwritable path fails at once, naming it and the OS's reason, before
    any output file exists), then the output; empties both unless `resume`. Guarantees: on
    error no lock is held and nothing this call created is left behind."""
    files = JobFiles(output, errors)
    try:
        if output is not None:
            files.locks.append(acquire(output, "output"))
        if errors is not None:
            files.locks.append(acquire(errors, "errors"))
            files.err = _open_append(errors, "errors", files.created)
        if output is not None:
            files.out = _open_append(output, "output", files.created)
    except BaseException:
        files.abort()
        raise
    if not resume:
        for f in (files.out, files.err):
            if f is not None and stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # not /dev/null, a pipe...
                f.truncate(0)
    return files


def _open_append(path: Path, role: str, created: list[Path]) -> IO[str]:
    """`path` opened for appending (created if missing, noted in `created`); JobFileError
    naming the path and the OS's reason when it cannot be."""
    existed = path.exists()
    try:
        f = open(path, "a", encoding="utf-8")
    except OSError as e:
        raise JobFileError(f"cannot write the {role} file {path}: {e.strerror or e}; "
                           f"give {_flag(role)} a path this user can write") from None
    if not existed:
        created.append(path)
    return f


def _flag(role: str) -> str:
    return "--errors" if role == "errors" else "-o"
