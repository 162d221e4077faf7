"""Byte sizes on the command line: `24GB`, `24GiB`, `512MB`, `1.5TB`, `1073741824`.

Decimal units (KB, MB, GB, TB) are powers of 1000, binary units (KiB, MiB, GiB, TiB)
powers of 1024, as on datasheets and in `free`. Units are case-insensitive; a bare
number is bytes; `B` may be omitted (`24G` = 24GB).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
    "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


class SizeError(ValueError):
    """An unparseable size string."""


def parse_size(text: str, *, what: str = "size", allow_zero: bool = False) -> int:
    """Parse `text` into a number of bytes (0 only with `allow_zero`); raise SizeError naming
    `what` otherwise."""
    m = _SIZE_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise SizeError(
            f"{what}: cannot parse {text!r} as a size; expected a number with an optional "
            f"unit, e.g. 24GB, 24GiB, 512MB, 1.5TB or 1073741824"
        )
    number, unit = m.group(1), m.group(2).lower()
    if unit not in _UNITS:
        raise SizeError(
            f"{what}: unknown unit {m.group(2)!r} in {text!r}; use B, KB, MB, GB, TB "
            f"(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
        )
    value = round(Fraction(number) * _UNITS[unit])  # exact, also above 2**53
    if value < (0 if allow_zero else 1):
        raise SizeError(f"{what}: {text!r} must be a positive size of at least one byte")
    return int(value)


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.5KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)}B"
            return f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_size_at_least(n: float) -> str:
    """A size string (decimal units, one decimal) that parses to at least `n` bytes; for
    error messages that suggest a budget."""
    need = Fraction(math.ceil(n))
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if need >= factor:
            tenths = math.ceil(need * 10 / factor)
            return f"{tenths // 10}.{tenths % 10}{unit}"
    return f"{int(need)}B"


def format_count(n: float) -> str:
    """Compact count: 1.2K, 3.4M, 5.6G."""
    n = float(n)
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    raise AssertionError("unreachable")
