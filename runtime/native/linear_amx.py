"""A dense bf16 projection in one native call on a CPU with AMX (linear_amx.c,
`moecc_runtime.native._linear_amx`), over the weight oneDNN packed for its own GEMM (no second
copy): the q/k/v, o, lm_head and dense MLP projections PackedLinear runs, each output written with
streaming stores. In the bench768 bf16 decode-heavy job (512 rows a step) o took 0.43 ms a call
against oneDNN's 0.65, the lm_head 2.5 against 3.5, q/k/v the same (0.50); a whole bf16 job ran
1.03-1.05x faster (bench/results, fifteenth pass).

`linear` returns None, having done nothing, where it does not apply: not built, no AMX here (or
MOECC_NO_NATIVE / MOECC_LINEAR_AMX=0), not bf16, a bias, a layout the probe (amx_gemm.layout)
does not recognise, sizes not in multiples of 32. The caller then runs oneDNN's GEMM. Results:
each sum in fp32 over the inputs in order, rounded once to bf16; oneDNN's GEMM gives the same
bits except where it splits the inputs between threads (then its error against the exact product
is oneDNN's: test_linear_amx.py).
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.native import amx_gemm
from moecc_runtime.native.amx_gemm import layout, scratch_rows
from moecc_runtime.native.packed_layout import raw


def _module() -> Any:
    """The extension, or None where it does not run (amx_gemm.extension)."""
    return amx_gemm.extension("_linear_amx", "moecc_linear_amx", "MOECC_LINEAR_AMX")


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
