"""The process's device memory against the plan's --gpu-mem: cap the CUDA caching allocator
at what the plan allows, and read what the process really holds on the device.

The planner (moecc/planner/solve.py) sizes the arena and every temporary of a step within
(gpu_mem - device reserve) x derate, the device reserve being what the process holds outside
any plan: the CUDA context (0.5-0.9 GB) and the cuBLAS / cuBLASLt workspaces. The plan says
both under `memory.device` (`gpu_mem`, `device_reserve`). Here:

- `cap_process(plan, device)` caps the caching allocator at gpu_mem - device reserve
  (torch.cuda.set_per_process_memory_fraction of the device's total), so an allocation past
  the budget fails as an out-of-memory error of this process instead of taking memory the
  job was not given. The context lives outside the allocator, the library workspaces and the
  allocator's fragmentation inside the cap. A no-op (None) on a CPU or for a plan without
  --gpu-mem. The cap is the process's, so `uncap(cap)` puts back the share it replaced when the
  engine closes (the next engine in the same process, or other work, is not held to it).
- `process_device_bytes(device)` is what the process holds on the device: NVML's figure for
  this process when pynvml imports and knows the device, else total - free from
  cudaMemGetInfo (which also counts other processes on the same GPU). None on a CPU.

Imports torch only; never the compiler.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DeviceCap:
    """The cap applied: the plan's --gpu-mem, its device reserve, the allocator's share of the
    device (`fraction` of `total` bytes)."""

    gpu_mem: int
    reserve: int
    total: int
    fraction: float
    index: int = 0
    previous: float = 1.0  # the allocator's share before the cap, put back by `uncap`

    @property
    def allocator_bytes(self) -> int:
        """Bytes the caching allocator may reserve under the cap."""
        return int(self.total * self.fraction)


def plan_device_budget(plan: dict[str, Any]) -> tuple[int | None, int]:
    """(--gpu-mem the plan was compiled for, its device reserve) from `memory.device`; None
    and 0 for a plan without them (compiled without --gpu-mem, or by an older moecc)."""
    dev = (plan.get("memory") or {}).get("device") or {}
    gpu_mem = dev.get("gpu_mem")
    return (int(gpu_mem) if gpu_mem is not None else None), int(dev.get("device_reserve") or 0)


def cap_process(plan: dict[str, Any], device: torch.device | str) -> DeviceCap | None:
    """Cap the CUDA caching allocator of `device` at the plan's --gpu-mem less its device
    reserve (see the module docstring); None, changing nothing, on a CPU or without a budget.
    MOECC_NO_DEVICE_CAP=1 turns it off (e.g. to measure what a plan would take uncapped)."""
    device = torch.device(device)
    gpu_mem, reserve = plan_device_budget(plan)
    if device.type != "cuda" or gpu_mem is None or os.environ.get("MOECC_NO_DEVICE_CAP", "") not in ("", "0"):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = int(torch.cuda.get_device_properties(index).total_memory)
    allowed = max(1, gpu_mem - reserve)
    fraction = min(1.0, allowed / total)
    previous = _current_fraction(index)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return DeviceCap(gpu_mem, reserve, total, fraction, index, previous)


def uncap(cap: DeviceCap | None) -> None:
    """Put back the allocator's share that `cap_process` replaced; nothing for None."""
    if cap is not None:
        torch.cuda.set_per_process_memory_fraction(cap.previous, cap.index)


def _current_fraction(index: int) -> float:
    """The caching allocator's share of device `index` now (1.0 where torch cannot tell)."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    try:
        return float(get(index)) if get is not None else 1.0
    except (RuntimeError, TypeError):  # an older torch, or an allocator without the figure
        return 1.0


def process_device_bytes(device: torch.device | str) -> tuple[int | None, str | None]:
    """(bytes this process holds on `device`, how it was read: "nvml" or "mem_get_info");
    (None, None) on a CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, None
    index = device.index if device.index is not None else torch.cuda.current_device()
    used = _nvml_process_bytes(index)
    if used is not None:
        return used, "nvml"
    free, total = torch.cuda.mem_get_info(index)
    return int(total - free), "mem_get_info"


def _nvml_process_bytes(index: int) -> int | None:
    """NVML's device memory of this process on CUDA device `index` (matched by UUID, so
    CUDA_VISIBLE_DEVICES does not matter), or None when pynvml is missing or cannot tell."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        pid = os.getpid()
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == pid and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory)
    except Exception:  # NVML absent, no permission, an unknown device: fall back to mem_get_info
        return None
    return None
