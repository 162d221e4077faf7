"""A dense bf16 projection in one native call on a CPU with AMX (linear_amx.c,
`moecc_runtime.native._linear_amx`), over the weight oneDNN packed for its own GEMM (no second
copy): the q/k/v, o, lm_head and dense MLP projections PackedLinear runs. oneDNN's GEMM pads the
rows up to a bucket (packed_weights.bucket_rows) and, at some row counts, runs on one thread: at
a bf16 job's 96-8,192 rows the same products ran 1.2-3x slower in the job than this call.

`linear` returns None, having done nothing, where it does not apply: not built, no AMX here (or
MOECC_NO_NATIVE / MOECC_LINEAR_AMX=0), not bf16, a bias, a layout the probe (expert_amx.layout)
does not recognise, sizes not in multiples of 32. The caller then runs oneDNN's GEMM. Results:
each sum in fp32 over the inputs in order, rounded once to bf16; oneDNN's GEMM gives the same
bits except where it splits the inputs between threads (then within one bf16 step).
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.native import ready_extension
from moecc_runtime.native.expert_amx import layout
from moecc_runtime.native.packed_layout import raw

MAX_ROWS = 512  #: rows per chunk (linear_amx.c's MAX_ROWS)


def scratch_rows(m: int, threads: int) -> int:
    """Rows of the scratch linear_amx.c copies `m` rows into as tiles on `threads` threads: one
    chunk of up to MAX_ROWS, or past that one chunk per thread (the chunks a multiple of the
    threads in number, about equal in size), each rounded up to 16."""
    if m <= MAX_ROWS or threads <= 1:
        return -(-min(m, MAX_ROWS) // 16) * 16
    chunks = -(-m // (MAX_ROWS * threads)) * threads
    rows = -(-m // chunks)  # a chunk's (linear_amx.c's j.rows)
    return -(-rows // 16) * 16 * threads


def _module() -> Any:
    """The extension, or None: not built, turned off, no AMX on this CPU/OS, or a torch that does
    not let its oneDNN tensors' bytes be read."""
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "data_ptr") and hasattr(ops, "_nbytes")):
        return None
    return ready_extension("_linear_amx", "moecc_linear_amx", "MOECC_LINEAR_AMX")


def linear(x: torch.Tensor, w: Any) -> torch.Tensor | None:
    """x . W^T without a bias: [..., K] bf16 -> [..., N] bf16, W a bf16 PackedLinear [N, K]; None
    where the kernel does not apply (nothing done; module docstring)."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != w.in_features:
        return None
    mod = _module()
    m, K, N = x.numel() // max(1, w.in_features), w.in_features, w.out_features
    nb = layout(N, K, w.rows_hint) if mod is not None and m > 0 else None
    if nb is None:
        return None
    rows = x.reshape(m, K)  # [M, K]: a view where x's rows are evenly spaced, else a copy
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    threads = torch.get_num_threads()
    a = x.new_empty((scratch_rows(m, threads), K))  # the kernel's scratch (tiles)
    y = x.new_empty((m, N))  # [M, N]
    rc = mod.linear(rows.data_ptr(), rows.stride(0), m, K, N, raw(w.packed), nb, a.data_ptr(), y.data_ptr(), N,
                    threads)
    return y.view(*x.shape[:-1], N) if rc == 0 else None
