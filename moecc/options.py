"""The compile options every pass may read (`PassContext.options`), typed and documented."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

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
    device_reserve device bytes kept out of gpu_mem for what the process holds outside the plan
                   (CUDA context, cuBLAS workspaces); None: the hardware profile's
                   device_reserve_bytes (moecc/planner/hardware.py; 0 on a CPU)
    prompt_tokens  the typical prompt length the batch is sized for (a mean)
    output_tokens  the typical output length (a mean; clipped to the model's context)
    shared_prefix  the share of prompt tokens the runtime's prefix sharing computes once, in
                   [0, 1) (`moecc compile --prompts` measures it: moecc/planner/shared_prefix.py);
                   the planner prefills (1 - shared_prefix) of each prompt
    max_batch      upper bound on sequences in flight (B)
    hardware       a preset name, a `moecc profile` JSON path, or None: this machine's preset
    solve_seconds  CP-SAT's time limit per candidate (B, tokens per prefill step)
    attention      where attention runs: "auto" (the planner places it per phase: host,
                   device or a split, by predicted throughput), "host" or "device" (both phases)
    checkpoint     the frontend's Checkpoint (emit_plan locates every weight in it); set by
                   the compiler after `build_graph`, None before
    quantize       None, "int8" or "int4": weight-only quantization at compile (moecc/quantize/;
                   the pass quantize_weights)
    quantize_group_size  int4: input channels per scale (default 128; the last group of a
                   row may be partial)
    quantize_scope "experts" (routed experts only) or "all" (also attention and dense /
                   shared-expert MLP matrices)
    quantize_symmetric  int4: symmetric, no zero points (default False: asymmetric measured
                   better on the demo model)
    plan_path      where the plan will be saved (-o): with `quantize`, the quantized weights
                   are written beside it as plan_path + ".weights.safetensors", the name
                   the runtime looks for; the plan must then be saved at exactly this path
    log            progress lines of long steps (quantizing), e.g. to stderr; None: silent
    dtype          the compute dtype: "auto" (transformers' dtype="auto"), "fastest", "bfloat16",
                   "float16" or "float32" (weights of another dtype cast when read;
                   moecc/frontend/dtype_choice.py); the plan's model.info.dtype
    """

    gpu_mem: int | None = None
    host_mem: int | None = None
    host_reserve: int | None = None
    device_reserve: int | None = None
    prompt_tokens: float = 512
    output_tokens: float = 256
    shared_prefix: float = 0.0
    max_batch: int = 1024
    hardware: str | None = None
    solve_seconds: float = 10.0
    attention: str = "auto"
    checkpoint: "Checkpoint | None" = None
    quantize: str | None = None
    quantize_group_size: int = 128
    quantize_scope: str = "experts"
    quantize_symmetric: bool = False
    plan_path: str | None = None
    log: Callable[[str], None] | None = None
    dtype: str = "auto"
