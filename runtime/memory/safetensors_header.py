"""Safetensors headers, read and validated the way the `safetensors` library validates them,
and the byte range of one weight slice inside a tensor.

A safetensors file is 8 bytes of little-endian header length N, N bytes of JSON header
(`{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}`), then the
data; offsets are relative to the end of the header. A valid header is a JSON object whose
tensors have a known dtype, a shape of non-negative integers and integer offsets with
begin <= end and end - begin = elements x element size, and whose tensors, in offset order,
tile the data region exactly (no gap, no overlap, nothing past the end of the file).

The compiler reads checkpoints through this module and the runtime checks a plan against the
same headers, so both sides agree on every byte a plan names.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the dtype tables (safetensors code -> name and size; name -> size; the compute dtypes): the contract's
from moecc_runtime.contract.dtypes import DTYPES, FLOAT_DTYPES, ITEMSIZE  # noqa: F401
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit


class HeaderError(ValueError):
    """A safetensors header is malformed; the message names the file and the tensor."""


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's bytes are: file (a name in the checkpoint directory) and the
    absolute byte offset of its first element."""

    file: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorLocation]
    sha256: str  # of the header bytes: the tensor layout's fingerprint


def read_header(path: Path) -> Header:
    """Read and validate the header of the safetensors file `path` (data is not read)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise HeaderError(f"{path}: {len(raw)} bytes, too short to be a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise HeaderError(f"{path}: header length {n} does not fit the file ({size} bytes); "
                                  f"is it a safetensors file?")
            text = f.read(n)
    except OSError as e:
        raise HeaderError(f"{path}: cannot read: {e.strerror or e}") from e
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeaderError(f"{path}: header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    tensors = {name: _entry(path, name, meta, 8 + n) for name, meta in header.items() if name != "__metadata__"}
    _check_metadata(path, header.get("__metadata__"))
    _check_tiling(path, tensors, 8 + n, size)
    return Header(tensors, hashlib.sha256(text).hexdigest())


def _entry(path: Path, name: str, meta: Any, base: int) -> TensorLocation:
    where = f"{path}: tensor {name!r}"
    if not isinstance(meta, dict) or set(meta) != {"dtype", "shape", "data_offsets"}:
        raise HeaderError(f"{where}: expected an object with exactly dtype, shape and data_offsets")
    if meta["dtype"] not in DTYPES:
        raise HeaderError(f"{where}: unsupported dtype {meta['dtype']!r} (known: {', '.join(DTYPES)})")
    shape, offsets = meta["shape"], meta["data_offsets"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise HeaderError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise HeaderError(f"{where}: data_offsets {offsets!r} is not a list of two integers")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise HeaderError(f"{where}: data_offsets [{begin}, {end}] must satisfy 0 <= begin <= end")
    dtype, itemsize = DTYPES[meta["dtype"]]
    need = itemsize
    for d in shape:
        need *= d
    if end - begin != need:
        raise HeaderError(f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes but shape {shape} "
                          f"of {meta['dtype']} needs {need}")
    return TensorLocation(path.name, base + begin, end - begin, dtype, tuple(shape))


def _check_metadata(path: Path, meta: Any) -> None:
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise HeaderError(f"{path}: __metadata__ must map strings to strings")


def _check_tiling(path: Path, tensors: dict[str, TensorLocation], base: int, size: int) -> None:
    """In offset order, the tensors cover the data region [base, size) exactly."""
    at = base
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].offset, kv[1].nbytes)):
        if t.offset != at:
            what = "overlaps the tensor before it" if t.offset < at else f"leaves a gap of {t.offset - at} bytes"
            raise HeaderError(f"{path}: tensor {name!r} at data offset {t.offset - base} {what}")
        at += t.nbytes
    if at != size:
        raise HeaderError(f"{path}: the tensors end at byte {at} but the file has {size} bytes "
                          f"(truncated, or data the header does not describe)")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def slice_of(loc: TensorLocation, index: int | None, rows: tuple[int, int] | list[int] | None,
             itemsize: int) -> tuple[int, tuple[int, ...]]:
    """(absolute byte offset, shape) of a weight slice of tensor `loc`: the whole tensor, one
    expert `index` of a fused [E, ...] tensor, and/or rows [r0, r1) of that. Raises
    HeaderError when the slice is not inside the tensor."""
    dims, elem = list(loc.shape), 0
    if index is not None:
        if not (dims and 0 <= index < dims[0]):
            raise HeaderError(f"{loc.file}: expert {index} is outside tensor of shape {loc.shape}")
        elem += index * _prod(dims[1:])
        dims = dims[1:]
    if rows is not None:
        r0, r1 = int(rows[0]), int(rows[1])
        if not (dims and 0 <= r0 <= r1 <= dims[0]):
            raise HeaderError(f"{loc.file}: rows [{r0}, {r1}) are outside shape {tuple(dims)}")
        elem += r0 * _prod(dims[1:])
        dims = [r1 - r0, *dims[1:]]
    return loc.offset + elem * itemsize, tuple(dims)


def _prod(xs: list[int]) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p
