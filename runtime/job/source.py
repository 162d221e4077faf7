"""Where a job's prompts come from: a regular file (read as often as the job needs: a count for
the progress total, a pass for --resume, the run), or a stream a shell points at (`-` for
stdin, /dev/stdin, a pipe, a FIFO, a character device), which is opened once and read once,
as it comes.

Needs: a path as given on the command line. Does: tells the two apart by stat (never by
opening: opening a FIFO blocks until a writer comes, and a FIFO opened twice loses what the
first reader took). Guarantees: a stream is opened at most once (`open_stream`); a missing
path or a directory raises its OSError naming the path, before anything is opened.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

STDIN = "-"  # the prompts argument that means standard input


class StreamInputError(ValueError):
    """A job asks of a stream what only a file can give (reading it twice: --resume)."""


@dataclass
class PromptSource:
    """The prompts input: `path` as given, `name` for messages, `stream` when it can be read
    only once (stdin, a pipe, a FIFO, a character device)."""

    path: str
    name: str
    stream: bool
    _opened: list[IO[bytes]] = field(default_factory=list, repr=False)

    def open_stream(self) -> IO[bytes]:
        """The stream, opened on the first call (a FIFO: blocks until a writer opens it) and
        the same handle after: a stream is opened once per job, never reopened (a FIFO
        reopened would lose what the first reader took)."""
        if not self.stream:
            raise StreamInputError(f"{self.name} is a regular file; open it by its path")
        if not self._opened:
            self._opened.append(sys.stdin.buffer if self.path == STDIN else open(self.path, "rb"))
        return self._opened[0]

    def close(self) -> None:
        """Close what open_stream opened (never the process's own stdin)."""
        for f in self._opened:
            if f is not getattr(sys.stdin, "buffer", None):
                f.close()

    def refuse_resume(self) -> None:
        """StreamInputError when --resume is asked on a stream, saying why."""
        if self.stream:
            raise StreamInputError(
                f"--resume cannot read the prompts from {self.name}: it is a stream (stdin, a pipe or a FIFO), "
                f"which can be read only once, and resume must read the input once to check what the earlier "
                f"run wrote and again to run what is left; write the prompts to a file and pass its path")


def prompt_source(path: str | os.PathLike[str]) -> PromptSource:
    """The PromptSource of `path` (`-`: stdin). A missing path raises FileNotFoundError, a
    directory IsADirectoryError, each naming the path."""
    p = os.fspath(path)
    if p == STDIN:
        return PromptSource(p, "<stdin>", True)
    st = os.stat(p)  # follows /dev/stdin -> /proc/self/fd/0 -> the pipe
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), p)
    return PromptSource(p, p, not stat.S_ISREG(st.st_mode))


def is_stream(path: str | os.PathLike[str] | Path) -> bool:
    """Whether `path` names a stream (see PromptSource); False for a missing path."""
    try:
        return prompt_source(path).stream
    except OSError:
        return False
