"""What the two fresh-prompt attention kernels (prompt_amx.c in bf16, prompt_fp32.c in fp32) share:
their arguments' checks and their call. Both take every fresh prompt of a step in one call, with
the same signature and return codes (0 done, 1 not taken, 2 not here, 3 out of memory)."""

from __future__ import annotations

from typing import Any

import torch


def attend(mod: Any, dtype: torch.dtype, what: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           spans: list[tuple[int, int]], scale: float, out: torch.Tensor) -> bool:
    """out[lo:hi] = causal attention of each fresh prompt's rows [lo, hi) over its own K/V through
    `mod` (a kernel's extension, None: not here). q: [t, Hq, D]  k: [t, Hkv, D]  v: [t, Hkv, Dv]
    out: [t, Hq, Dv], all `dtype` on the CPU, heads and dims contiguous in a row, D and Dv multiples
    of 16, Hq a multiple of Hkv. False: not done, nothing written. MemoryError (naming `what`) when
    no thread got its scratch."""
    if mod is None or not spans:
        return False
    if any(t.dtype != dtype or t.device.type != "cpu" or t.dim() != 3 for t in (q, k, v, out)):
        return False
    Hq, D, Hkv, Dv = q.shape[1], q.shape[2], k.shape[1], v.shape[2]
    if (D % 16 or Dv % 16 or Hq % Hkv or k.shape[2] != D or v.shape[1] != Hkv or out.shape[1:] != (Hq, Dv)
            or any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (q, k, v, out))):
        return False
    if (any(hi <= lo or lo < 0 or hi > q.shape[0] for lo, hi in spans)
            or min(k.shape[0], v.shape[0], out.shape[0]) < q.shape[0]):
        return False
    sp = torch.tensor(spans, dtype=torch.int64)  # [ns, 2]
    rc = mod.attend(q.data_ptr(), q.shape[0], q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), sp.data_ptr(),
                    len(spans), Hq, Hkv, D, Dv, float(scale), out.data_ptr(), out.stride(0),
                    torch.get_num_threads())
    if rc == 3:
        raise MemoryError(f"{what}: no thread got memory for its scratch (the longest prompt's keys, its scores)")
    return rc == 0
