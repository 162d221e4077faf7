"""A residual add and the RMSNorm that opens the next module, in one pass on the host.

On a CPU run each decoder module ends with a residual add whose sum a host buffer keeps
(worker._add_into writes it there in place), and the next module opens by normalising that
buffer's rows: the rows are read again, out of cache by then. Where the plan has that pattern
(`norms_ahead`), NormAhead does both in the add's pass (native/rmsnorm.py's add_rmsnorm: the
bits of torch's add, then of kernels.rmsnorm): the sum goes to the buffer as before and the norm
into a step buffer of NormAhead's; the next module's norm op takes its rows from there
(`take`). Anything it cannot vouch for (rows it did not write, a different buffer, no native
pass) it leaves to the ordinary path. MOECC_NORM_AHEAD=0 turns it off.

Legend: T rows of the step, H the normalised width.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from moecc_runtime.contract.plan_types import Module, Op
from moecc_runtime.native import rmsnorm as native_rmsnorm
from moecc_runtime.plan_schema import TRANSFER_OPS


def norms_ahead(schedule: Sequence[Module], sums_kept: dict[str, str]) -> dict[str, Op]:
    """add op -> the rmsnorm op that opens the next module (its first op past the transfers)
    over the host buffer that keeps the add's sum (`sums_kept`: add -> buffer). Only attention
    and expert modules: the head reads the last rows of its buffer alone."""
    out: dict[str, Op] = {}
    for m, nxt in zip(schedule, schedule[1:]):
        if nxt.kind not in ("attn", "moe"):
            continue
        first = next((op for op in nxt.ops if op.op not in TRANSFER_OPS), None)
        if first is None or first.op != "rmsnorm" or not first.inputs:
            continue
        for op in m.ops:
            if sums_kept.get(op.name) == first.inputs[0]:
                out[op.name] = first
    return out


@dataclass
class _Normed:
    """One norm op's rows made ahead this step: `rows` [T, H] of buffer `buf`, of which the row
    ranges `done` are written, each the norm of the row at the same index of the host buffer
    whose row 0 is at address `src` (rows `src_stride` bytes apart)."""

    buf: int
    rows: torch.Tensor  # [T, H]
    src: int
    src_stride: int
    done: list[tuple[int, int]] = field(default_factory=list)

    def covers(self, r0: int, r1: int) -> bool:
        at = r0
        for a, b in sorted(self.done):
            if a <= at < b:
                at = b
        return at >= r1


class NormAhead:
    """needs: `norms` (norms_ahead's map) and `weight(op)`, a norm op's weight, readable at any
    time (weights in place). does: the add and the next norm in one pass (`add`), the norm's rows
    handed to its op (`take`). guarantees: `take` returns rows only for a buffer region the same
    step's `add` wrote and nothing wrote since (the plan's host buffers never change between a
    module's end and the next module's start), with the ordinary path's bits."""

    def __init__(self, norms: dict[str, Op], weight: Callable[[Op], torch.Tensor]):
        self.norms = {} if os.environ.get("MOECC_NORM_AHEAD", "1") == "0" else norms
        self._weight = weight
        index = {op.name: i for i, op in enumerate(self.norms.values())}
        self._buf_of = {name: i % 2 for name, i in index.items()}  # consecutive norms alternate two buffers
        self._storage: list[torch.Tensor | None] = [None, None]  # bytes, kept across steps
        self._made: dict[str, _Normed] = {}  # norm op -> its rows made this step

    def start_step(self) -> None:
        self._made.clear()

    def add(self, op: Op, x: Sequence[torch.Tensor], dst: torch.Tensor, full: torch.Tensor) -> bool:
        """dst = x[0] + x[1], and the norm of those rows for the norm op after add `op`, in one pass.
        x[0], x[1], dst: [t, H]; dst rows r0.. of host buffer `full` [T, H]. False: nothing done."""
        norm = self.norms.get(op.name)
        if norm is None or full.dim() != 2 or dst.dim() != 2 or full.stride(1) != 1 or dst.stride() != full.stride():
            return False
        rows = self._rows(norm, full)
        r0 = (dst.data_ptr() - full.data_ptr()) // (full.stride(0) * full.element_size())
        out = rows.rows[r0:r0 + dst.shape[0]]  # [t, H]
        if not native_rmsnorm.add_rmsnorm(x[0], x[1], self._weight(norm), float(norm.attrs["eps"]), dst, out):
            return False
        rows.done.append((r0, r0 + dst.shape[0]))
        return True

    def take(self, op: Op, x: torch.Tensor) -> torch.Tensor | None:
        """Rmsnorm op `op` over x [t, H] (rows of a host buffer): its rows as `add` made them, or
        None when `add` did not make all of them this step from the rows x views."""
        made = self._made.get(op.name)
        if made is None or x.dim() != 2 or x.dtype != made.rows.dtype or x.stride(1) != 1:
            return None
        stride = x.stride(0) * x.element_size()
        offset = x.data_ptr() - made.src
        if stride != made.src_stride or offset < 0 or offset % stride:
            return None
        r0 = offset // stride
        r1 = r0 + x.shape[0]
        if r1 > made.rows.shape[0] or x.shape[1] != made.rows.shape[1] or not made.covers(r0, r1):
            return None
        return made.rows[r0:r1]

    def _rows(self, norm: Op, full: torch.Tensor) -> _Normed:
        """The norm's rows this step ([T, H] of its buffer), made on the first add of the step,
        the other norm that shared the buffer forgotten."""
        made = self._made.get(norm.name)
        if made is not None and made.src == full.data_ptr():
            return made
        b = self._buf_of[norm.name]
        for name in [n for n, m in self._made.items() if m.buf == b]:
            del self._made[name]
        need = full.numel() * full.element_size()
        store = self._storage[b]
        if store is None or store.numel() < need:
            store = self._storage[b] = torch.empty(need, dtype=torch.uint8)
        rows = store[:need].view(full.dtype).view(full.shape)
        made = self._made[norm.name] = _Normed(b, rows, full.data_ptr(), full.stride(0) * full.element_size())
        return made
