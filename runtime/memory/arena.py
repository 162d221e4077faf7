"""The device arena: one allocation, sized by the plan, that every device-resident tensor of
the runtime is carved from (resident weights, weight slots, KV micro-batch buffers, staged
hidden states). On CUDA it is device memory; on a CPU it is separate host memory, so
transfers into it are real copies and `--gpu-mem` is a budget a test can check.

Regions are carved once, at start-up, at 256-byte alignment; each tracks the highest byte
the runtime has used in it, so `peak_bytes` is what the schedule actually touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moecc_runtime.contract.placement import ALIGN, align  # noqa: F401 (the contract's: the planner sizes slots with it)


class ArenaError(Exception):
    """A region or a tensor does not fit the space the plan gave it."""


@dataclass
class Region:
    name: str
    offset: int  # bytes from the arena's base
    nbytes: int
    base: torch.Tensor = field(repr=False)  # [nbytes] uint8, this region's bytes
    high: int = 0  # highest byte used, relative to the region

    def view(self, offset: int, shape: tuple[int, ...] | list[int], dtype: torch.dtype, what: str = "") -> torch.Tensor:
        """A tensor of `shape` at `offset` bytes into the region (offset must be aligned)."""
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if offset % ALIGN or offset < 0:
            raise ArenaError(f"device arena: {what or 'tensor'} at offset {offset} of region {self.name!r} is not "
                             f"{ALIGN}-byte aligned (plan and runtime disagree on slot sizes; recompile the plan)")
        if offset + nbytes > self.nbytes:
            raise ArenaError(f"device arena: {what or 'tensor'} of {nbytes} B at offset {offset} does not fit "
                             f"region {self.name!r} of {self.nbytes} B; the plan's arena is too small for this "
                             f"model or step (recompile with `moecc compile`)")
        self.high = max(self.high, offset + nbytes)
        return self.base[offset:offset + nbytes].view(dtype).view(tuple(int(d) for d in shape))


class DeviceArena:
    def __init__(self, nbytes: int, device: torch.device | str):
        self.device = torch.device(device)
        self.nbytes = align(nbytes)
        # [nbytes] uint8: torch.empty commits pages only when written (CPU) / one cudaMalloc (CUDA)
        self.base = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.regions: dict[str, Region] = {}
        self._top = 0

    def region(self, name: str, nbytes: int) -> Region:
        """Carve `nbytes` (rounded up to the alignment) for `name`."""
        n = align(nbytes)
        if self._top + n > self.nbytes:
            raise ArenaError(
                f"device arena: region {name!r} needs {n} B but only {self.nbytes - self._top} B of the "
                f"{self.nbytes} B arena are left (carved so far: "
                f"{', '.join(f'{r.name}={r.nbytes}' for r in self.regions.values()) or 'nothing'}); "
                f"recompile the plan with a larger --gpu-mem")
        r = Region(name, self._top, n, self.base[self._top:self._top + n])
        self.regions[name] = r
        self._top += n
        return r

    @property
    def carved_bytes(self) -> int:
        return self._top

    @property
    def peak_bytes(self) -> int:
        """Bytes of the arena the runtime has actually used (per region, its highest byte)."""
        return sum(r.high for r in self.regions.values())

    def usage(self) -> dict[str, int]:
        return {name: r.high for name, r in self.regions.items()}

    def close(self) -> None:
        """Give the arena's memory back now, whatever still holds a view of it (a traceback, a
        reference cycle): every region's tensors are empty afterwards. On CUDA it first waits for
        the device's queued work, which may still read or write it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.base.untyped_storage().resize_(0)
