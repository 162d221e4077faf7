"""Checking, before any work starts, that every path a command will write can be written.

Needs: the path and what it is for (its role and the option that names it). Does: probes the
path the way the write will open it: an existing file is opened for appending (never
truncated), a missing one is created and removed again, a directory to write into is created
(as the command would) and a probe file made and removed in it. Guarantees: a path that
passes can be opened for writing now; one that does not raises PathError, one line naming
the path, the OS's reason and what to do; nothing is left behind but a directory the command
would have created anyway.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class PathError(OSError):
    """A path a command writes cannot be written; the message says which, why, and what to do."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "a path cannot be written"


def _fix(flag: str) -> str:
    return f"give {flag} a path this user can write" if flag else "choose a path this user can write"


def check_file_writable(path: str | os.PathLike[str], role: str, flag: str = "") -> None:
    """PathError unless the file `path` (the `role`, e.g. "plan file", named by option `flag`)
    can be opened for writing: not a directory, its directory existing and writable."""
    p = Path(path)
    if p.is_dir():
        raise PathError(f"cannot write the {role} {p}: it is a directory; {_fix(flag)} (a file's path)")
    parent = p.parent
    if not parent.exists():
        raise PathError(f"cannot write the {role} {p}: directory {parent} does not exist; create it or "
                        f"{_fix(flag)}")
    if not parent.is_dir():
        raise PathError(f"cannot write the {role} {p}: {parent} is not a directory; {_fix(flag)}")
    existed = p.exists() or p.is_symlink()
    try:
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise PathError(f"cannot write the {role} {p}: {e.strerror or e}; {_fix(flag)}") from None
    os.close(fd)
    if not existed:
        try:
            p.unlink()
        except OSError:
            pass


def check_dir_writable(path: str | os.PathLike[str], role: str, flag: str = "") -> None:
    """PathError unless `path` is (or can be made) a directory files can be created in; it
    is created (with its parents) when missing, as the command would create it."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise PathError(f"cannot write the {role} {p}: it exists and is not a directory; {_fix(flag)}")
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".moecc-probe-", dir=p)
    except OSError as e:
        raise PathError(f"cannot write the {role} {p}: {e.strerror or e}; {_fix(flag)}") from None
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError:
        pass


def describe_os_error(e: OSError) -> str:
    """One line for an OSError: its path(s) and the OS's reason (never a traceback)."""
    names = [str(n) for n in (e.filename, e.filename2) if n is not None]
    reason = e.strerror or str(e)
    if isinstance(e, PathError) or not names:
        return str(e) if str(e) else reason
    return f"{' -> '.join(names)}: {reason}"
