"""What the AMX GEMM kernels (expert_amx.py, linear_amx.py) share on the Python side, as
amx_gemm.h does in C: when their extension runs (`extension`), the packed layout they read
(`layout`, found by a probe) and the size of their tile scratch (`scratch_rows`) for amx_gemm.h's
split of rows between the threads."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from moecc_runtime.native import ready_extension
from moecc_runtime.native.packed_layout import Offsets, matches

MAX_ROWS = 512  #: rows of a run (a chunk) of either kernel (their C MAX_ROWS): 32 tiles of 16
_NB = (32, 64)  #: output blocks of oneDNN's AB16b{NB}a2b bf16 layouts the kernels read


def extension(module: str, symbol: str, switch: str) -> Any:
    """An AMX GEMM kernel's extension, or None: not built, turned off (`switch`), no AMX on this
    CPU/OS (native.ready_extension), or a torch that does not let its oneDNN tensors' bytes be read
    (both kernels read PackedLinear's packed bytes in place)."""
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "data_ptr") and hasattr(ops, "_nbytes")):
        return None
    return ready_extension(module, symbol, switch)


@lru_cache(maxsize=None)
def layout(out_features: int, in_features: int, rows_hint: int) -> int | None:
    """NB of the AB16b{NB}a2b layout oneDNN packs a bf16 [out, in] weight in (`rows_hint` as
    PackedLinear passes it), found on a probe weight (packed_layout.matches). None: another
    layout (the kernels do not read it)."""
    n_out, k_in = out_features, in_features
    if k_in % 32 or n_out % 16:
        return None

    def at(nb: int) -> Offsets:  # blocks of nb outputs by 16 inputs, inside [8 input pairs][nb outputs][2]
        return lambda n, k: (((n // nb) * (k_in // 16) + k // 16) * 16 * nb + ((k % 16) // 2) * nb * 2
                             + (n % nb) * 2 + k % 2)

    return matches(n_out, k_in, rows_hint, torch.bfloat16, {nb: at(nb) for nb in _NB if n_out % nb == 0})


def scratch_rows(most: int, threads: int) -> int:
    """Rows of a kernel's tile scratch for a run of at most `most` rows: one run's (MAX_ROWS at
    most, rounded up to 16), or MAX_ROWS a thread where the rows are more than a run and split
    between the threads (amx_gemm.h's chunk_rows: each thread its own MAX_ROWS)."""
    if most > MAX_ROWS and threads > 1:
        return MAX_ROWS * threads
    return -(-min(most, MAX_ROWS) // 16) * 16
