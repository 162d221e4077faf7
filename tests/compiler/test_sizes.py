"""Tests for moecc.sizes: parse_size (command-line byte sizes) and format_bytes."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moecc.sizes import SizeError, format_bytes, format_count, parse_size

DECIMAL = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6,
           "G": 10**9, "GB": 10**9, "T": 10**12, "TB": 10**12}
BINARY = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
UNITS = {**DECIMAL, **BINARY}
EXACT_FLOAT_LIMIT = 2**53  # every integer up to here is exact in a float

# ----------------------------------------------------------------------------- parse_size: examples


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GB", 24 * 10**9),
        ("24GiB", 24 * 2**30),
        ("512MB", 512 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1.5TB", 1_500_000_000_000),
        ("1.5TiB", 3 * 2**39),
        ("1073741824", 2**30),
        ("1", 1),
        ("100B", 100),
        ("24G", 24 * 10**9),
        ("8K", 8000),
        ("2KiB", 2048),
        ("0.5GB", 500_000_000),
        (".5GB", 500_000_000),
        ("24.GB", 24 * 10**9),
        ("1.25KiB", 1280),
    ],
)
def test_parse_size_examples(text: str, expected: int) -> None:
    got = parse_size(text)
    assert got == expected
    assert isinstance(got, int)


@pytest.mark.parametrize("text", ["24gb", "24Gb", "24gB", "24GB", "24g"])
def test_parse_size_decimal_units_are_case_insensitive(text: str) -> None:
    assert parse_size(text) == 24 * 10**9


@pytest.mark.parametrize("text", ["24gib", "24GIB", "24GiB", "24gIb"])
def test_parse_size_binary_units_are_case_insensitive(text: str) -> None:
    assert parse_size(text) == 24 * 2**30


@pytest.mark.parametrize("text", [" 24GB", "24GB ", "  24 GB  ", "24\tGiB", "\n512 MB\n"])
def test_parse_size_ignores_surrounding_and_inner_whitespace(text: str) -> None:
    assert parse_size(text) == parse_size(text.replace(" ", "").replace("\t", "").replace("\n", ""))


def test_binary_and_decimal_units_differ() -> None:
    assert parse_size("1GiB") - parse_size("1GB") == 2**30 - 10**9


# ----------------------------------------------------------------------------- parse_size: errors


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "cannot parse"),
        ("   ", "cannot parse"),
        ("abc", "cannot parse"),
        ("GB", "cannot parse"),
        ("-1GB", "cannot parse"),
        ("+1GB", "cannot parse"),
        ("24 G B", "cannot parse"),
        ("1,5GB", "cannot parse"),
        (".", "cannot parse"),
        ("24XB", "unknown unit"),
        ("24gbs", "unknown unit"),
        ("1e9", "cannot parse"),
        ("24e", "unknown unit"),
        ("0", "positive"),
        ("0GB", "positive"),
        ("0.0MiB", "positive"),
    ],
)
def test_parse_size_rejects(text: str, fragment: str) -> None:
    with pytest.raises(SizeError) as info:
        parse_size(text)
    message = str(info.value)
    assert fragment in message
    assert repr(text) in message  # the offending input is quoted back


def test_size_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_size("abc")


@pytest.mark.parametrize("value", [None, 24, 24.0, b"24GB"])
def test_parse_size_rejects_non_strings(value: object) -> None:
    with pytest.raises(SizeError):
        parse_size(value)  # type: ignore[arg-type]


def test_unknown_unit_error_lists_the_units() -> None:
    with pytest.raises(SizeError) as info:
        parse_size("24XB")
    message = str(info.value)
    assert "'XB'" in message
    for unit in ("KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"):
        assert unit in message


def test_cannot_parse_error_gives_examples() -> None:
    with pytest.raises(SizeError) as info:
        parse_size("abc")
    assert "24GB" in str(info.value) and "24GiB" in str(info.value)


@pytest.mark.parametrize("text", ["", "abc", "24XB", "-1GB", "0", "GB"])
@pytest.mark.parametrize("what", ["--gpu-mem", "--host-mem"])
def test_error_messages_name_the_option(text: str, what: str) -> None:
    with pytest.raises(SizeError) as info:
        parse_size(text, what=what)
    assert str(info.value).startswith(f"{what}: ")


def test_default_what_is_size() -> None:
    with pytest.raises(SizeError) as info:
        parse_size("abc")
    assert str(info.value).startswith("size: ")


@pytest.mark.parametrize("text", ["0.4", "0.0001KB"])
def test_sub_byte_sizes_are_not_accepted_as_zero(text: str) -> None:
    try:
        got = parse_size(text)
    except SizeError:
        return
    assert got > 0


@pytest.mark.parametrize(("text", "expected"), [("9007199254740993", 2**53 + 1),
                                                 ("12345678901GB", 12345678901 * 10**9)])
def test_large_integer_sizes_are_exact(text: str, expected: int) -> None:
    assert parse_size(text) == expected


# ----------------------------------------------------------------------------- parse_size: properties

unit_names = st.sampled_from(sorted(UNITS))


def _case_variants(unit: str) -> st.SearchStrategy[str]:
    return st.tuples(*[st.sampled_from(sorted({c.lower(), c.upper()})) for c in unit]).map("".join)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), unit=unit_names)
def test_property_integer_times_unit(data: st.DataObject, unit: str) -> None:
    factor = UNITS[unit]
    n = data.draw(st.integers(min_value=1, max_value=EXACT_FLOAT_LIMIT // factor), label="n")
    spelled = data.draw(_case_variants(unit), label="spelling")
    space = data.draw(st.sampled_from(["", " ", "  "]), label="space")
    assert parse_size(f"{n}{space}{spelled}") == n * factor


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=1, max_value=10**6), unit=unit_names,
       what=st.sampled_from(["--gpu-mem", "--host-mem", "size"]))
def test_property_what_does_not_change_the_value(n: int, unit: str, what: str) -> None:
    assert parse_size(f"{n}{unit}", what=what) == parse_size(f"{n}{unit}")


@settings(max_examples=200, deadline=None)
@given(tenths=st.integers(min_value=1, max_value=10**5), unit=st.sampled_from(sorted(set(UNITS) - {"", "B"})))
def test_property_one_decimal_place(tenths: int, unit: str) -> None:
    text = f"{tenths // 10}.{tenths % 10}{unit}"
    expected = tenths * UNITS[unit] / 10
    assert abs(parse_size(text) - expected) <= 0.5


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=12))
def test_property_parse_size_returns_positive_int_or_raises_size_error(text: str) -> None:
    try:
        got = parse_size(text, what="--gpu-mem")
    except SizeError as e:
        assert str(e).startswith("--gpu-mem: ")
        return
    assert isinstance(got, int)
    assert got >= 1


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=1, max_value=10**6),
       bad=st.text(alphabet=st.characters(whitelist_categories=("Lu", "Ll")), min_size=1, max_size=4))
def test_property_unknown_units_are_rejected(n: int, bad: str) -> None:
    if bad.lower() in {u.lower() for u in UNITS}:
        return
    with pytest.raises(SizeError):
        parse_size(f"{n}{bad}")


# ----------------------------------------------------------------------------- format_bytes


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0B"),
        (1, "1B"),
        (1023, "1023B"),
        (1024, "1.0KiB"),
        (1536, "1.5KiB"),
        (2**20, "1.0MiB"),
        (24 * 2**30, "24.0GiB"),
        (3 * 2**39, "1.5TiB"),
        (2**50, "1024.0TiB"),  # TiB is the largest unit
        (1536.0, "1.5KiB"),
    ],
)
def test_format_bytes_examples(n: float, expected: str) -> None:
    assert format_bytes(n) == expected


_FORMAT_RE = re.compile(r"^(?:[0-9]+B|[0-9]+\.[0-9](?:KiB|MiB|GiB|TiB))$")


@settings(max_examples=300, deadline=None)
@given(n=st.integers(min_value=1, max_value=2**52))
def test_property_format_bytes_round_trips_through_parse_size(n: int) -> None:
    text = format_bytes(n)
    assert _FORMAT_RE.match(text), text
    back = parse_size(text)
    if n < 1024:
        assert back == n
    else:
        unit = BINARY[text[-3:]]
        # one decimal place: off by at most half a tenth of the unit (plus rounding to a byte)
        assert abs(back - n) <= 0.05 * unit + 1


@settings(max_examples=200, deadline=None)
@given(a=st.integers(min_value=1, max_value=2**45), b=st.integers(min_value=1, max_value=2**45))
def test_property_format_bytes_is_monotonic(a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    assert parse_size(format_bytes(lo)) <= parse_size(format_bytes(hi))


def test_format_count_examples() -> None:
    assert format_count(999) == "999"
    assert format_count(1200) == "1.2K"
    assert format_count(3_400_000) == "3.4M"
    assert format_count(5.6e9) == "5.6G"
