"""Which threads the native kernels run on: torch's own OpenMP team where it can be found.

After every torch op, the threads of torch's OpenMP team spin for a while waiting for the next
one; a kernel that starts threads of its own then shares each core with a spinning thread and
runs at about half speed (bench/attention.py: the host-attention kernel 1.3x slower right after
a GEMM). So each kernel library is handed the team's `GOMP_parallel` (cpu.h:
moecc_native_set_team), the entry point `#pragma omp parallel` compiles to, which libgomp,
LLVM's libomp and Intel's libiomp5 all export; the team's threads take the work at once.

Found as the OpenMP runtime this process has mapped (torch loads it; Linux's /proc/self/maps),
the one under torch's own folder first. Elsewhere, when none is mapped, or with
MOECC_NATIVE_TEAM=0, the kernels start threads of their own (as before).
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

import torch

#: file names of the OpenMP runtimes whose GOMP_parallel is the team's entry point
OPENMP_NAMES = ("libgomp", "libiomp5", "libomp")


def mapped_openmp(maps: str, torch_dir: str) -> str | None:
    """The path of the OpenMP runtime among `maps` (the text of /proc/self/maps): one under
    `torch_dir` first, else the first mapped. None: none is."""
    found: list[str] = []
    for line in maps.splitlines():
        fields = line.split(None, 5)  # address, perms, offset, device, inode, path
        path = fields[5].strip() if len(fields) == 6 else ""
        if path.startswith("/") and Path(path).name.startswith(OPENMP_NAMES) and path not in found:
            found.append(path)
    inside = [p for p in found if p.startswith(torch_dir)]
    return (inside or found or [None])[0]


@lru_cache(maxsize=None)
def team_entry() -> int | None:
    """The address of the OpenMP team's GOMP_parallel, or None (see the module docstring)."""
    if os.environ.get("MOECC_NATIVE_TEAM", "1") == "0":
        return None
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    path = mapped_openmp(maps, str(Path(torch.__file__).parent))
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path).GOMP_parallel  # the mapped instance: dlopen of its own path
    except (OSError, AttributeError):
        return None
    return ctypes.cast(fn, ctypes.c_void_p).value


def hand_over(lib: ctypes.CDLL) -> bool:
    """Give kernel library `lib` the team (where found); True when its kernels run on it."""
    entry = team_entry()
    setter = getattr(lib, "moecc_native_set_team", None)
    if entry is None or setter is None:
        return False
    setter.argtypes, setter.restype = [ctypes.c_void_p], ctypes.c_int
    setter(entry)
    return True
