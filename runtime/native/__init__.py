"""The runtime's native kernels, built at install as extensions and called through ctypes (no
torch headers, so one build serves any torch): paged attention on the host over the KV pool in
place (paged_attention.c, `moecc_runtime.native._paged_attention`), the sampler's pass over a
step's logits on the host (sample_rows.c, `moecc_runtime.native._sample_rows`) and the formats'
dequantize on the host (dequant.c, `moecc_runtime.native._dequant`: `dequant_rows()`, a Python
function of the extension itself, called by moecc_runtime.formats._grouped) and the element-wise
passes around an expert's GEMMs and rotary embedding (expert_rows.c / .py and rope.c / .py,
called by worker/kernels.py).

`available()` / `sampling_available()` say whether each was built; `paged_attention(...)` and
`draw_rows(...)` call them on tensors. MOECC_NO_NATIVE=1 turns both off. The attention kernel's
builds (baseline, AVX2, AVX-512, AVX-512 + AVX512-BF16) and MOECC_NATIVE_ISA: isa.py (`attention_isa()`, `use_attention_isa`).
Every kernel runs on torch's own OpenMP threads where they can be found: threads.py.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
from functools import lru_cache
from types import ModuleType
from typing import Callable

import torch

from moecc_runtime.native import isa, threads

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_PTR, _I64, _I64, _INT,  # q, row and head strides, q dtype
             _PTR, _PTR, _INT,  # k, v, kv dtype
             _I64, _I64, _I64, _I64, _I64, _I64,  # k head/block/pos strides, v the same
             _INT, _INT, _INT, _INT, _INT,  # Hkv, G, D, Dv, bs
             _PTR, _I64, _PTR, _PTR, _PTR, _PTR,  # rows, nrows, tables, table_off, ctx, lo
             _PTR, _F32,  # sinks, scale
             _PTR, _I64, _I64, _INT, _INT]  # out, row and head strides, out dtype, threads
#: the native kernels' dtype codes (bf16.h's DT_F32 0, DT_BF16 1); the pool dtypes attention reads
DTYPE_CODES = KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


_DRAW_ARGTYPES = [_PTR, _I64, _I64, _PTR, _I64,  # x, V, row stride, rows, R
                  _PTR, _PTR, _PTR, _PTR, _PTR, _INT,  # inv_t, top_k, top_p, min_p, u, K
                  _PTR, _PTR, _INT]  # out tokens, out candidate ids, threads

#: sample_rows.c's greedy pass: x, dtype, R, V, row stride, out tokens, threads
_GREEDY_ARGTYPES = [_PTR, _INT, _I64, _I64, _I64, _PTR, _INT]

#: dequant.c (runtime/formats/_grouped.py calls it): codes, row bytes, kind, lut16, scale, zero, scale row
#: stride, row groups, R, C, column group, row group, row0, out, out row stride, out dtype, threads
_DEQUANT_ARGTYPES = [_PTR, _I64, _INT, _PTR, _PTR, _PTR, _I64, _PTR,
                     _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _INT, _INT, _INT, _F32, _F32,
                     _PTR, _I64, _INT, _F32]


#: expert_rows.c's silu_mul: gu, row stride, R, I, h, row stride, table, threads
_SILU_MUL_ARGTYPES = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _INT]
#: rope.c: x, row and head strides, T, heads, D, cos, sin, their row stride, out, dtype, threads
_ROPE_ARGTYPES = [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _INT, _INT]
#: rmsnorm.c: x, its row stride, R, H, w, eps, out, dtype, torch's sum width, threads
_RMSNORM_ARGTYPES = [_PTR, _I64, _I64, _I64, _PTR, ctypes.c_float, _PTR, _INT, _INT, _INT]


def dequant_library() -> ctypes.CDLL | None:
    """The formats' host dequantize (dequant.c, `moecc_runtime.native._dequant`), or None when it
    was not built (or MOECC_NO_NATIVE is set)."""
    return _load("_dequant", "moecc_dequant_rows")


@lru_cache(maxsize=None)
def dequant_rows() -> Callable[..., int] | None:
    """dequant.c's entry as a Python function (`_dequant.dequant_rows`, moecc_dequant_rows's
    arguments with pointers as ints or None: no ctypes conversions), or None when it was not built
    (or MOECC_NO_NATIVE is set)."""
    mod = extension("_dequant", "moecc_dequant_rows")
    return None if mod is None else mod.dequant_rows


def ready_extension(module: str, symbol: str, switch: str) -> ModuleType | None:
    """A CPU-specific kernel's extension (`extension(module, symbol)`: the AMX kernels, the fp32
    expert layer on AVX-512) where it runs: built, the environment variable `switch` not "0", and
    its `ready()` saying this CPU and OS run it (asked once); None otherwise, and the caller runs
    its torch path."""
    if os.environ.get(switch, "1") == "0":
        return None
    mod = extension(module, symbol)
    return mod if mod is not None and _ready(mod) else None


@lru_cache(maxsize=None)
def _ready(mod: ModuleType) -> bool:
    return bool(mod.ready())


@lru_cache(maxsize=None)
def extension(module: str, symbol: str) -> ModuleType | None:
    """The built extension `moecc_runtime.native.<module>` imported as a module (its METH_FASTCALL
    entries take pointers as ints: no ctypes conversions), loaded first through `_load` (so its C
    `symbol` is typed and torch's OpenMP team handed over); None when it was not built (or
    MOECC_NO_NATIVE is set)."""
    if _load(module, symbol) is None:
        return None
    return importlib.import_module(f"moecc_runtime.native.{module}")


@lru_cache(maxsize=None)
def _load(module: str, symbol: str) -> ctypes.CDLL | None:
    """The built extension `moecc_runtime.native.<module>` with `symbol` typed, or None."""
    if os.environ.get("MOECC_NO_NATIVE"):
        return None
    spec = importlib.util.find_spec(f"moecc_runtime.native.{module}")
    if spec is None or not spec.origin:
        return None
    lib = ctypes.CDLL(spec.origin)
    fn = getattr(lib, symbol)
    fn.argtypes = {"moecc_paged_attention": _ARGTYPES, "moecc_dequant_rows": _DEQUANT_ARGTYPES,
                   "moecc_greedy_rows": _GREEDY_ARGTYPES, "moecc_silu_mul": _SILU_MUL_ARGTYPES,
                   "moecc_rope": _ROPE_ARGTYPES, "moecc_rmsnorm": _RMSNORM_ARGTYPES}.get(symbol, _DRAW_ARGTYPES)
    fn.restype = ctypes.c_int
    if module == "_paged_attention":
        isa.configure(lib)  # MOECC_NATIVE_ISA
    threads.hand_over(lib)  # torch's OpenMP team runs its threads (MOECC_NATIVE_TEAM)
    return lib


def _library() -> ctypes.CDLL | None:
    return _load("_paged_attention", "moecc_paged_attention")


def available() -> bool:
    """True when the kernel was built at install (and MOECC_NO_NATIVE is unset)."""
    return _library() is not None


def sampling_available() -> bool:
    """True when the sampler's host pass was built at install (and MOECC_NO_NATIVE is unset)."""
    return _load("_sample_rows", "moecc_draw_rows") is not None


def draw_rows(x: torch.Tensor, rows: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor, u: torch.Tensor, K: int, threads: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw rows `rows` [R] of x [*, V] (fp32 logits on the CPU, unit last stride), each with its
    inv_t, top_k (0: off), top_p, min_p and uniform u [R], among its K most likely tokens ->
    (tokens [R] int64, -1 where the K cannot settle the row; the K candidates' ids [R, K],
    best first), in one read of each row (sample_rows.c)."""
    lib = _load("_sample_rows", "moecc_draw_rows")
    assert lib is not None, "moecc_runtime.native: the sampler's host pass was not built"
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.stride(-1) != 1 or x.dim() != 2:
        raise ValueError("draw_rows: x must be a 2-D fp32 CPU tensor with a unit last stride")
    R, V = rows.numel(), x.shape[1]
    r = rows.to(torch.int64).contiguous()
    f = [t.to(torch.float32).contiguous() for t in (inv_t, top_p, min_p, u)]
    k = top_k.to(torch.int64).contiguous()
    if any(t.numel() != R for t in (*f, k)) or K < 1:
        raise ValueError(f"draw_rows: every per-row tensor needs {R} values and K >= 1")
    tok = torch.empty(R, dtype=torch.int64)
    ids = torch.empty((R, K), dtype=torch.int64)
    if R and lib.moecc_draw_rows(x.data_ptr(), V, x.stride(0), r.data_ptr(), R, f[0].data_ptr(), k.data_ptr(),
                                 f[1].data_ptr(), f[2].data_ptr(), f[3].data_ptr(), int(K), tok.data_ptr(),
                                 ids.data_ptr(), int(threads or torch.get_num_threads())) != 0:
        raise MemoryError("draw_rows: the kernel could not allocate its scratch memory")
    return tok, ids


def greedy_rows(x: torch.Tensor) -> torch.Tensor | None:
    """Each row's greedy token of logits x [R, V] (fp32 or bf16 on the CPU, unit last stride) ->
    [R] int64, -1 where the row is not finite: the first index of its largest value, as torch's
    max over the row and isfinite give, in one read of each row (sample_rows.c). None: the pass
    was not built, or x is not such a tensor."""
    lib = _load("_sample_rows", "moecc_greedy_rows")
    if (lib is None or x.device.type != "cpu" or x.dtype not in DTYPE_CODES or x.dim() != 2 or x.stride(-1) != 1
            or x.shape[1] < 1):
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if lib.moecc_greedy_rows(x.data_ptr(), DTYPE_CODES[x.dtype], x.shape[0], x.shape[1], x.stride(0),
                             out.data_ptr(), torch.get_num_threads()) != 0:
        return None
    return out


def attention_isas() -> list[str]:
    """The host-attention kernel's builds this CPU runs, lowest first ([] when not built)."""
    lib = _library()
    return isa.supported(lib) if lib is not None else []


def attention_isa() -> str | None:
    """The build the host-attention kernel runs now (None when not built)."""
    lib = _library()
    return isa.current(lib) if lib is not None else None


def use_attention_isa(name: str) -> None:
    """Run build `name` (baseline, avx2, avx512) from the next call on; raises when the CPU
    lacks it (tests and benchmarks; MOECC_NATIVE_ISA does the same at load)."""
    lib = _library()
    assert lib is not None, "moecc_runtime.native: the paged attention kernel was not built"
    isa.select(lib, name, f"use_attention_isa({name!r})")


def supports(dtype: torch.dtype) -> bool:
    return available() and dtype in KV_DTYPES


def kernel_queries(q: torch.Tensor) -> torch.Tensor:
    """q as paged_attention takes it without a copy it does not need: fp32 or bf16 as it is (a
    bf16 model's queries are not widened here: the kernel widens them, or scores them in bf16),
    any other dtype as fp32; with a unit last stride (row and head strides as they are)."""
    q = q if q.dtype in KV_DTYPES else q.float()
    return q if q.stride(-1) == 1 else q.contiguous()


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor,
                    table_off: torch.Tensor, ctx: torch.Tensor, lo: torch.Tensor, scale: float,
                    out: torch.Tensor, sinks: torch.Tensor | None = None, threads: int | None = None) -> None:
    """out[r] = attention of q[r] over positions lo[r]..ctx[r]-1 of its block table, for every
    r in `rows` (consecutive entries r, r+1, ... with one table_off and lo and ctx one more each,
    a prompt chunk's rows, run as one work item: the same bits as each alone). needs: q [t, Hq, D]
    fp32 or bf16 (bf16 over a bf16 pool: scored by vdpbf16ps where the avx512bf16 build runs,
    else widened exactly) and out [t, Hq, Dv] fp32 or bf16 (the fp32 result rounded as torch's
    conversion rounds it) with unit last stride,
    k [Hkv, NB, bs, D] / v [Hkv, NB, bs, Dv] one layer of the pool (fp32 or bf16, unit last
    stride; latent attention: v a view of k's first Dv elements), tables the concatenated
    block tables and table_off [t] where row r's starts, ctx / lo [t], rows [n], all int64 on
    the CPU; sinks [Hq] fp32 or None. Every block a row reads must exist (not checked here:
    the scheduler's tables are)."""
    lib = _library()
    assert lib is not None, "moecc_runtime.native: the paged attention kernel was not built"
    Hkv, _, bs, D = k.shape
    Dv = v.shape[-1]
    Hq = q.shape[1]
    for name, x in (("q", q), ("out", out), ("k", k), ("v", v)):
        if x.stride(-1) != 1 or x.device.type != "cpu":
            raise ValueError(f"paged_attention: {name} must be a CPU tensor with a unit last stride")
    if q.dtype not in KV_DTYPES or out.dtype not in KV_DTYPES or k.dtype != v.dtype or k.dtype not in KV_DTYPES:
        raise ValueError(f"paged_attention: q, out and K/V fp32 or bf16, got {q.dtype}, "
                         f"{out.dtype}, {k.dtype}")
    t = q.shape[0]
    if Hq % Hkv or q.shape[-1] != D or tuple(out.shape) != (t, Hq, Dv) or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"paged_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"out {tuple(out.shape)}: need q [t, Hq, D] with Hq a multiple of Hkv, "
                         f"k [Hkv, NB, bs, D], v [Hkv, NB, bs, Dv], out [t, Hq, Dv]")
    if sinks is not None and sinks.numel() != Hq:
        raise ValueError(f"paged_attention: sinks has {sinks.numel()} values for {Hq} query heads")
    if any(x.numel() != t for x in (table_off, ctx, lo)):
        raise ValueError(f"paged_attention: table_off, ctx and lo need one value per query row ({t})")
    idx = [x.contiguous() for x in (rows, tables, table_off, ctx, lo)]
    if any(x.dtype != torch.int64 for x in idx):
        raise ValueError("paged_attention: rows, tables, table_off, ctx and lo must be int64")
    sk = sinks.float().contiguous() if sinks is not None else None
    rc = lib.moecc_paged_attention(
        q.data_ptr(), q.stride(0), q.stride(1), KV_DTYPES[q.dtype], k.data_ptr(), v.data_ptr(), KV_DTYPES[k.dtype],
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        Hkv, Hq // Hkv, D, Dv, bs, idx[0].data_ptr(), idx[0].numel(), idx[1].data_ptr(), idx[2].data_ptr(),
        idx[3].data_ptr(), idx[4].data_ptr(), sk.data_ptr() if sk is not None else None, float(scale),
        out.data_ptr(), out.stride(0), out.stride(1), KV_DTYPES[out.dtype], int(threads or torch.get_num_threads()))
    if rc != 0:
        raise MemoryError("paged_attention: the kernel could not allocate its scratch memory")
