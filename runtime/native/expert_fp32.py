"""A layer's routed experts in fp32 in one native call on a CPU with AVX-512 (expert_fp32.c,
`moecc_runtime.native._expert_fp32`): each expert's gate and up with silu * up, then down and the
weighted add into the layer's output, over the weights oneDNN packed for its own fp32 GEMM (no
second copy), the rows read from x in place.

At a decode step's 24-128 rows an expert, oneDNN's fp32 GEMMs reach ~300 GFLOP/s here and the
element-wise passes between them add ~12%; the kernel keeps each unit's sums in registers over
all its inputs and runs silu * up and the weighted add on them before they leave
(bench/results/README.md, twelfth pass, has the figures).

`layer` returns False, having done nothing, where it does not apply: not built, no AVX-512 here
(or MOECC_NO_NATIVE / MOECC_EXPERT_FP32=0), not fp32, weights not both `PackedLinear` in the
layout the probe recognises, hidden or intermediate size not a multiple of 64. The caller then
runs its own path. Results: fp32 sums in input order by fused multiply-adds, as oneDNN's kernel
sums where it does not split the inputs; silu's exp is the kernel's own (~1 ulp, torch's is
Sleef's), so an output may differ from the unfused path's in the last places.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from moecc_runtime.native import ready_extension
from moecc_runtime.native.packed_layout import matches, raw

MAX_ROWS = 512  #: rows of an expert per part (expert_fp32.c's MAX_ROWS): h's scratch holds one part
_NB = 64  #: outputs of a block of oneDNN's fp32 layout the kernel reads ([N/64][K][64])


def _module() -> Any:
    """The extension, or None: not built, turned off, no AVX-512 on this CPU, or a torch that
    does not let its oneDNN tensors' bytes be read."""
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "data_ptr") and hasattr(ops, "_nbytes")):
        return None
    return ready_extension("_expert_fp32", "moecc_expert_fp32_ready", "MOECC_EXPERT_FP32")


@lru_cache(maxsize=None)
def blocked(out_features: int, in_features: int, rows_hint: int) -> bool:
    """Whether oneDNN packs an fp32 [out, in] weight (`rows_hint` as PackedLinear passes it) as
    blocks of 64 outputs, each [in][64], found on a probe weight (packed_layout.matches)."""
    if out_features % _NB:
        return False
    at = {_NB: lambda n, k: (n // _NB) * in_features * _NB + k * _NB + n % _NB}
    return matches(out_features, in_features, rows_hint, torch.float32, at) == _NB


def takes(w: tuple[Any, ...]) -> bool:
    """Whether an expert's weights (gate_up, None, down) are what `layer` reads."""
    if len(w) != 3 or w[1] is not None:
        return False
    gate_up, down = w[0], w[2]
    if (getattr(gate_up, "rows_hint", None) is None or getattr(down, "rows_hint", None) is None
            or gate_up.dtype != torch.float32 or down.dtype != torch.float32 or gate_up.split is None
            or gate_up.out_features != 2 * gate_up.split or down.in_features != gate_up.split
            or down.out_features != gate_up.in_features or gate_up.split % _NB):
        return False
    return (blocked(gate_up.out_features, gate_up.in_features, gate_up.rows_hint)
            and blocked(down.out_features, down.in_features, down.rows_hint))


def layer(x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, counts: list[int],
          weights: dict[int, tuple[Any, ...]], out: torch.Tensor) -> bool:
    """out[t] += top_w[t, s] * expert top_i[t, s]'s MLP of x[t] for every slot, the experts in
    order (as kernels.experts adds them), in one native call. x/out: [T, H] fp32
    top_w/top_i: [T, k]  counts: [E] slots per expert  weights: each named expert's (gate_up,
    None, down). False: not done, nothing written."""
    mod = _module()
    T, k = top_i.shape
    E = len(counts)
    if (mod is None or T == 0 or x.dtype != torch.float32 or out.dtype != x.dtype or x.device.type != "cpu"
            or x.dim() != 2 or out.dim() != 2 or x.stride(1) != 1 or out.stride(1) != 1 or out.shape != x.shape
            or x.shape[1] % _NB):
        return False
    gu, dn, shapes = [0] * E, [0] * E, set()
    for e, w in weights.items():
        if not takes(w):
            return False
        shapes.add((w[0].in_features, w[2].in_features))
        gu[e], dn[e] = raw(w[0].packed), raw(w[2].packed)
    if len(shapes) != 1 or next(iter(shapes))[0] != x.shape[1]:  # one shape for every expert
        return False
    (H, inter), = shapes
    h = x.new_empty((min(max(counts), MAX_ROWS), inter))  # [rows, I]: the kernel's scratch
    tok, tw = torch.empty(T * k, dtype=torch.int64), torch.empty(T * k, dtype=torch.float32)  # [T*k] sorted slots
    ids, wts = top_i.to(torch.int64).contiguous(), top_w.to(torch.float32).contiguous()  # [T, k]
    at = torch.tensor(gu + dn, dtype=torch.int64)  # [2E]: gate_up's addresses, then down's
    rc = mod.layer(x.data_ptr(), x.stride(0), T, k, ids.data_ptr(), wts.data_ptr(), E, at.data_ptr(),
                   at.data_ptr() + 8 * E, H, inter, tok.data_ptr(), tw.data_ptr(), h.data_ptr(), out.data_ptr(),
                   out.stride(0), torch.get_num_threads())
    return rc == 0
