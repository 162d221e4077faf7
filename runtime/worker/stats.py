"""What the worker measured: totals over the run (`EngineStats`, written to the job's stats
file as `engine`) and, when asked for, one `StepRecord` per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moecc_runtime.memory.arena import DeviceArena
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
    peak_device_bytes: int = 0  # arena bytes used at the peak (+ CUDA temporaries on CUDA)
    arena_usage: dict[str, int] = field(default_factory=dict)  # region -> highest byte used
    records: list[StepRecord] | None = None  # per step, when the worker was asked to keep them
    # with records: the measured timeline of one decode and one prefill step (worker/timeline.py)
    timeline: dict[str, Any] = field(default_factory=dict)

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
        st.peak_device_bytes = max(st.peak_device_bytes, torch.cuda.max_memory_allocated(device))
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
