"""Where oneDNN's packed copy of a weight (memory/packed_weights.PackedLinear) puts each element,
for the native kernels that read those bytes in place (expert_amx.py in bf16, expert_fp32.py in
fp32): a probe weight zero but for up to 256 marked elements (every output residue mod 128 and
every input residue mod 32 among them, the rest drawn at random), each an integer of its own
(exact in bf16), packed as a run packs it; a kernel's layout is right when every marked value
sits where its formula puts it and nothing else is anywhere."""

from __future__ import annotations

import ctypes
from typing import Callable

import torch

#: (outputs [m], inputs [m]) -> each element's offset in the packed copy [m]
Offsets = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def raw(packed: torch.Tensor) -> int:
    """The address of an opaque oneDNN tensor's bytes."""
    return int(torch.ops.mkldnn.data_ptr(packed))


def matches(out_features: int, in_features: int, rows_hint: int, dtype: torch.dtype,
            candidates: dict[int, Offsets]) -> int | None:
    """The first key of `candidates` whose offsets put every marked element of the probe where
    PackedLinear(probe in `dtype`, rows_hint) has it, or None (another layout)."""
    from moecc_runtime.memory.packed_weights import PackedLinear  # memory imports native

    n_out, k_in = out_features, in_features
    g = torch.Generator().manual_seed(0)
    n = torch.cat([torch.arange(128) % n_out, torch.randint(0, n_out, (128,), generator=g)])  # [256]
    k = torch.cat([torch.arange(128) % k_in, torch.randint(0, k_in, (128,), generator=g)])
    marked = sorted(set(zip(n.tolist(), k.tolist())))  # distinct (output, input) pairs
    n, k = torch.tensor([p[0] for p in marked]), torch.tensor([p[1] for p in marked])  # [m]
    value = torch.arange(1, len(marked) + 1, dtype=torch.float32)  # [m]: integers <= 256, exact in bf16
    probe = torch.zeros(n_out, k_in)
    probe[n, k] = value
    packed = PackedLinear(probe.to(dtype), rows_hint).packed
    nbytes = int(torch.ops.mkldnn._nbytes(packed))
    if nbytes != n_out * k_in * dtype.itemsize:
        return None
    got = torch.frombuffer(bytearray((ctypes.c_char * nbytes).from_address(raw(packed))), dtype=dtype).float()
    if int(torch.count_nonzero(got)) != len(marked):
        return None
    for key, offsets in candidates.items():
        if torch.equal(got[offsets(n, k)], value):
            return key
    return None
