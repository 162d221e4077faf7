"""Transparent huge pages for big host buffers (the KV pool): one 2 MiB TLB entry instead of
512, which matters to attention on the host, whose reads land on a few KB of one block at a
random place in a pool of many GB (every block a TLB miss with 4 KiB pages).

Linux only, advice only: `madvise(MADV_HUGEPAGE)` over the buffer's whole 2 MiB pages, before
its pages are first touched; where the kernel has transparent huge pages off ("never"), on
other systems, or when the call fails, nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import lru_cache

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MIN_BYTES = 64 << 20  # smaller buffers are not worth a syscall


@lru_cache(maxsize=1)
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages under CPU tensor `t` (its whole 2 MiB pages); True when the kernel
    took the advice. Never raises."""
    nbytes = t.numel() * t.element_size()
    fn = _madvise()
    if fn is None or t.device.type != "cpu" or nbytes < MIN_BYTES:
        return False
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    return end > start and fn(start, end - start, MADV_HUGEPAGE) == 0
