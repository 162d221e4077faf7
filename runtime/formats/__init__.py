"""Weight formats: how a weight is stored and how the compute-dtype weight an op reads is made
from its stored tensors, each format in one file.

A manifest entry (plan_schema.WeightEntry) without `format` is dense: its one stored tensor
is the weight (cast to the compute dtype when stored in another). Any other format names
its stored tensors ("data" and `parts`, e.g. a scale) and its facts (`format_attrs`);
`materialize` turns the stored tensors, wherever they are (the device arena, or the host
mmap on CPU), into the weight in the compute dtype on that same device, right before the
GEMM. Streaming and the host store move and keep the stored bytes only. Every format but
act-ordered compressed-tensors reduces to one grouped dequantize (_grouped.py: dequant.c in one
pass on the host, torch in row chunks on a GPU) and keeps `reference`, its whole-tensor torch
code, which the tests hold the fast path to bit for bit.

Needs: a plan's weight entry and its stored tensors as torch tensors. Does: dequantize.
Guarantees: the result has the entry's logical shape and the requested dtype.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from moecc_runtime.formats import (awq, ct_naive, ct_packed, fp8_block, gptq, int4_group, int8_channel, mxfp4, nvfp4,
                                   scratch)

#: format name -> materialize(stored tensors by part name, entry, compute dtype, out) -> weight
Materialize = Callable[[dict[str, torch.Tensor], dict[str, Any], torch.dtype, "torch.Tensor | None"], torch.Tensor]
FORMATS: dict[str, Materialize] = {
    fp8_block.NAME: fp8_block.materialize,
    mxfp4.NAME: mxfp4.materialize,
    int8_channel.NAME: int8_channel.materialize,
    int4_group.NAME: int4_group.materialize,
    gptq.NAME: gptq.materialize,
    awq.NAME: awq.materialize,
    ct_packed.NAME: ct_packed.materialize,
    ct_naive.NAME: ct_naive.materialize,
    nvfp4.NAME: nvfp4.materialize,
}


class FormatError(Exception):
    """A weight's stored format is unknown to this runtime or its parts are inconsistent."""


def format_of(entry: dict[str, Any]) -> str:
    return str(entry.get("format", "dense"))


def is_dense(entry: dict[str, Any]) -> bool:
    return format_of(entry) == "dense"


def stored_entries(entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The stored tensors of a weight entry by part name ("data" first)."""
    return {"data": entry, **entry.get("parts", {})}


def materialize(entry: dict[str, Any], stored: dict[str, torch.Tensor], dtype: torch.dtype,
                key: str = "", out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight in `dtype`, of the entry's logical shape, on the stored tensors' device; a
    quantized one written into `out` when given (a dense tensor of the weight's element count in
    `dtype` on that device, e.g. a reused buffer: no allocation) and returned as a view of it."""
    fmt = format_of(entry)
    if fmt == "dense":
        return stored["data"]
    fn = FORMATS.get(fmt)
    if fn is None:
        raise FormatError(f"weight {key or entry.get('tensor')}: stored format {fmt!r} is not one this runtime "
                          f"reads ({', '.join(['dense', *FORMATS])}); recompile the plan with this moecc")
    w = fn(stored, entry, dtype, out)
    want = [int(d) for d in entry.get("logical_shape", entry["shape"])]
    if list(w.shape) != want:  # a format bug, never a user error: say so plainly
        raise FormatError(f"weight {key or entry.get('tensor')}: {fmt} produced shape {list(w.shape)}, "
                          f"the plan says {want}")
    return w
