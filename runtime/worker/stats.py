"""What the worker measured: totals over the run (`EngineStats`, written to the job's stats
file as `engine`) and, when asked for, one `StepRecord` per step.

Device memory, four figures (memory/device_budget.py): `peak_device_bytes` the arena's
highest used bytes, on CUDA at least torch's max_memory_allocated (what earlier stats files
hold); on CUDA also `peak_allocated_bytes` and `peak_reserved_bytes` (the caching
allocator's live tensors and what it holds) and `peak_process_device_bytes`, what the process
holds on the device (NVML, else total - free: the CUDA context and library workspaces
included), sampled at the end of every step, when the allocator still holds the step's
temporaries; `gpu_mem` the plan's budget they are checked against (`within_gpu_mem`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moecc_runtime.memory.arena import DeviceArena
from moecc_runtime.memory.device_budget import process_device_bytes
from moecc_runtime.memory.copy_engine import CopyEngine
from moecc_runtime.memory.kv import KVPool
from moecc_runtime.scheduler.step_plan import StepPlan


@dataclass
class StepRecord:
    """What one step did and how long it took (wall seconds)."""

    seconds: float
    sequences: int
    prefill_tokens: int
    decode_tokens: int
    experts_run: int
    kv_blocks_used: int
    kv_allocated_bytes: int
    kv_live_bytes: int
    copy_seconds: float = 0.0  # copy engine busy time during the step
    wait_seconds: float = 0.0  # compute blocked on copies
    copy_bytes: int = 0


@dataclass
class EngineStats:
    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    experts_run: int = 0
    seconds: float = 0.0
    peak_kv_allocated_bytes: int = 0
    peak_kv_live_bytes: int = 0
    copy_seconds: float = 0.0  # copy engine busy time (weights and KV into the arena)
    wait_seconds: float = 0.0  # compute blocked waiting for copies
    copy_bytes: int = 0
    arena_bytes: int = 0  # the device arena's size (0: no arena, weights read in place)
    packed_weight_bytes: int = 0  # weights laid out for the host GEMM at start-up (memory/packed_weights.py)
    kv_prefault_bytes: int = 0  # KV pool pages committed at start-up for the first wave (Engine.prefault_kv)
    kv_prefault_seconds: float = 0.0
    peak_device_bytes: int = 0  # arena bytes used at the peak (+ CUDA temporaries on CUDA)
    arena_usage: dict[str, int] = field(default_factory=dict)  # region -> highest byte used
    peak_allocated_bytes: int = 0  # CUDA: torch.cuda.max_memory_allocated (live tensors, arena included)
    peak_reserved_bytes: int = 0  # CUDA: torch.cuda.max_memory_reserved (what the caching allocator holds)
    peak_process_device_bytes: int = 0  # CUDA: what the process holds (context included), sampled per step
    process_device_source: str | None = None  # "nvml" or "mem_get_info" (this GPU's other processes too)
    gpu_mem: int | None = None  # the plan's --gpu-mem (memory.device.gpu_mem), for within_gpu_mem
    records: list[StepRecord] | None = None  # per step, when the worker was asked to keep them
    # with records: the measured timeline of one decode and one prefill step (worker/timeline.py)
    timeline: dict[str, Any] = field(default_factory=dict)

    @property
    def within_gpu_mem(self) -> bool | None:
        """Whether the process stayed within the plan's --gpu-mem on the device (CUDA: its true
        peak; a CPU run: the arena's peak); None without a budget or a measurement."""
        if self.gpu_mem is None:
            return None
        peak = self.peak_process_device_bytes or self.peak_device_bytes
        return peak <= self.gpu_mem if peak else None

    @property
    def overlap_efficiency(self) -> float | None:
        """Share of copy time hidden behind compute (None when nothing was copied)."""
        if self.copy_seconds <= 0:
            return None
        return max(0.0, 1.0 - self.wait_seconds / self.copy_seconds)


def copy_counters(copy: CopyEngine | None) -> tuple[float, float, int]:
    """The copy engine's (busy s, waited s, bytes) so far, to take a step's share of them."""
    return (copy.copy_s, copy.wait_s, copy.bytes) if copy is not None else (0.0, 0.0, 0)


def account(st: EngineStats, plan: StepPlan, seconds: float, experts: int, copy0: tuple[float, float, int],
            copy: CopyEngine | None, arena: DeviceArena | None, device: torch.device, pool: KVPool) -> None:
    """Add one step (run in `seconds`, `experts` experts; the copy counters were `copy0`
    before it) to the totals and, when kept, the records."""
    copy_s, wait_s, copy_b = (a - b for a, b in zip(copy_counters(copy), copy0))
    st.steps += 1
    st.seconds += seconds
    if copy is not None:
        st.copy_seconds += copy_s
        st.wait_seconds += wait_s
        st.copy_bytes += copy_b
    if arena is not None:
        st.arena_usage = arena.usage()
        st.peak_device_bytes = arena.peak_bytes
    if device.type == "cuda":
        sample_device(st, device)
    T, pre = plan.tokens, plan.prefill_tokens
    st.tokens += T
    st.prefill_tokens += pre
    st.decode_tokens += T - pre
    allocated, live = plan.kv.blocks_used * pool.bytes_per_block, plan.kv.tokens_live * pool.bytes_per_token
    st.peak_kv_allocated_bytes = max(st.peak_kv_allocated_bytes, allocated)
    st.peak_kv_live_bytes = max(st.peak_kv_live_bytes, live)
    if st.records is not None:
        st.records.append(StepRecord(seconds, len(plan.seqs), pre, T - pre, experts, plan.kv.blocks_used,
                                     allocated, live, copy_s, wait_s, copy_b))


def sample_device(st: EngineStats, device: torch.device) -> None:
    """CUDA: raise the device peaks of `st` to what the allocator and the process hold now."""
    st.peak_allocated_bytes = max(st.peak_allocated_bytes, int(torch.cuda.max_memory_allocated(device)))
    st.peak_reserved_bytes = max(st.peak_reserved_bytes, int(torch.cuda.max_memory_reserved(device)))
    st.peak_device_bytes = max(st.peak_device_bytes, st.peak_allocated_bytes)
    used, source = process_device_bytes(device)
    if used is not None:
        st.peak_process_device_bytes = max(st.peak_process_device_bytes, used)
        st.process_device_source = source
