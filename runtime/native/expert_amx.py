"""A routed expert's whole gated MLP in one native call on a CPU with AMX (expert_amx.c,
`moecc_runtime.native._expert_amx`): the gather of its rows, gate and up with silu * up, down,
and the weighted add into the layer's output, over the weights oneDNN packed for its own GEMM
(no second copy). At a decode step's 16-512 rows an expert's GEMMs are short and its weights
stream from memory; oneDNN's GEMM plus the element-wise passes between them (expert_rows.py)
spend ~30% of the expert's time outside the GEMMs, which this call does not.

`layer` runs a whole layer's routed experts in one call (the slots sorted by expert in C): the
bits of `expert` called expert by expert, without Python between the experts (7-12% of a
768-hidden layer of 8 experts at 24-512 rows an expert); an expert of more rows than MAX_ROWS (a
prefill step) has its rows split between the threads, each running whole runs of them alone; a
decode step's experts (none past MAX_ROWS, DEAL_EXPERTS a thread or more) are dealt whole to the
threads, each expert's rows kept apart and added into the output in expert order after them.

`expert` returns False, having done nothing, where it does not apply: not built, no AMX here
(or MOECC_NO_NATIVE / MOECC_EXPERT_AMX=0), not bf16, a silu-gated expert whose weights are not
both `PackedLinear` in a layout the probe recognised, sizes not in multiples of 32. The caller
then runs its own path. Results: torch's roundings for the same ops (expert_amx.c); the GEMMs'
fp32 sums in input order, which oneDNN's GEMM also uses except where it splits the inputs between
threads (then the bits of a sum may differ in the last place).
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.native import amx_gemm
from moecc_runtime.native.amx_gemm import layout, scratch_rows
from moecc_runtime.native.expert_rows import _silu_table
from moecc_runtime.native.packed_layout import raw as _raw

MAX_ROWS = amx_gemm.MAX_ROWS  #: rows per native call (expert_amx.c's MAX_ROWS); more run as several calls
#: experts a thread (at least) for a layer's experts to be dealt whole to the threads (expert_amx.c's deal_layer)
DEAL_EXPERTS = 2


def _module() -> Any:
    """The extension, or None where it does not run (amx_gemm.extension)."""
    return amx_gemm.extension("_expert_amx", "moecc_expert_amx", "MOECC_EXPERT_AMX")


def expert(x: torch.Tensor, tok: torch.Tensor, tw: torch.Tensor, gate_up: Any, down: Any,
           out: torch.Tensor) -> bool:
    """out[tok[i]] += tw[i] * down(silu(gate(x[tok[i]])) * up(x[tok[i]])) for every i: one native
    call per MAX_ROWS rows (prefill's thousands of rows too: at 1,024 rows an expert 1.27x
    oneDNN's GEMMs and passes, at 3,072 even). x/out: [T, H] bf16  tok: [n] int64, distinct
    tw: [n] fp32  gate_up: a stacked PackedLinear [2I, H] (`split` I)  down: a PackedLinear [H, I].
    False: not done, nothing written (module docstring)."""
    mod = _module()
    n = tok.shape[0]
    if (mod is None or n == 0 or x.dtype != torch.bfloat16 or out.dtype != x.dtype or tok.dtype != torch.int64
            or x.device.type != "cpu" or x.dim() != 2 or out.dim() != 2 or x.stride(1) != 1 or out.stride(1) != 1):
        return False
    nb = _weights(gate_up, down)
    if nb is None or x.shape[1] != gate_up.in_features or out.shape[1] != x.shape[1]:
        return False
    H, inter = x.shape[1], down.in_features
    rows = scratch_rows(n, 1)  # one run at a time
    a, h = x.new_empty((rows, H)), x.new_empty((rows, inter))  # [Mp, H], [Mp, I]: the kernel's scratch
    tok, tw = tok.contiguous(), tw.to(torch.float32).contiguous()
    gu_at, down_at, lut = _raw(gate_up.packed), _raw(down.packed), _silu_table().data_ptr()
    for s in range(0, n, MAX_ROWS):
        m = min(MAX_ROWS, n - s)
        rc = mod.expert(x.data_ptr(), x.stride(0), tok.data_ptr() + 8 * s, tw.data_ptr() + 4 * s, m, H, inter,
                        gu_at, nb[0], down_at, nb[1], lut, a.data_ptr(), h.data_ptr(), out.data_ptr(), out.stride(0),
                        torch.get_num_threads())
        if rc != 0:  # the same checks pass or fail for every part: only the first can decline
            assert s == 0, f"expert_amx: part {s // MAX_ROWS} declined ({rc}) after the first ran"
            return False
    return True


def takes(w: tuple[Any, ...]) -> bool:
    """Whether an expert's weights (gate_up, None, down) are what `expert` and `layer` read."""
    return _expert_layouts(w) is not None


def _expert_layouts(w: tuple[Any, ...]) -> tuple[int, int] | None:
    """The layouts (NB) of an expert's (gate_up, None, down), or None where the kernel does not read them."""
    return _weights(w[0], w[2]) if len(w) == 3 and w[1] is None else None


def layer(x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, counts: list[int],
          weights: dict[int, tuple[Any, ...]], out: torch.Tensor) -> bool:
    """Every routed expert of a layer in one native call: the slots sorted by expert (as
    kernels.experts sorts them), then each expert in order as `expert` runs it, the same bits,
    without a call (and a slice of the sorted slots) per expert from Python. x/out: [T, H] bf16
    top_w/top_i: [T, k]  counts: [E] slots per expert  weights: each named expert's (gate_up,
    None, down), as `expert` takes them. False: not done, nothing written."""
    mod = _module()
    T, k = top_i.shape
    E = len(counts)
    if (mod is None or T == 0 or x.dtype != torch.bfloat16 or out.dtype != x.dtype or x.device.type != "cpu"
            or x.dim() != 2 or out.dim() != 2 or x.stride(1) != 1 or out.stride(1) != 1 or out.shape != x.shape):
        return False
    gu, dn, kinds = [0] * E, [0] * E, set()
    for e, w in weights.items():
        got = _expert_layouts(w)
        if got is None:
            return False
        kinds.add((got, w[0].in_features, w[2].in_features))
        gu[e], dn[e] = _raw(w[0].packed), _raw(w[2].packed)
    if len(kinds) != 1 or next(iter(kinds))[1] != x.shape[1]:  # one layout and one shape for every expert
        return False
    ((nb_gu, nb_dn), H, inter), = kinds
    threads, most = torch.get_num_threads(), max(counts)
    deal = threads > 1 and most <= MAX_ROWS and sum(c > 0 for c in counts) >= DEAL_EXPERTS * threads
    rows = scratch_rows(most, 1) * threads if deal else scratch_rows(most, threads)
    a, h = x.new_empty((rows, H)), x.new_empty((rows, inter))  # [rows, H], [rows, I]: the kernel's scratch
    tok, tw = torch.empty(T * k, dtype=torch.int64), torch.empty(T * k, dtype=torch.float32)  # [T*k] sorted slots
    y = x.new_empty((T * k, H)) if deal else None  # [T*k, H]: the dealt experts' weighted rows
    pos = torch.empty(T * k, dtype=torch.int64) if deal else None  # [T*k]: each slot's place among the sorted
    ids, wts = top_i.to(torch.int64).contiguous(), top_w.to(torch.float32).contiguous()  # [T, k]
    at = torch.tensor(gu + dn, dtype=torch.int64)  # [2E]: gate_up's addresses, then down's
    rc = mod.layer(x.data_ptr(), x.stride(0), T, k, ids.data_ptr(), wts.data_ptr(), E, at.data_ptr(),
                   at.data_ptr() + 8 * E, H, inter, nb_gu, nb_dn, _silu_table().data_ptr(), tok.data_ptr(),
                   tw.data_ptr(), a.data_ptr(), h.data_ptr(), out.data_ptr(), out.stride(0),
                   0 if y is None else y.data_ptr(), 0 if pos is None else pos.data_ptr(), threads)
    return rc == 0


def _weights(gate_up: Any, down: Any) -> tuple[int, int] | None:
    """The layouts (NB) of a stacked gate/up and a down PackedLinear the kernel reads, or None."""
    hint = getattr(gate_up, "rows_hint", None)
    if (hint is None or getattr(down, "rows_hint", None) is None or gate_up.dtype != torch.bfloat16
            or down.dtype != torch.bfloat16 or gate_up.split is None
            or gate_up.out_features != 2 * gate_up.split or down.in_features != gate_up.split
            or down.out_features != gate_up.in_features):
        return None
    g = layout(gate_up.out_features, gate_up.in_features, gate_up.rows_hint)
    d = layout(down.out_features, down.in_features, down.rows_hint)
    if g is None or d is None or gate_up.split % g:
        return None
    return g, d
