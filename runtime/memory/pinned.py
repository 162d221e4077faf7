"""Host memory the device copies to and from: page-locked ("pinned") on CUDA runs.

A copy between the device and pageable host memory is staged by the driver through a pinned
bounce buffer and does not overlap anything; from or into pinned memory it is one DMA that
runs on a stream while the host goes on. So on CUDA the KV pool, the copy staging buffers and
the host buffers are pinned; on a CPU run nothing is (there is no device to copy to).

Two ways to pin, by size:
  * small buffers (under `REGISTER_BYTES`) come from torch's caching pinned allocator
    (`torch.empty(..., pin_memory=True)`), which reuses freed blocks once the copies that
    used them have finished; it rounds every block up to a power of two;
  * big long-lived ones (the KV pool, the KV staging) are ordinary host allocations
    page-locked in place with cudaHostRegister, exactly their size (a 100 GiB pool through
    the caching allocator would pin 128 GiB) and unregistered by `release`.

Pinning commits and locks every page at once (an unpinned `torch.empty` commits pages only
when they are first written), so pinning a huge pool can fail or take seconds: when it
fails, the memory stays pageable and a warning says so and what it costs; it never fails
the run.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

import torch

#: From this many bytes on, pin by registering an allocation of exactly the size.
REGISTER_BYTES = 16 << 20
_PAGE = 4096

_registered: dict[int, Any] = {}  # data_ptr of a registered tensor -> its weakref.finalize


class PinningWarning(UserWarning):
    """Pinned host memory was asked for and could not be had (the copies still work, slower)."""


def _cuda_register(ptr: int, nbytes: int) -> None:
    rc = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} B failed with CUDA error {rc}")


def _cuda_unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # at interpreter exit CUDA may be gone already
        pass


#: The two calls that pin and unpin registered memory (tests replace them).
register: Callable[[int, int], None] = _cuda_register
unregister: Callable[[int], None] = _cuda_unregister


def host_empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype, *, pin: bool, what: str) -> torch.Tensor:
    """An uninitialised host tensor of `shape`; with `pin`, page-locked (see the module
    docstring; a failure to pin warns, naming `what`, and returns pageable memory)."""
    shape = tuple(int(d) for d in shape)
    if not pin:
        return torch.empty(shape, dtype=dtype)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < REGISTER_BYTES:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as e:
            _warn(what, nbytes, e)
            return torch.empty(shape, dtype=dtype)
    # page-aligned and padded to whole pages, so no other registration shares a page with it
    span = -(-nbytes // _PAGE) * _PAGE
    raw = torch.empty(span + _PAGE, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % _PAGE
    body = raw[skip:skip + span]
    try:
        register(body.data_ptr(), span)
    except (RuntimeError, AttributeError, AssertionError) as e:
        _warn(what, nbytes, e)
        return body[:nbytes].view(dtype).view(shape)
    out = body[:nbytes].view(dtype).view(shape)
    ptr = out.data_ptr()
    _registered[ptr] = weakref.finalize(out, _finalize, ptr)
    return out


def _finalize(ptr: int) -> None:
    _registered.pop(ptr, None)
    unregister(ptr)


def release(t: torch.Tensor | None) -> None:
    """Unpin `t` now if `host_empty` registered it (its copies must have finished: the caller
    synchronizes first); a no-op for anything else. The memory itself is freed with `t`."""
    if t is None:
        return
    fin = _registered.get(t.data_ptr())
    if fin is not None:
        fin()


def is_registered(t: torch.Tensor) -> bool:
    return t.data_ptr() in _registered


def _warn(what: str, nbytes: int, err: BaseException) -> None:
    warnings.warn(f"{what}: pinning {nbytes / 2**30:.2f} GiB of host memory failed ({err}); using pageable "
                  f"memory instead, so copies between it and the device are synchronous and slower. Lower the "
                  f"plan's host memory (moecc compile --host-mem) or raise the locked-memory limit to get it "
                  f"pinned", PinningWarning, stacklevel=3)
