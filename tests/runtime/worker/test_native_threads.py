"""The native kernels run on torch's OpenMP team (runtime/native/threads.py): the runtime is
found among the mapped files, handed to each kernel library, and the work it does there is
the work its own threads did, bit for bit."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from moecc_runtime import native
from moecc_runtime.native import threads
from tests.runtime.worker.test_host_attention import build_case

MAPS = """\
7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0
7f0000002000-7f0000003000 r-xp 00000000 08:01 2 /site/torch/lib/libgomp.so.1
7f0000004000-7f0000005000 rw-p 00000000 00:00 0
7f0000006000-7f0000007000 r-xp 00000000 08:01 3 /site/torch/lib/libtorch_cpu.so
7f0000008000-7f0000009000 r--p 00000000 00:00 0 [vvar]
"""


def test_torchs_own_openmp_runtime_is_preferred():
    assert threads.mapped_openmp(MAPS, "/site/torch") == "/site/torch/lib/libgomp.so.1"
    assert threads.mapped_openmp(MAPS, "/elsewhere") == "/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0"


def test_no_openmp_runtime_mapped_means_none():
    assert threads.mapped_openmp("7f0-7f1 r-xp 0 0:0 0 /lib/libc.so.6\n7f2-7f3 rw-p 0 0:0 0\n", "/t") is None


@pytest.mark.skipif(not sys.platform.startswith("linux") or not native.available(), reason="Linux, native kernel")
def test_kernels_get_the_team():
    assert threads.team_entry() is not None, "torch's OpenMP runtime was not found among the mapped files"
    assert threads.hand_over(native._library())


@pytest.mark.skipif(not native.available(), reason="the native kernel was not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_team_and_own_threads_compute_the_same(dtype):
    """Each (row, head) item is computed by one thread whichever pool runs it: the outputs are
    bit-identical (contexts past several chunks, a window, G = 4 and G = 3)."""
    lib = native._library()
    for G in (4, 3):
        case = dict(D=96, Dv=96, mla=False, Hkv=2, G=G, bs=8, ctx=[700, 65, 64, 300], lo=[0, 0, 1, 130],
                    rows=[3, 0, 1, 2], sinks=False, dtype=dtype, threads=2, layout="dense", sharp=4.0,
                    spare=3, seed=G)
        q, k, v, rows, tables, table_off, ctx, lo, scale, out, _, sinks = build_case(case)
        outs = []
        for team in (threads.team_entry(), None):
            lib.moecc_native_set_team(ctypes.c_void_p(team))
            try:
                o = torch.full_like(out, float("nan"))
                native.paged_attention(q, k, v, rows, tables, table_off, ctx, lo, scale, o, sinks, threads=2)
            finally:
                threads.hand_over(lib)
            outs.append(o)
        assert torch.equal(outs[0], outs[1])
