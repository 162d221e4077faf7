"""Per-sequence KV cache: K and V for every layer, [Hkv, capacity, D] each, allocated at
admission for prompt + max_tokens positions and freed when the sequence finishes.
(Paged host KV shared across sequences is a later issue.)"""

from __future__ import annotations

import torch


class SequenceKV:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, Hkv, cap, D]
        self.v = torch.empty(shape, dtype=dtype, device=device)  # [L, Hkv, cap, D]
        self.capacity = capacity

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k/v: [n, Hkv, D] for positions start..start+n-1
        n = k.shape[0]
        if start + n > self.capacity:
            raise RuntimeError(f"KV cache overflow: {start + n} > capacity {self.capacity}")
        self.k[layer, :, start:start + n] = k.transpose(0, 1)
        self.v[layer, :, start:start + n] = v.transpose(0, 1)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
