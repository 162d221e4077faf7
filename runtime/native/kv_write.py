"""A step's new K/V rows scattered into the paged KV pool on the host in one pass (kv_write.c,
`moecc_runtime.native._kv_write`): memory/kv.py's `pool[:, blocks, offsets] = src`, the same
bytes. `write` returns False, having done nothing, where it does not apply (not built,
MOECC_NO_NATIVE, a GPU tensor, src and pool of different dtypes, a head row that is not
contiguous, index tensors that are not int64 on the host); the caller then runs torch's
assignment, which also raises for an index outside the pool (the kernel declines those).
"""

from __future__ import annotations

from typing import Any

import torch

from moecc_runtime.native import extension


def _module() -> Any:
    """The extension (native.extension); None: not built."""
    return extension("_kv_write", "moecc_kv_write")


def write(pool: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, src: torch.Tensor) -> bool:
    """pool[h, blocks[i], offsets[i]] = src[i, h] for every position i and head h.
    pool: [Hkv, NB, bs, D] (one layer's K or V)  blocks/offsets: [n] int64  src: [n, Hkv, D]."""
    mod = _module()
    if (mod is None or pool.device.type != "cpu" or src.device.type != "cpu" or src.dtype != pool.dtype
            or pool.dim() != 4 or src.dim() != 3 or pool.stride(3) != 1 or src.stride(2) != 1
            or blocks.dtype != torch.int64 or offsets.dtype != torch.int64 or blocks.device.type != "cpu"
            or offsets.device.type != "cpu"):
        return False
    Hkv, NB, bs, D = pool.shape
    n = src.shape[0]
    if src.shape[1:] != (Hkv, D) or blocks.shape != (n,) or offsets.shape != (n,):
        raise ValueError(f"kv_write: pool {tuple(pool.shape)}, src {tuple(src.shape)}, blocks {tuple(blocks.shape)}, "
                         f"offsets {tuple(offsets.shape)}")
    blocks, offsets = blocks.contiguous(), offsets.contiguous()
    e = pool.element_size()
    rc = mod.kv_write(pool.data_ptr(), pool.stride(0) * e, pool.stride(1) * e, pool.stride(2) * e, NB, bs,
                      blocks.data_ptr(), offsets.data_ptr(), src.data_ptr(), src.stride(0) * e, src.stride(1) * e, n,
                      Hkv, D * e, torch.get_num_threads())
    return rc == 0
