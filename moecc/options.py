"""The compile options every pass may read (`PassContext.options`), typed and documented."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moecc.frontend.checkpoint import Checkpoint


@dataclass(frozen=True)
class CompileOptions:
    """What `moecc compile` was asked for, plus the frontend's checkpoint.

    gpu_mem        device memory budget in bytes; None: no device arena (weights and KV
                   are read where they are; the planner bounds nothing on the device)
    host_mem       host memory budget in bytes; None: unbounded (the KV pool is then sized by
                   this machine's available memory)
    host_reserve   host bytes kept out of host_mem for what the plan does not size; None: the
                   modelled reserve (moecc/planner/host_memory.py)
    prompt_tokens  the typical prompt length the batch is sized for (a mean)
    output_tokens  the typical output length (a mean; clipped to the model's context)
    max_batch      upper bound on sequences in flight (B)
    hardware       a preset name, a `moecc profile` JSON path, or None: this machine's preset
    solve_seconds  CP-SAT's time limit per candidate (B, tokens per prefill step)
    checkpoint     the frontend's Checkpoint (emit_plan locates every weight in it); set by
                   the compiler after `build_graph`, None before
    """

    gpu_mem: int | None = None
    host_mem: int | None = None
    host_reserve: int | None = None
    prompt_tokens: float = 512
    output_tokens: float = 256
    max_batch: int = 1024
    hardware: str | None = None
    solve_seconds: float = 10.0
    checkpoint: "Checkpoint | None" = None
