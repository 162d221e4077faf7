"""Grouped dequantization, shared by the formats whose weights are rows of codes with one scale
(and zero point) per group of columns and rows: int8_channel, int4_group, fp8_block, mxfp4,
nvfp4, ct_naive and ct_packed describe their stored tensors as a `Grouped` and `dequantize`
writes the compute-dtype weight straight into its destination.

Element (r, c) is code c of row r (a byte, or a nibble: low for even c, high for odd; AWQ's
nibble order; or, packed along rows, value r % k of word (r // k, c)), decoded exactly to fp32
v; with the scale grid index i = (g_idx[r] or (r + row0) // group_r, c // group_c),

    w[r, c] = (v - zero[i]) * scale[i]      (zero_const for zero without a zero tensor)

where a scale is an fp32 value, or (scale_mul given: NVFP4's blocks) an e4m3 code's value times
scale_mul, one fp32 product, as the format's reference makes its block scales;

in fp32, then rounded once to the compute dtype. That is the arithmetic every format's
`reference` does (the original whole-tensor torch code, kept for the tests), so the result is
bit-identical to it. Two paths compute it:
- on the CPU, dequant.c (moecc_runtime.native.dequant_rows) in one pass over the codes, no
  temporary, on the calling thread (torch's thread count for weights of NATIVE_THREADED_MIN
  elements or more);
- anywhere else (a GPU, or the extension not built), torch in chunks of rows: fp32 temporaries
  of at most CHUNK elements, never of a whole module.

Legend: R = rows, C = columns as stored, SR = scale rows, G = column groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moecc_runtime import native
from moecc_runtime.formats._packing import AWQ_REVERSE, unpack_cols, unpack_rows

#: code kinds: (dequant.c's number, the torch dtype a byte is read as; None: nibbles)
KINDS: dict[str, tuple[int, torch.dtype | None]] = {
    "int8": (0, torch.int8), "uint8": (1, torch.uint8), "e4m3": (2, torch.float8_e4m3fn),
    "e5m2": (3, torch.float8_e5m2), "nibble": (4, None),
    "awq": (5, None),  # nibbles of int32 words in AutoAWQ's order (awq.py)
    "wrow4": (6, None), "wrow8": (7, None)}  # int32 words [R / k, C] packed along rows (GPTQ's qweight)
OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NIBBLES = tuple(float(i) for i in range(16))  # a nibble read as its unsigned value
CHUNK = 1 << 20  # elements of fp32 temporaries per chunk on the torch path (4 MiB each)


@dataclass(slots=True)
class Grouped:
    """A weight's stored codes and scale grid as dequant.c reads them (see the module docstring)."""

    codes: torch.Tensor  # [R, row_bytes] uint8, unit last stride
    kind: str  # a key of KINDS
    scale: torch.Tensor  # [SR, G] fp32, or float8_e4m3fn codes when scale_mul is given
    R: int
    C: int
    group_c: int
    group_r: int = 1
    row0: int = 0
    zero: torch.Tensor | None = None  # [SR, G] fp32
    lut: tuple[float, ...] | None = None  # nibbles: the 16 values by nibble
    g_idx: torch.Tensor | None = None  # [R] int32: each row's scale row (else (r + row0) // group_r)
    scale_mul: torch.Tensor | None = None  # [] fp32: scale holds e4m3 codes, each times this (groups of columns)
    zero_const: float = 0.0  # the zero point of every group when zero and zero_codes are None
    #: or the zero points as stored codes (a scale per column only): [SR, bytes] uint8 of kind
    #: zero_kind ("nibble": GPTQ's qzeros, "awq": AutoAWQ's, "uint8"), each plus zero_add
    zero_codes: torch.Tensor | None = None
    zero_kind: str = "nibble"
    zero_add: float = 0.0


def as_bytes(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Stored codes of any 1-byte or int32 dtype -> [rows, bytes per row] uint8 (a view when
    the rows are dense)."""
    if t.stride(-1) != 1 or not t.is_contiguous():
        t = t.contiguous()
    return t.view(torch.uint8).reshape(rows, -1)


def dequantize(g: Grouped, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight [R, C] in `dtype` (float32, bfloat16 or float16) on the codes' device, written
    into `out` when given (R x C elements of `dtype` on that device, dense: it is viewed [R, C])."""
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dequantize: compute dtype {dtype} is not one of {list(OUT_DTYPES)}")
    if out is None:
        out = torch.empty((g.R, g.C), dtype=dtype, device=g.codes.device)
    elif out.dtype != dtype or out.numel() != g.R * g.C or out.device != g.codes.device or not out.is_contiguous():
        raise ValueError(f"dequantize: out must be a dense {dtype} tensor of {g.R}x{g.C} elements on "
                         f"{g.codes.device}, got {out.dtype} {list(out.shape)} on {out.device}")
    out = out.view(g.R, g.C)
    if g.codes.device.type == "cpu" and native.dequant_library() is not None:
        _native(g, out)
    else:
        _torch(g, out)
    return out


#: elements below which dequant.c runs on the calling thread alone: starting threads next to
#: torch's intra-op pool (whose workers spin after each op) cost more than they save on weights
#: of a few million elements (a decode step of the weight_formats bench: 608 us per int4
#: [768, 256] weight with 2 threads against 89 us alone)
NATIVE_THREADED_MIN = 1 << 24


def _threads(g: Grouped) -> int:
    """Threads for dequant.c on `g`: torch's count for a big weight, else 1."""
    return torch.get_num_threads() if g.R * g.C >= NATIVE_THREADED_MIN else 1


def _native(g: Grouped, out: torch.Tensor) -> None:
    """dequant.c into out [R, C] (CPU tensors)."""
    fn = native.dequant_rows()
    assert fn is not None
    codes = g.codes if g.codes.stride(-1) == 1 else g.codes.contiguous()
    scale = (g.scale.contiguous().view(torch.uint8) if g.scale_mul is not None  # e4m3 codes, decoded by dequant.c
             else g.scale.float().contiguous())
    zero = g.zero.float().contiguous() if g.zero is not None else None
    lut = _lut(g.lut, _CPU) if g.lut is not None else None
    gidx = g.g_idx.to(torch.int32).contiguous() if g.g_idx is not None else None
    zc = g.zero_codes.contiguous() if g.zero_codes is not None else None
    rc = fn(codes.data_ptr(), codes.stride(0) if codes.shape[0] > 1 else codes.shape[-1], KINDS[g.kind][0],
            lut.data_ptr() if lut is not None else None, scale.data_ptr(), zero.data_ptr() if zero is not None else None,
            scale.shape[-1], gidx.data_ptr() if gidx is not None else None, g.R, g.C, g.group_c, g.group_r, g.row0,
            out.data_ptr(), out.stride(0) if g.R > 1 else g.C, OUT_DTYPES[out.dtype], _threads(g),
            int(g.scale_mul is not None),
            zc.data_ptr() if zc is not None else None, zc.stride(0) if zc is not None else 0, KINDS[g.zero_kind][0],
            float(g.scale_mul) if g.scale_mul is not None else 1.0, g.zero_const, g.zero_add)
    if rc != 0:
        raise ValueError(f"dequant.c refused a {g.kind} weight [{g.R}, {g.C}] (row bytes {codes.shape[-1]}, "
                         f"groups {g.group_r}x{g.group_c}): a format described its stored tensors wrongly")


_CPU = torch.device("cpu")
_LUTS: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}


def _lut(values: tuple[float, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """[16] fp32 of a nibble table on `device` (made once per table and device: no copy per use)."""
    key = (values, device if isinstance(device, torch.device) else torch.device(device))
    t = _LUTS.get(key)
    if t is None:
        t = _LUTS[key] = torch.tensor(values, dtype=torch.float32, device=key[1])
    return t


def values(g: Grouped, r0: int, r1: int) -> torch.Tensor:
    """fp32 values [r1 - r0, C] of rows r0..r1-1's codes (exact)."""
    if g.kind in ("wrow4", "wrow8"):
        k = 8 if g.kind == "wrow4" else 4
        words = g.codes[r0 // k:-(-r1 // k)].view(torch.int32)  # [w, C]
        return unpack_rows(words, 32 // k)[r0 % k:r0 % k + r1 - r0, :g.C].float()  # [n, C]
    codes = g.codes[r0:r1]
    if g.kind == "awq":
        v = unpack_cols(codes.view(torch.int32), 4)  # [n, 8 W] in nibble order
        return v.unflatten(-1, (-1, 8))[..., list(AWQ_REVERSE)].flatten(-2)[:, :g.C].float()  # [n, C]
    if g.kind == "nibble":
        assert g.lut is not None
        lut = _lut(g.lut, codes.device)
        idx = torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2)[:, :g.C]  # [n, C] uint8
        return lut[idx.long()]
    dt = KINDS[g.kind][1]
    return codes[:, :g.C].view(dt).float()  # [n, C]


def _per_element(t: torch.Tensor, g: Grouped, r0: int, r1: int) -> torch.Tensor:
    """A scale-grid tensor [SR, G] -> its values for rows r0..r1-1, per element [n, C]."""
    rows = (g.g_idx[r0:r1].long().to(t.device) if g.g_idx is not None
            else (torch.arange(r0, r1, device=t.device) + g.row0) // g.group_r)  # [n]
    return t.float()[rows].repeat_interleave(g.group_c, dim=-1)[:, :g.C]  # [n, C]


def _torch(g: Grouped, out: torch.Tensor) -> None:
    """The same arithmetic in torch, CHUNK elements of rows at a time, into out [R, C]."""
    step = max(1, CHUNK // max(g.C, 1))
    for r0 in range(0, g.R, step):
        r1 = min(g.R, r0 + step)
        v = values(g, r0, r1)  # [n, C]
        if g.zero is not None or g.zero_codes is not None:
            v = v - _per_element(g.zero if g.zero is not None else _zeros(g), g, r0, r1)
        elif g.zero_const:
            v = v - g.zero_const
        out[r0:r1].copy_(v * _per_element(_scales(g), g, r0, r1))  # [n, C], rounded once to out's dtype


def _zeros(g: Grouped) -> torch.Tensor:
    """The fp32 zero grid [SR, C] of zeros stored as codes (zero_codes), plus zero_add."""
    assert g.zero_codes is not None
    z = values(Grouped(g.zero_codes, g.zero_kind, g.scale, g.zero_codes.shape[0], g.C, 1, lut=NIBBLES), 0,
               g.zero_codes.shape[0])  # [SR, C]
    return z + g.zero_add


def _scales(g: Grouped) -> torch.Tensor:
    """The fp32 scale grid [SR, G] (e4m3 codes times scale_mul made here, as the reference does)."""
    if g.scale_mul is None:
        return g.scale
    return g.scale.float() * g.scale_mul.float().reshape(())


def run(g: Grouped | None, dtype: torch.dtype, out: torch.Tensor | None, reference: Callable[[], torch.Tensor],
        transpose: bool = False) -> torch.Tensor:
    """A format's materialize: `g` dequantized (transposed: the [C, R] view of it), or, when the
    format's stored tensors are not a Grouped (g None) or dtype is not a compute dtype, its
    `reference()`; written into `out` when given."""
    if g is None or dtype not in OUT_DTYPES:
        w = reference()
        if out is None:
            return w
        o = out.view(w.t().shape).t() if transpose else out.view(w.shape)
        return o.copy_(w)
    w = dequantize(g, dtype, out)  # [R, C]
    return w.t() if transpose else w
