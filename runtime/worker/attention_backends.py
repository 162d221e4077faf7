"""Attention backends behind one interface: the protocol every backend implements, the
registry of backends by name (`Where`), and `place`, the one function that turns a phase's
attention placement (its host fraction) into the step's micro-batches, each naming its
backend. Host, device and split placement are three uses of `place` (host fraction 1.0, 0.0,
anything between). The names "host" and "device" are written here only.

The backends today:
  * "device": worker/attention.py's GatheredAttention, attention on the compute device over
    the micro-batch's KV gathered there by memory/streaming.py's KVStaging (`gathers`);
  * "host": worker/host_attention.py's HostAttention, attention on the host over the paged
    KV pool in place, through the native kernel (runtime/native, `native.paged_attention`) or,
    without it, its torch fallback (the gathered path on the host).
Multi-head and latent attention (MLA) are not separate backends: each backend projects with
attention.py's `project_qkv`, which picks the variant from the op's attrs.

Recipe: add an attention backend
  1. Write it in its own file under runtime/worker/ (e.g. worker/flash_attention.py): a class
     with `gathers` (True: the worker stages the micro-batch's KV blocks onto the compute
     device first and passes them to `forward` as `kv`), `prepare(mb, window)` (build what
     the micro-batch needs, its views and index tensors, cached in `mb.views` so every layer
     of the step shares them; return the pool blocks to gather, or None) and
     `forward(op, x, rope, mb, w, kv)` (x [t, H] -> [t, H], the new K/V stored in the pool).
     It is checked against `AttentionBackend` structurally: no base class to import.
  2. Register it here: a member of `Where` and its factory in `_FACTORIES`.
  3. If a placement should choose it: extend `place` (and the plan's placement,
     runtime/plan_schema.py's AttentionPlacement, with the planner that writes it).
  4. Test it: tests/runtime/worker/test_attention_backends.py (dispatch) and a numeric test against
     transformers' greedy tokens like tests/runtime/worker/test_host_attention.py's.
The worker (worker/worker.py) needs no change: it calls only `prepare` and `forward` of the
backend a micro-batch names, and stages KV for the ones that gather.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Protocol

import torch

from moecc_runtime.contract.plan_types import Op
from moecc_runtime.memory.kv import KVPool
from moecc_runtime.worker.attention import GatheredAttention
from moecc_runtime.worker.batch import MicroBatch, StepBatch
from moecc_runtime.worker.host_attention import HostAttention


class Where(str, Enum):
    """The registered attention backends, by the name a placement or `--attention` gives."""

    HOST = "host"
    DEVICE = "device"


class AttentionBackend(Protocol):
    """Attention of one micro-batch over the paged KV pool (see the recipe above)."""

    #: True: `forward` reads the micro-batch's KV gathered onto the compute device (`kv`)
    gathers: bool

    def prepare(self, mb: MicroBatch, window: int | None) -> torch.Tensor | None:
        """Build `mb`'s views for sliding window `window` (None: full), once per step; the
        [nb] pool blocks to gather for it (a backend that `gathers`), else None."""
        ...

    def forward(self, op: Op, x: torch.Tensor, rope: torch.Tensor, mb: MicroBatch, w: dict[str, torch.Tensor],
                kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [t, H] -> [t, H] for attention op `op` (weights `w`); `kv` the gathered blocks
        (a backend that `gathers`). The micro-batch's new K/V are stored into the pool."""
        ...


#: how each backend is made from the KV pool and the compute device
_FACTORIES: dict[Where, Callable[[KVPool, torch.device], AttentionBackend]] = {
    Where.DEVICE: lambda pool, device: GatheredAttention(pool, device),
    Where.HOST: lambda pool, device: HostAttention(pool, pin=device.type == "cuda"),
}


def backend_name(name: str) -> Where:
    """The registered backend called `name`; ValueError naming it and the registered ones."""
    try:
        return Where(name)
    except ValueError:
        known = ", ".join(w.value for w in Where)
        raise ValueError(f"attention backend {name!r} is not registered; the registered ones: {known} "
                         f"(runtime/worker/attention_backends.py)") from None


def make_backends(pool: KVPool, device: torch.device) -> dict[Where, AttentionBackend]:
    """One instance of every registered backend over `pool`, computing on `device`."""
    return {where: make(pool, device) for where, make in _FACTORIES.items()}


def host_fractions(plan: dict[str, Any], device: torch.device, force: str | None = None) -> dict[str, float]:
    """Per phase, the share of a step's sequences whose attention runs on the host: the plan's
    placement (plan_schema.AttentionPlacement), `force` (a backend name) when given; for a
    plan without one, all of them on a CPU-only machine (the pool is already where the
    compute is) and none on a GPU."""
    forced = None if force is None else backend_name(force)
    out = {}
    for phase in ("decode", "prefill"):
        placed = plan["batch"][phase].get("attention")
        if forced is not None:
            out[phase] = 1.0 if forced is Where.HOST else 0.0
        elif placed is not None:
            out[phase] = float(placed["host_fraction"])
        else:
            out[phase] = 1.0 if device.type == "cpu" else 0.0
    return out


def place(batch: StepBatch, host_fraction: float, b_a: int, cap_blocks: int | None) -> list[MicroBatch]:
    """The step's attention micro-batches, each naming its backend: the first
    round(host_fraction * S) sequences attend on the host (groups of at most b_a sequences;
    no KV buffer limit: the pool is read in place), the others on the device (groups whose
    KV, full context, fits one device KV buffer of `cap_blocks` blocks; None: no limit).
    Device micro-batches come first (on a GPU they are launched before the host computes
    its own); ValueError when one sequence alone overflows `cap_blocks`."""
    S = len(batch.seqs)
    host_seqs = max(0, min(round(host_fraction * S), S))
    return batch.micro_batches(b_a, [(Where.DEVICE, host_seqs, S, cap_blocks), (Where.HOST, 0, host_seqs, None)])
