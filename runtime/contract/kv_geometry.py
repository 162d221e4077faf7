"""KV geometry: what one layer caches per token, and the paged pool a plan sizes.

The plan's `batch.kv` is a `KVGeometry` (the schema validates it against this dataclass's
fields); the compiler computes `kv_geometry` from the config, the runtime allocates the
pool (memory/kv.py) from the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def kv_geometry(num_kv_heads: int, head_dim: int, mla: dict[str, Any] | None) -> tuple[int, int, int]:
    """(heads, key_dim, value_dim) a layer caches per token: K and V heads, or with multi-head
    latent attention one "head" holding the compressed latent and the rope key, and no V."""
    if mla:
        return 1, int(mla["kv_lora_rank"]) + int(mla["qk_rope_head_dim"]), 0
    return int(num_kv_heads), int(head_dim), int(head_dim)


@dataclass(frozen=True)
class KVGeometry:
    """The paged KV pool: layers, cached heads and their widths, block size and blocks.
    Legend: Hkv = heads, D = key_dim, Dv = value_dim, bs = block_size, NB = num_blocks."""

    layers: int
    heads: int  # Hkv (1 with latent attention: the latent and the rope key)
    key_dim: int  # D
    value_dim: int  # Dv (0 with latent attention: the values are the latent part of the key)
    block_size: int  # bs, tokens per block
    num_blocks: int  # NB
    bytes_per_block: int = 0  # all layers, K and V (0: not known, e.g. a pool built by hand)

    @classmethod
    def from_record(cls, kv: dict[str, Any]) -> "KVGeometry":
        """The geometry of a plan's `batch.kv` record (validated by the schema)."""
        return cls(int(kv["layers"]), int(kv["heads"]), int(kv["key_dim"]), int(kv["value_dim"]),
                   int(kv["block_size"]), int(kv["num_blocks"]), int(kv["bytes_per_block"]))
