"""The sidecar file: a safetensors file of the quantized tensors, written once, tensor by tensor.

Needs: every tensor's name, dtype and shape before the first is written (the header comes
first in a safetensors file). Does: writes the header, then each tensor's bytes at its
offset as it arrives (in any order), and at `finish` rewrites the header with a digest of
all tensors' bytes in its metadata (`content_sha256`, the same length as its placeholder),
so the header hash the plan records names the data too; fsyncs. Guarantees: tensors of
4-byte dtypes come first, so every offset is a multiple of its element size (the data region
starts 8-aligned); the file follows the format moecc_runtime's header reader validates
(checked by reading it back); a failed write leaves no file (`abort`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from moecc_runtime.memory.safetensors_header import DTYPES, Header, read_header
from moecc_runtime.memory.weights import TORCH_DTYPES

from moecc.quantize import QuantizeError

#: moecc dtype name -> safetensors dtype code
_CODES = {name: code for code, (name, _) in DTYPES.items()}
_NAMES = {dt: name for name, dt in TORCH_DTYPES.items()}
Layout = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (dtype, shape)


def partial_path(final: Path) -> Path:
    """Where this process writes the sidecar `final` until the compile has made its plan."""
    return final.with_name(f"{final.name}.{os.getpid()}.partial")


class SidecarWriter:
    def __init__(self, path: Path, layout: Layout, metadata: dict[str, str]):
        self.path, self.metadata = path, dict(metadata)
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

    def finish(self) -> tuple[int, Header]:
        """Complete the file: (size in bytes, its header as the runtime reads it)."""
        missing = [n for n in self.layout if n not in self.digests]
        if missing:
            raise QuantizeError(f"{self.path}: {len(missing)} tensors were never written (first: {missing[0]})")
        content = hashlib.sha256("".join(f"{n}\t{self.digests[n]}\n" for n in self.layout).encode()).hexdigest()
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
