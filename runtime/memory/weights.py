"""Host weight store: every weight slice the plan names, read from memory-mapped
safetensors files at the plan's byte offsets (no copy, no merged expert tensors), and
fetched to the compute device on demand.

On CPU the "fetch" is the mmap view itself. With a device budget, memory/streaming.py
copies slices into the arena instead (`host` and `stored` are what it copies from); the
worker runs plans on CUDA only with such a budget (worker.refuse_unbudgeted_cuda), so
`get`'s CUDA branch (a slice copied to device memory once and kept) serves direct callers
only, never a whole model.

Mixed dtypes: a checkpoint may keep some tensors in another dtype than the one the model
computes in (bf16 matrices with fp32 norms and routers). The plan's `model.info.dtype` is
the compute dtype; a floating slice of another dtype is cast to it when first read (a host
copy, kept), unless an op reads it in fp32 on its own (`fp32_weight_keys`: transformers
keeps those in fp32 too). The manifest keeps each slice's file dtype.
"""

from __future__ import annotations

import mmap
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from moecc_runtime import formats
from moecc_runtime.contract.plan_types import Module
from moecc_runtime.contract.dtypes import TORCH_DTYPES  # noqa: F401 (the contract's table, named here for its readers)


class WeightError(Exception):
    """A weight named by the plan cannot be read from the checkpoint."""


def fp32_weight_keys(schedule: Sequence[Module]) -> frozenset[str]:
    """Manifest keys of the weights of ops whose attrs say `fp32_weights` (DeepSeek's routers:
    their kernel computes in fp32 from the weights as stored, as transformers keeps them in
    fp32): never cast to the compute dtype, so an fp32 gate keeps its precision."""
    return frozenset(k for m in schedule for op in m.ops if op.attrs.get("fp32_weights")
                     for k in op.weights.values())


class WeightStore:
    def __init__(self, manifest: dict[str, dict[str, Any]], model_dir: Path, device: torch.device,
                 compute_dtype: torch.dtype | None = None, keep: Iterable[str] = (),
                 sidecar: Path | None = None):
        """needs: the plan's weight manifest and its checkpoint directory. `compute_dtype`:
        floating slices of another dtype are cast to it when read, except the keys in `keep`
        (None: every slice as stored). `sidecar`: the plan's quantized weights file
        (plan.sidecar_path of where the plan was read), which entries with root "plan" name."""
        self.manifest = manifest
        self.dir = Path(model_dir)
        self.sidecar = sidecar
        self.device = device
        self.compute_dtype = compute_dtype
        self.keep = frozenset(keep)
        self._maps: dict[str, mmap.mmap] = {}
        self._bases: dict[str, torch.Tensor] = {}  # path -> [file bytes] uint8 over its mapping
        # CUDA: read-only shared mappings, so the streamed weights can be page-locked in place
        # (memory/pinned_weights.py) without copy-on-write doubling them; nothing writes them
        self.read_only = torch.device(device).type == "cuda"
        self._host: dict[str, torch.Tensor] = {}
        self._device: dict[str, torch.Tensor] = {}
        self._stored: dict[str, dict[str, torch.Tensor]] = {}  # quantized weights' stored tensors (host)
        self._device_parts: dict[str, dict[str, torch.Tensor]] = {}
        self.bytes_fetched = 0

    def _path(self, entry: dict[str, Any]) -> Path:
        """The file a stored tensor entry is in: a plain name inside the checkpoint directory,
        or (root "plan") the plan's sidecar."""
        fname = entry["file"]
        if entry.get("root") == "plan":
            if self.sidecar is None:
                raise WeightError(f"weight file {fname!r}: the plan's quantized weights file, but this engine was "
                                  f"not told where the plan is (Engine(..., plan_path=...))")
            return self.sidecar
        if fname != Path(fname).name or fname in ("", ".", ".."):
            raise WeightError(f"weight file {fname!r}: not a file name inside {self.dir}; refusing to read it")
        return self.dir / fname

    def _map(self, path: Path) -> mmap.mmap:
        m = self._maps.get(str(path))
        if m is None:
            try:
                with open(path, "rb") as f:
                    # ACCESS_COPY: a private, writable (copy-on-write) view, so torch.frombuffer
                    # needs no copy and never writes back to the checkpoint; ACCESS_READ on CUDA
                    # (see __init__): a write through it would fault, and none is made
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ if self.read_only else mmap.ACCESS_COPY)
                if hasattr(mmap, "MADV_WILLNEED"):  # start the kernel's read-ahead now, off our threads
                    m.madvise(mmap.MADV_WILLNEED)
            except OSError as e:
                raise WeightError(f"{path}: cannot map weight file: {e}") from e
            self._maps[str(path)] = m
        return m

    def host(self, key: str) -> torch.Tensor:
        """The dense slice `key` on the host: a tensor over the memory-mapped file, or (a slice
        stored in another floating dtype than the compute dtype) its cast copy. Kept."""
        t = self._host.get(key)
        if t is None:
            entry = self._entry(key)
            if not formats.is_dense(entry):
                raise WeightError(f"weight {key} is stored as {formats.format_of(entry)}; read its stored "
                                  f"tensors (WeightStore.stored) and materialize them where they are used")
            t = self._view(entry, key)
            if self._casts(key, t):
                t = t.to(self.compute_dtype)  # a copy; the mmap view is dropped
            self._host[key] = t
        return t

    def drop(self, key: str) -> None:
        """Forget the host tensor kept for dense weight `key` (a packed copy serves it now):
        its mapped pages, or its cast copy, are no longer held by the store."""
        self._host.pop(key, None)

    def _casts(self, key: str, t: torch.Tensor) -> bool:
        """Whether slice `key` (as stored: `t`) is cast to the compute dtype when read."""
        cd = self.compute_dtype
        return cd is not None and t.dtype != cd and t.is_floating_point() and key not in self.keep

    def stored(self, key: str) -> dict[str, torch.Tensor]:
        """The stored tensors of weight `key` on the host, by part name ("data" first): what a
        copy into the arena moves. A dense weight's one part is `host(key)`."""
        entry = self._entry(key)
        if formats.is_dense(entry):
            return {"data": self.host(key)}
        parts = self._stored.get(key)
        if parts is None:
            parts = self._stored[key] = {name: self._view(e, f"{key}.{name}")
                                         for name, e in formats.stored_entries(entry).items()}
        return parts

    def mapping(self, t: torch.Tensor) -> tuple[Path, torch.Tensor] | None:
        """The file whose mapping host tensor `t` lies in, and [file bytes] uint8 over that
        mapping; None for a tensor that is not a view of a mapped file (a cast copy)."""
        ptr = t.data_ptr()
        for name, m in self._maps.items():
            base = self._bases.get(name)
            if base is None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a read-only mapping: torch warns, and never writes
                    base = self._bases[name] = torch.frombuffer(m, dtype=torch.uint8) if len(m) else \
                        torch.empty(0, dtype=torch.uint8)
            if base.numel() and base.data_ptr() <= ptr < base.data_ptr() + base.numel():
                return Path(name), base
        return None

    def rebase(self, key: str, parts: dict[str, torch.Tensor]) -> None:
        """Serve weight `key` from `parts` (its stored tensors, by part name, as `stored`
        returns them, e.g. copies in page-locked memory) from now on."""
        if formats.is_dense(self._entry(key)):
            self._host[key] = parts["data"]
        else:
            self._stored[key] = dict(parts)

    def _entry(self, key: str) -> dict[str, Any]:
        entry = self.manifest.get(key)
        if entry is None:
            raise WeightError(f"weight {key} is not in the plan's manifest (plan and runtime disagree)")
        return entry

    def _view(self, entry: dict[str, Any], key: str) -> torch.Tensor:
        """The stored tensor slice `entry` as a tensor over the memory-mapped file, in its file dtype."""
        if entry.get("file") is None:
            raise WeightError(f"weight {key} (checkpoint tensor {entry['tensor']}) has no file in the plan")
        dtype = TORCH_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise WeightError(f"weight {key} (checkpoint tensor {entry['tensor']}): dtype {entry['dtype']} is not one "
                              f"this runtime reads ({', '.join(TORCH_DTYPES)})")
        numel = 1
        for d in entry["shape"]:
            numel *= int(d)
        path = self._path(entry)
        m = self._map(path)
        if entry["offset"] + entry["nbytes"] > len(m):
            raise WeightError(
                f"{path}: tensor {entry['tensor']} lies past the end of the file "
                f"(offset {entry['offset']} + {entry['nbytes']} bytes > {len(m)}); the checkpoint is "
                f"truncated or changed since compile"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.frombuffer(m, dtype=dtype, count=numel, offset=entry["offset"]).view(entry["shape"])

    def get(self, key: str) -> torch.Tensor:
        """Weight `key` in the compute dtype on the compute device: a dense slice fetched once
        and kept; a quantized one's stored tensors fetched once and kept, materialized (dequantized)
        at every call, next to the GEMM that reads it."""
        entry = self._entry(key)
        if not formats.is_dense(entry):
            return formats.materialize(entry, self._on_device(key), self.compute_dtype or torch.float32, key)
        if self.device.type == "cpu":
            return self.host(key)
        t = self._device.get(key)
        if t is None:
            src = self.host(key)
            t = src.to(self.device, non_blocking=False)
            self.bytes_fetched += src.numel() * src.element_size()
            self._device[key] = t
        return t

    def _on_device(self, key: str) -> dict[str, torch.Tensor]:
        """The stored tensors of `key` on the compute device (on CPU: the mmap views)."""
        parts = self.stored(key)
        if self.device.type == "cpu":
            return parts
        dev = self._device_parts.get(key)
        if dev is None:
            dev = self._device_parts[key] = {n: t.to(self.device) for n, t in parts.items()}
            self.bytes_fetched += sum(t.numel() * t.element_size() for t in parts.values())
        return dev

    def close(self) -> None:
        self._bases.clear()
        self._host.clear()
        self._stored.clear()
        self._device_parts.clear()
        self._device.clear()
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a tensor still views it; the GC closes it later
                pass
        self._maps.clear()
