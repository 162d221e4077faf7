"""The sidecar file: a safetensors file of the quantized tensors, written once, tensor by tensor.

Needs: every tensor's name, dtype and shape before the first is written (the header comes
first in a safetensors file). Does: writes the header, then each tensor's bytes at its
offset as it arrives (in any order), and at `finish` rewrites the header with a digest of
all tensors' bytes in its metadata (`content_sha256`, the same length as its placeholder),
so the header hash the plan records names the data too, and with `sources` (the checkpoint
tensors the quantized ones were made from, named in `source_tensors` from the start) a
digest of their contents (`source_sha256`: the sidecar is bound to the checkpoint's values,
not only its headers; exec checks both, moecc_runtime/job/integrity.py); fsyncs.
Guarantees: tensors of 4-byte dtypes come first, so every offset is a multiple of its element
size (the data region starts 8-aligned); the file follows the format moecc_runtime's header reader validates
(checked by reading it back); a failed write leaves no file (`abort`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from moecc_runtime.contract.dtypes import TORCH_DTYPES
from moecc_runtime.memory.safetensors_header import DTYPES, Header, read_header

from moecc.quantize import QuantizeError

#: moecc dtype name -> safetensors dtype code
_CODES = {name: code for code, (name, _) in DTYPES.items()}
_NAMES = {dt: name for name, dt in TORCH_DTYPES.items()}
Layout = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (dtype, shape)


def digest_lines(pairs: Iterable[tuple[str, str]]) -> str:
    """sha256 of "name\tdigest\n" lines, in the order given (moecc_runtime/job/integrity.py
    computes the same)."""
    return hashlib.sha256("".join(f"{n}\t{d}\n" for n, d in pairs).encode()).hexdigest()


def partial_path(final: Path) -> Path:
    """Where this process writes the sidecar `final` until the compile has made its plan."""
    return final.with_name(f"{final.name}.{os.getpid()}.partial")


class SidecarWriter:
    def __init__(self, path: Path, layout: Layout, metadata: dict[str, str], sources: list[str] | None = None):
        """`sources`: the checkpoint tensors the sidecar is made from (their digests are due
        at `finish`)."""
        self.path, self.metadata = path, dict(metadata)
        self.sources = sorted(set(sources or ()))
        if self.sources:
            self.metadata["source_tensors"] = json.dumps(self.sources, separators=(",", ":"))
            self.metadata["source_sha256"] = "0" * 64  # a placeholder of the digest's length
        order = sorted(layout, key=lambda n: -DTYPES[_CODES[layout[n][0]]][1])  # stable: 4-byte dtypes first
        self.layout = {n: layout[n] for n in order}
        self.offsets: dict[str, tuple[int, int]] = {}
        at = 0
        for name, (dtype, shape) in self.layout.items():
            n = DTYPES[_CODES[dtype]][1]
            for d in shape:
                n *= d
            self.offsets[name] = (at, at + n)
            at += n
        self.data_bytes = at
        self.digests: dict[str, str] = {}
        self.base = 8 + len(self._header("0" * 64))
        self._f = open(path, "wb")
        self._f.write(self._prefix("0" * 64))

    def _header(self, digest: str) -> bytes:
        """The JSON header, padded with spaces so the data starts 8-aligned."""
        head = {"__metadata__": {**self.metadata, "content_sha256": digest},
                **{n: {"dtype": _CODES[dt], "shape": list(shape), "data_offsets": list(self.offsets[n])}
                   for n, (dt, shape) in self.layout.items()}}
        raw = json.dumps(head, separators=(",", ":")).encode("utf-8")
        return raw + b" " * (-(8 + len(raw)) % 8)

    def _prefix(self, digest: str) -> bytes:
        raw = self._header(digest)
        return len(raw).to_bytes(8, "little") + raw

    def write(self, name: str, t: torch.Tensor) -> None:
        """Tensor `name`'s bytes at its offset; its dtype and shape must be the layout's."""
        want = self.layout.get(name)
        have = (_NAMES.get(t.dtype), tuple(t.shape))
        if want is None or have != want:
            raise QuantizeError(f"{self.path}: tensor {name} is {have}, the sidecar's layout says {want} "
                                f"(a moecc bug: the format's stored_layout and quantize disagree)")
        data = t.detach().cpu().contiguous().view(torch.uint8).numpy()
        self._f.seek(self.base + self.offsets[name][0])
        self._f.write(data.data)
        self.digests[name] = hashlib.sha256(data.data).hexdigest()

    def finish(self, sources: dict[str, str] | None = None) -> tuple[int, Header]:
        """Complete the file: (size in bytes, its header as the runtime reads it). `sources`:
        the sha256 of each source tensor's bytes (every name given at construction)."""
        missing = [n for n in self.layout if n not in self.digests]
        if missing:
            raise QuantizeError(f"{self.path}: {len(missing)} tensors were never written (first: {missing[0]})")
        if self.sources:
            absent = [n for n in self.sources if n not in (sources or {})]
            if absent:
                raise QuantizeError(f"{self.path}: no digest of source tensor {absent[0]} (a moecc bug: the "
                                    f"reader never read it)")
            self.metadata["source_sha256"] = digest_lines((n, (sources or {})[n]) for n in self.sources)
        content = digest_lines((n, self.digests[n]) for n in self.layout)
        self._f.seek(self.base + self.data_bytes)
        self._f.truncate()
        self._f.seek(0)
        self._f.write(self._prefix(content))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return self.path.stat().st_size, read_header(self.path)

    def abort(self) -> None:
        """Close and remove the unfinished file."""
        self._f.close()
        self.path.unlink(missing_ok=True)
