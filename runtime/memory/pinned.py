"""Host memory the device copies to and from: page-locked ("pinned") on CUDA runs.

A copy between the device and pageable host memory is staged by the driver through a pinned
bounce buffer and does not overlap anything; from or into pinned memory it is one DMA that
runs on a stream while the host goes on. So on CUDA the copy staging buffers, the KV staging
areas, the host buffers and (memory/pinned_weights.py) the streamed weights are pinned; on a
CPU run nothing is (there is no device to copy to).

Two ways to pin, by size:
  * small buffers (under `REGISTER_BYTES`) come from torch's caching pinned allocator
    (`torch.empty(..., pin_memory=True)`), which reuses freed blocks once the copies that
    used them have finished; it rounds every block up to a power of two;
  * big ones are ordinary host allocations (or a range of a file mapping) page-locked in
    place, exactly their size, in pieces of at most `PIECE_BYTES` (`register_range`), and
    unregistered by `release` / `unregister_pieces`.

Registration goes through the CUDA *driver* API (cuMemHostRegister, libcuda), which returns
its error and leaves none behind: a failed cudaHostRegister of the runtime API would leave
the thread's last error set, and the next unrelated kernel launch (which torch checks with
cudaGetLastError) would fail with it. Where libcuda cannot be loaded the runtime API is used
and its error is cleared at once (`_clear_runtime_error`).

Pinning can never break a run: it is sized from *this* machine's memory at run time (at most
`PIN_SHARE` of MemAvailable now), huge pages are asked for before anything faults the pages,
and a piece the driver refuses stays pageable with one warning naming what did not pin and
what it costs (copies from it are synchronous). MOECC_NO_PIN=1 turns pinning off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import warnings
import weakref
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch

from moecc_runtime.memory import huge_pages
from moecc_runtime.memory.weight_path import PIN_SHARE

#: From this many bytes on, pin by registering an allocation of exactly the size.
REGISTER_BYTES = 16 << 20
#: Registrations are made in pieces of at most this many bytes (one failure loses one piece).
PIECE_BYTES = 1 << 30
#: cuMemHostRegister flags (the same values as cudaHostRegister's).
PORTABLE, READ_ONLY = 0x01, 0x08
_PAGE = 4096

_registered: dict[int, Any] = {}  # data_ptr of a registered tensor -> its weakref.finalize
_pieces_of: dict[int, list[tuple[int, int]]] = {}  # data_ptr of a registered tensor -> its pieces
_pinned_bytes = 0  # bytes registered by this module and not yet unregistered


class PinningWarning(UserWarning):
    """Pinned host memory was asked for and could not be had (the copies still work, slower)."""


class PinError(RuntimeError):
    """The driver refused to page-lock a range (`code`: its CUresult / cudaError)."""

    def __init__(self, msg: str, code: int = -1):
        super().__init__(msg)
        self.code = code


#: Errors meaning "this kind of memory cannot be registered here" rather than "out of memory".
NOT_SUPPORTED_CODES = frozenset({801, 1})  # CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_INVALID_VALUE


def pinning_allowed() -> bool:
    """False when MOECC_NO_PIN=1 (the user forbids page-locking)."""
    return os.environ.get("MOECC_NO_PIN", "") not in ("1", "true", "yes")


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """This machine's available host memory now (MemAvailable), or None where unknown (the
    compiler's moecc/planner/host_memory.available_host_bytes reads it through this)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def pinned_bytes() -> int:
    """Bytes this process has registered through this module and not released."""
    return _pinned_bytes


def lockable_bytes() -> int | None:
    """Bytes a new registration may take now: `PIN_SHARE` of MemAvailable (None: unknown)."""
    avail = available_bytes()
    return None if avail is None else int(PIN_SHARE * avail)


# -- the two calls that pin and unpin (tests replace `register` / `unregister`) -----------------
@lru_cache(maxsize=1)
def _driver() -> Any:
    """libcuda with cuMemHostRegister_v2 / cuMemHostUnregister typed, or None."""
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda") or "", "nvcuda.dll"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cuMemHostRegister_v2.restype = ctypes.c_int
            lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
            lib.cuMemHostUnregister.restype = ctypes.c_int
        except (OSError, AttributeError):  # no driver library, or one too old for these calls
            continue
        return lib
    return None


def _driver_error(lib: Any, rc: int) -> str:
    name = ctypes.c_char_p()
    try:
        lib.cuGetErrorName(rc, ctypes.byref(name))
        return (name.value or b"").decode() or f"CUresult {rc}"
    except Exception:
        return f"CUresult {rc}"


def _clear_runtime_error() -> None:
    """Reset the CUDA runtime's per-thread last error (cudaGetLastError of the libcudart torch
    loaded), so an error a runtime call left does not surface at the next kernel launch."""
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "libcudart" in ln and ln.split()[-1].startswith("/")}
    except OSError:
        paths = set()
    for p in sorted(paths):
        try:
            ctypes.CDLL(p).cudaGetLastError()
        except (OSError, AttributeError):
            continue


def _ensure_context(lib: Any) -> None:
    """Make the device's primary context current on this thread (the driver API needs one; a
    runtime call binds it, as torch's own calls do)."""
    ctx = ctypes.c_void_p()
    try:
        if int(lib.cuCtxGetCurrent(ctypes.byref(ctx))) == 0 and ctx.value:
            return
    except AttributeError:
        pass
    torch.cuda.synchronize()


def _cuda_register(ptr: int, nbytes: int, flags: int = 0) -> None:
    lib = _driver()
    if lib is not None:
        _ensure_context(lib)
        rc = int(lib.cuMemHostRegister_v2(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), ctypes.c_uint(flags)))
        if rc != 0:
            raise PinError(f"cuMemHostRegister of {nbytes} B failed: {_driver_error(lib, rc)}", rc)
        return
    rc = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags))
    if rc != 0:
        _clear_runtime_error()
        raise PinError(f"cudaHostRegister of {nbytes} B failed with CUDA error {rc}", rc)


def _cuda_unregister(ptr: int) -> None:
    try:
        lib = _driver()
        if lib is not None:
            lib.cuMemHostUnregister(ctypes.c_void_p(ptr))
        else:
            if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
                _clear_runtime_error()
    except Exception:  # at interpreter exit CUDA may be gone already
        pass


register: Callable[..., None] = _cuda_register  # (ptr, nbytes, flags)
unregister: Callable[[int], None] = _cuda_unregister


# -- ranges in pieces ----------------------------------------------------------------------------
def register_range(ptr: int, nbytes: int, what: str, *, flags: int = 0, piece: int | None = None,
                   cuts: list[int] | None = None, failures: list[tuple[int, int, str]] | None = None
                   ) -> list[tuple[int, int]]:
    """Page-lock [ptr, ptr+nbytes) (page-aligned start and length) in pieces of at most
    `piece` bytes, cut at the page-aligned offsets `cuts` where given (tensor boundaries).
    Returns the (ptr, nbytes) pieces that pinned. What did not is appended to `failures`
    as (offset, end, why) when given, else named in one warning with what it costs. Never
    raises for a refusal of the driver; a piece over the lockable memory is not tried."""
    piece = int(piece or PIECE_BYTES)
    bounds = _pieces(nbytes, piece, cuts)
    done: list[tuple[int, int]] = []
    failed: list[tuple[int, int, str]] = [] if failures is None else failures
    n_failed = len(failed)
    global _pinned_bytes
    for lo, hi in bounds:
        room = lockable_bytes()
        if not pinning_allowed() or (room is not None and hi - lo > room):
            why = "MOECC_NO_PIN=1" if not pinning_allowed() else \
                f"over {PIN_SHARE:.0%} of this machine's {_gib(available_bytes() or 0)} available now"
            failed.append((lo, hi, why))
            continue
        try:
            register(ptr + lo, hi - lo, flags)
        except (PinError, RuntimeError, AttributeError, AssertionError, OSError) as e:
            failed.append((lo, hi, str(e)))
            continue
        done.append((ptr + lo, hi - lo))
        _pinned_bytes += hi - lo
    if failures is None and len(failed) > n_failed:
        lost = sum(hi - lo for lo, hi, _ in failed)
        first = failed[0]
        warnings.warn(f"{what}: {_gib(lost)} of {_gib(nbytes)} could not be page-locked ({len(failed)} of "
                      f"{len(bounds)} pieces; first at +{first[0]} B: {first[2]}); copies from those bytes go "
                      f"through pageable memory (synchronous, several times slower). Free host memory, lower the "
                      f"plan's host memory (moecc compile --host-mem) or set MOECC_NO_PIN=1 to silence this",
                      PinningWarning, stacklevel=2)
    return done


def _pieces(nbytes: int, piece: int, cuts: list[int] | None) -> list[tuple[int, int]]:
    """[lo, hi) byte ranges covering [0, nbytes), each at most `piece`, closed at the last of
    `cuts` (tensor starts) before they would grow longer. With cuts, the stretch between two
    (one tensor) is never split, so a tensor longer than a piece still lies in one piece (one
    DMA reads it); without, long ranges are cut at page multiples."""
    marks = sorted({c for c in (cuts or []) if 0 < c < nbytes and c % _PAGE == 0} | {nbytes})
    out, lo, last = [], 0, 0
    for m in marks:
        if m - lo > piece and last > lo:  # the stretch so far would overflow: close it at the last cut
            out.append((lo, last))
            lo = last
        while cuts is None and m - lo > piece:  # no tensor boundaries: page-multiple pieces
            out.append((lo, lo + piece))
            lo += piece
        last = m
    if lo < nbytes:
        out.append((lo, nbytes))
    return out


def unregister_pieces(pieces: list[tuple[int, int]]) -> None:
    """Unpin what `register_range` pinned (the copies from it must have finished)."""
    global _pinned_bytes
    for p, n in pieces:
        unregister(p)
        _pinned_bytes -= n
    pieces.clear()


# -- tensors ---------------------------------------------------------------------------------
def host_empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype, *, pin: bool, what: str,
               huge: bool = False, cuts: list[int] | None = None) -> torch.Tensor:
    """An uninitialised host tensor of `shape`; with `pin`, page-locked (see the module
    docstring; a failure to pin warns, naming `what`, and returns pageable memory). `huge`:
    transparent huge pages asked for (before registration, which faults every page). `cuts`:
    byte offsets where the registration's pieces may end (what lies between two stays in one
    piece; see register_range)."""
    shape = tuple(int(d) for d in shape)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not pin or not pinning_allowed():
        if huge and nbytes >= huge_pages.MIN_BYTES:
            return _aligned(nbytes, huge_pages.HUGE_PAGE, huge=True)[:nbytes].view(dtype).view(shape)
        return torch.empty(shape, dtype=dtype)
    if nbytes < REGISTER_BYTES:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as e:
            _warn(what, nbytes, e)
            return torch.empty(shape, dtype=dtype)
    # page-aligned (2 MiB-aligned for huge pages) and padded to whole pages, so no other
    # registration shares a page with it
    span = -(-nbytes // _PAGE) * _PAGE
    body = _aligned(span, huge_pages.HUGE_PAGE if huge else _PAGE, huge=huge)
    pieces = register_range(body.data_ptr(), span, what, cuts=cuts)
    out = body[:nbytes].view(dtype).view(shape)
    if pieces:
        ptr = out.data_ptr()
        _pieces_of[ptr] = list(pieces)
        _registered[ptr] = weakref.finalize(out, _finalize, ptr, pieces)
    return out


def _aligned(span: int, align: int, huge: bool) -> torch.Tensor:
    """[span] uint8 starting at a multiple of `align`, huge pages advised before any touch."""
    raw = torch.empty(span + align, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % align
    body = raw[skip:skip + span]
    if huge:
        huge_pages.advise(body)
    return body


def _finalize(ptr: int, pieces: list[tuple[int, int]]) -> None:
    _registered.pop(ptr, None)
    _pieces_of.pop(ptr, None)
    unregister_pieces(pieces)


def pieces_of(t: torch.Tensor) -> list[tuple[int, int]]:
    """The (ptr, nbytes) pieces `host_empty` registered for `t` (empty: none, or not pinned
    by registration)."""
    return list(_pieces_of.get(t.data_ptr(), []))


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


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _warn(what: str, nbytes: int, err: BaseException) -> None:
    warnings.warn(f"{what}: pinning {_gib(nbytes)} of host memory failed ({err}); using pageable "
                  f"memory instead, so copies between it and the device are synchronous and slower. Lower the "
                  f"plan's host memory (moecc compile --host-mem) or raise the locked-memory limit to get it "
                  f"pinned", PinningWarning, stacklevel=3)
