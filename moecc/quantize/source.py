"""Weight slices read from the memory-mapped checkpoint, one at a time.

Needs: the frontend's Checkpoint (tensor locations from the safetensors headers). Does: maps
each weight file read-only (ACCESS_READ: the checkpoint cannot be written through it) and
copies out the one slice a WeightRef names, in fp32; the first read of a tensor also takes
the sha256 of its whole stored bytes (`digests`: what the sidecar is bound to) and the bytes
of every slice read are counted (`bytes_read`). Guarantees: at most one weight slice (and its
fp32 copy) in memory per call; the pages read stay the kernel's page cache; a digest reads
the mapped pages in place (no copy).
"""

from __future__ import annotations

import hashlib
import mmap
import warnings
from pathlib import Path

import torch

from moecc_runtime.contract.dtypes import TORCH_DTYPES
from moecc_runtime.memory.safetensors_header import TensorLocation, slice_of

from moecc.frontend.checkpoint import Checkpoint
from moecc.ir import DTYPE_BYTES, WeightRef


class CheckpointReader:
    """Read-only views of a checkpoint's weight files (close() when done)."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self._maps: dict[str, mmap.mmap] = {}
        self.digests: dict[str, str] = {}  # checkpoint tensor -> sha256 of its stored bytes (first read)
        self.bytes_read = 0  # stored bytes of every slice read

    def read(self, ref: WeightRef) -> torch.Tensor:
        """The slice `ref` names, as an fp32 copy [shape]."""
        loc = self.ckpt.tensors[ref.tensor]
        offset, shape = slice_of(loc, ref.index, ref.rows, DTYPE_BYTES[loc.dtype])
        count = 1
        for d in shape:
            count *= d
        self.bytes_read += count * DTYPE_BYTES[loc.dtype]
        if ref.tensor not in self.digests:
            self.digests[ref.tensor] = self._digest(loc)
        with warnings.catch_warnings():  # the buffer is read-only, and stays so: the view is copied at once
            warnings.simplefilter("ignore")
            view = torch.frombuffer(self._map(loc.file), dtype=TORCH_DTYPES[loc.dtype], count=count, offset=offset)
        return view.view(shape).to(torch.float32, copy=True)  # a copy: nothing keeps the mmap view

    def _digest(self, loc: TensorLocation) -> str:
        """sha256 of one tensor's stored bytes, read in place from the mapped file."""
        view = memoryview(self._map(loc.file))
        try:
            return hashlib.sha256(view[loc.offset:loc.offset + loc.nbytes]).hexdigest()
        finally:
            view.release()

    def _map(self, fname: str) -> mmap.mmap:
        m = self._maps.get(fname)
        if m is None:
            with open(Path(self.ckpt.directory) / fname, "rb") as f:
                m = self._maps[fname] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return m

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a view still exists; the GC closes it
                pass
        self._maps.clear()
