"""The host memory model: what a running plan holds in host memory, and the explicit reserve
kept for what the plan does not size.

A plan's host bytes are
  weights   the checkpoint's tensors, memory-mapped (every step reads them: they must stay
            in RAM, or the job runs at disk speed), plus the host copies of those stored in
            another dtype than the compute dtype (cast once when first read)
  kv_cache  the paged KV pool (runtime/memory/kv.py); the planner needs B sequences of the
            workload's length, and gives the pool every byte the budget leaves
  buffers   the host buffers between modules, one row per token of the largest step
            (max(B, prefill tokens per step) rows)
  reserve   what the plan does not size, each part named (HostReserve): the runtime
            process itself, the page tables of the weight mappings, the job's request table.

With `--host-mem` the four must fit it; the KV pool takes what the others leave. Without,
nothing is refused, and the pool is sized by what this machine has available now
(`available_host_bytes`, MemAvailable), so a plan's typical-request shape never makes a
longer request fail for want of blocks the machine has.

Needs: the graph's ModelCost. Does: arithmetic only. Guarantees: the minimum that
`minimum_host_bytes` names is one `fits` accepts (the error's suggestion compiles).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moecc.planner.costs import ModelCost
from moecc_runtime.contract.blocks import KV_BLOCK_SIZE, seq_blocks

#: The runtime process: Python, torch and its allocator, the tokenizer, on CUDA the driver's
#: host-side context and pinned staging. Measured 0.24 GiB peak RSS for `moecc exec` of the
#: demo model on CPU; CUDA's context adds several hundred MiB, hence 1 GiB.
RUNTIME_BYTES = 1 << 30
#: The job's request table: every request line is read (and its prompt's token ids held as
#: Python ints, ~36 B a token) before the first step: 1 GiB holds ~30M prompt tokens
#: (~58,000 prompts of 512 tokens). Larger jobs: raise it with --host-reserve.
REQUEST_TABLE_BYTES = 1 << 30
#: Page tables of the weights' mappings: 8 bytes per 4 KiB page.
PAGE_TABLE_SHARE = 8 / 4096


@dataclass(frozen=True)
class HostReserve:
    """Host bytes kept out of the plan's budget, by cause (or one figure the user gave)."""

    runtime: int
    page_tables: int
    requests: int
    given: int | None = None  # --host-reserve: replaces the three

    @property
    def total(self) -> int:
        return self.given if self.given is not None else self.runtime + self.page_tables + self.requests

    def parts(self) -> dict[str, int]:
        if self.given is not None:
            return {"given (--host-reserve)": self.given}
        return {"runtime process": self.runtime, "weight page tables": self.page_tables,
                "request table": self.requests}


def host_reserve(cost: ModelCost, given: int | None = None) -> HostReserve:
    """The reserve for a model of `cost` (`given`: the user's figure instead)."""
    return HostReserve(RUNTIME_BYTES, int(cost.weight_bytes * PAGE_TABLE_SHARE), REQUEST_TABLE_BYTES, given)


def available_host_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """This machine's available host memory now (MemAvailable: free plus reclaimable page
    cache, read as the runtime reads it: moecc_runtime.memory.pinned.available_bytes), or
    None where it cannot be read."""
    from moecc_runtime.memory.pinned import available_bytes

    got = available_bytes(meminfo)
    if got is not None:
        return got
    import os

    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def host_bytes(cost: ModelCost, seq_len: int, B: int, tps: int) -> dict[str, int]:
    """The plan's sized host bytes at batch B and `tps` prompt tokens per prefill step."""
    return {"weights": cost.weight_bytes + cost.cast_bytes,
            "kv_cache": B * seq_blocks(seq_len) * KV_BLOCK_SIZE * cost.kv_bytes_per_token,
            "buffers": max(B, tps) * cost.buffer_bytes_per_token}


def fits(budget: int | None, reserve: HostReserve, sized: dict[str, int]) -> bool:
    """Whether the sized bytes and the reserve fit `budget` (None: no budget, always)."""
    return budget is None or sum(sized.values()) + reserve.total <= budget


def minimum_host_bytes(cost: ModelCost, seq_len: int, tps: int, reserve: HostReserve) -> int:
    """The smallest --host-mem any plan fits: B = 1 at the smallest prefill step offered."""
    return sum(host_bytes(cost, seq_len, 1, tps).values()) + reserve.total


def kv_pool_blocks(cost: ModelCost, seq_len: int, B: int, tps: int, budget: int | None,
                   reserve: HostReserve, available: int | None) -> tuple[int, str]:
    """Blocks in the KV pool, and why: every byte the budget (or, without one, this machine's
    available memory) leaves after weights, buffers and reserve; at least B sequences of the
    workload's length; at most B sequences of the model's full context (more can never be
    in flight). Pool pages are committed only when written, so an idle block costs address
    space only."""
    block = max(1, KV_BLOCK_SIZE * cost.kv_bytes_per_token)
    floor = B * seq_blocks(seq_len)
    cap = max(floor, B * seq_blocks(max(cost.max_context, seq_len)))
    if budget is not None:
        room, why = budget, "what --host-mem leaves after weights, buffers and reserve"
    elif available is not None:
        room, why = available, "this machine's available memory at compile (MemAvailable), after weights, " \
                               "buffers and reserve"
    else:
        return cap, "B sequences of the full context (host memory unknown)"
    sized = host_bytes(cost, seq_len, B, tps)
    free = room - reserve.total - sized["weights"] - sized["buffers"]
    blocks = max(floor, min(cap, free // block))
    if blocks == cap:
        why = "B sequences of the model's full context (no more can be in flight)"
    elif blocks == floor:
        why = "B sequences of the workload's length (all the memory left)"
    return int(blocks), why
