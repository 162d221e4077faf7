"""Which build of the host-attention kernel runs (runtime/native/paged_attention.c): the
kernel carries a baseline, an AVX2 + FMA, an AVX-512 and an AVX-512 + AVX512-BF16 build (bf16
queries over bf16 keys scored by vdpbf16ps) and picks the highest the CPU's feature bits allow,
asked once. MOECC_NATIVE_ISA=baseline|avx2|avx512|avx512bf16 (read when the
kernel loads) or `use_isa(name)` force one, for tests and benchmarks; an ISA this CPU (or the
compiler that built the kernel) lacks is refused with an error that says what it has.
"""

from __future__ import annotations

import ctypes
import functools
import os

ISAS = ("baseline", "avx2", "avx512", "avx512bf16")  # the kernel's ISA_BASELINE ... ISA_AVX512BF16 (cpu.h)
ENV = "MOECC_NATIVE_ISA"


def configure(lib: ctypes.CDLL) -> None:
    """Type the kernel's ISA functions and apply MOECC_NATIVE_ISA when set; raises
    ValueError / RuntimeError (via `select`) on an unknown or unsupported name."""
    for name in ("moecc_paged_attention_isa_max", "moecc_paged_attention_isa", "moecc_paged_attention_set_isa"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_int] if name.endswith("set_isa") else []
        fn.restype = ctypes.c_int
    want = os.environ.get(ENV, "").strip().lower()
    if want:
        select(lib, want, f"{ENV}={want}")


def select(lib: ctypes.CDLL, name: str, who: str) -> None:
    """Make build `name` the one every later call runs, or raise naming `who` asked for it."""
    if name not in ISAS:
        raise ValueError(f"{who}: unknown ISA {name!r} for the host-attention kernel; choose one of {', '.join(ISAS)}")
    if lib.moecc_paged_attention_set_isa(ISAS.index(name)) < 0:
        raise RuntimeError(f"{who}: this CPU (or the compiler that built runtime/native/paged_attention.c) lacks "
                           f"{name}; it runs {', '.join(supported(lib))}: choose one of those or unset {ENV}")


def supported(lib: ctypes.CDLL) -> list[str]:
    """The builds this CPU runs, lowest first."""
    return list(ISAS[:lib.moecc_paged_attention_isa_max() + 1])


def current(lib: ctypes.CDLL) -> str:
    """The build calls run now."""
    return ISAS[lib.moecc_paged_attention_isa()]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux's /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
