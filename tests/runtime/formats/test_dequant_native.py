"""The formats' fast dequantize (runtime/formats/_grouped.py: dequant.c on the CPU, torch in row
chunks elsewhere) is bit-identical to each format's `reference` (the whole-tensor torch code the
formats had, which tests/test_formats*.py hold to the libraries): every format, every compute
dtype, odd shapes and groups, partial blocks, scales that overflow or underflow fp16; through
dequant.c's AVX-512 and portable paths, the torch path (what a GPU and an install without the
extension run) and into a caller's `out` buffer."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Callable

import pytest
import torch

from moecc_runtime import native
from moecc_runtime.formats import (_grouped, awq, ct_naive, ct_packed, fp8_block, gptq, int4_group, int8_channel,
                                   materialize, mxfp4, nvfp4)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Case = tuple[dict[str, Any], dict[str, torch.Tensor], Callable[..., torch.Tensor]]


def _bytes(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _scales(*shape: int, seed: int, spread: float = 6.0) -> torch.Tensor:
    """Positive and negative scales over many binades (fp16 overflows and subnormals included)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).sign() * torch.exp2(torch.randn(shape, generator=g) * spread)


def _fp8(*shape: int, seed: int, kind: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Random float8 codes without NaN (and inf) codes."""
    b = _bytes(*shape, seed=seed)
    bad = (b & 0x7F) == 0x7F if kind == torch.float8_e4m3fn else ((b >> 2) & 31) == 31
    return torch.where(bad, b & 0x80, b).view(kind)


def _entry(fmt: str, logical: list[int], **attrs: Any) -> dict[str, Any]:
    return {"format": fmt, "shape": logical, "logical_shape": logical, "format_attrs": attrs}


def fp8_cases() -> list[Case]:
    out = []
    for i, (R, C, b, r0) in enumerate([(1, 1, (4, 4), 0), (17, 33, (8, 16), 3), (40, 130, (128, 128), 0),
                                       (9, 31, (4, 8), 7)]):
        data = _fp8(R, C, seed=i)
        scale = _scales(-(-(R + r0) // b[0]), -(-C // b[1]), seed=i, spread=3)
        out.append((_entry("fp8_block", [R, C], block=list(b), row0=r0), {"data": data, "scale": scale},
                    fp8_block.reference))
    return out


def int8_cases() -> list[Case]:
    out = []
    for i, (R, C, t) in enumerate([(1, 1, False), (7, 33, False), (5, 200, True), (64, 48, False)]):
        st = {"data": _bytes(R, C, seed=i).view(torch.int8), "scale": _scales(R, seed=i)}
        out.append((_entry("int8_channel", [C, R] if t else [R, C], transpose=t), st, int8_channel.reference))
    return out


def int4_cases() -> list[Case]:
    out = []
    shapes = [(1, 1, 1, False, False), (3, 5, 3, True, False), (17, 33, 16, False, True), (8, 200, 128, False, False),
              (5, 97, 32, True, True), (2, 64, 5, False, False)]  # R, C, group, symmetric, transpose
    for i, (R, C, g, sym, t) in enumerate(shapes):
        G = -(-C // g)
        st = {"data": _bytes(R, -(-C // 2), seed=i), "scale": _scales(R, G, seed=i)}
        if not sym:
            st["zero"] = _bytes(R, G, seed=i + 50) & 15
        out.append((_entry("int4_group", [C, R] if t else [R, C], group=g, transpose=t), st, int4_group.reference))
    return out


def fp4_cases() -> list[Case]:
    out = []
    for i, (R, G, t) in enumerate([(1, 1, False), (7, 3, True), (16, 8, False)]):
        st = {"data": _bytes(R, G, 16, seed=i), "scale": _bytes(R, G, seed=i + 9).clamp(max=254)}
        out.append((_entry("mxfp4", [32 * G, R] if t else [R, 32 * G], transpose=t), st, mxfp4.reference))
    for i, (R, G) in enumerate([(1, 1), (5, 3), (33, 8)]):
        st = {"data": _bytes(R, 8 * G, seed=i), "scale": _fp8(R, G, seed=i + 3),
              "scale_2": _scales(1, seed=i, spread=2)}
        out.append((_entry("nvfp4", [R, 16 * G]), st, nvfp4.reference))
    return out


def ct_naive_cases() -> list[Case]:
    out = []
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    shapes = [(3, 7, "tensor", torch.int8, False, torch.float32), (9, 33, "channel", torch.int8, True, torch.bfloat16),
              (5, 70, "group", torch.int8, True, torch.float16), (6, 31, "channel", e4, False, torch.float32),
              (4, 48, "group", e5, False, torch.bfloat16), (2, 16, "tensor", e4, False, torch.float32)]
    for i, (R, C, how, kind, zero, sdt) in enumerate(shapes):  # R, C, scale strategy, data, zero, scale dtype
        group = 16 if how == "group" else 0
        shape = {"tensor": (), "channel": (R, 1), "group": (R, -(-C // 16))}[how]
        data = _bytes(R, C, seed=i).view(torch.int8) if kind == torch.int8 else _fp8(R, C, seed=i, kind=kind)
        st = {"data": data, "scale": _scales(*shape, seed=i, spread=3).to(sdt)}
        if zero:
            st["zero"] = (_bytes(*shape, seed=i + 7).view(torch.int8) // 4)
        out.append((_entry("ct_naive", [R, C], group=group), st, ct_naive.reference))
    return out


def _words(*shape: int, seed: int) -> torch.Tensor:
    return _bytes(*shape[:-1], shape[-1] * 4, seed=seed).view(torch.int32)


def ct_packed_cases() -> list[Case]:
    out = []
    for i, (R, C, bits, group, zero) in enumerate([(3, 7, 4, 0, False), (9, 40, 4, 8, True), (16, 64, 8, 32, True),
                                                    (5, 33, 8, 0, False), (17, 100, 4, 32, True)]):
        G = -(-C // group) if group > 0 else 1
        st = {"data": _words(R, -(-C * bits // 32), seed=i), "scale": _scales(R, G, seed=i).to(torch.bfloat16)}
        if zero:
            st["zero"] = _words(-(-R * bits // 32), G, seed=i + 5)
        out.append((_entry("ct_packed", [R, C], bits=bits, group=group), st, ct_packed.reference))
    return out


def gptq_awq_cases() -> list[Case]:
    R, C = 16, 32
    gq = {"data": _words(C // 8, R, seed=1), "zero": _words(2, R // 8, seed=2), "scale": _scales(2, R, seed=3).half()}
    aw = {"data": _words(C, R // 8, seed=4), "zero": _words(2, R // 8, seed=5), "scale": _scales(2, R, seed=6).half()}
    out = [(_entry("gptq", [R, C], bits=4, group=16, zero_offset=1), gq, gptq.reference),
           (_entry("awq_gemm", [R, C], group=16), aw, awq.reference)]
    for i, (R, C, bits, group, act) in enumerate([(24, 64, 8, 32, False), (40, 48, 4, 16, True), (8, 40, 4, -1, False),
                                                   (48, 24, 8, 8, True)]):
        k, G = 32 // bits, (-(-C // group) if group > 0 else 1)
        st = {"data": _words(-(-C // k), R, seed=i), "zero": _words(G, R // k, seed=i + 1),
              "scale": _scales(G, R, seed=i).half()}
        if act:
            st["g_idx"] = (torch.randperm(C, generator=torch.Generator().manual_seed(i)) // group).to(torch.int32)
        out.append((_entry("gptq", [R, C], bits=bits, group=group, zero_offset=i % 2), st, gptq.reference))
    for i, (R, C, group) in enumerate([(24, 40, 8), (8, 3, 1), (64, 130, 64)]):
        G = -(-C // group)
        st = {"data": _words(C, R // 8, seed=i), "zero": _words(G, R // 8, seed=i + 1), "scale": _scales(G, R, seed=i)}
        out.append((_entry("awq_gemm", [R, C], group=group), st, awq.reference))
    return out


CASES = [*fp8_cases(), *int8_cases(), *int4_cases(), *fp4_cases(), *ct_naive_cases(), *ct_packed_cases(),
         *gptq_awq_cases()]
IDS = [f"{e['format']}-{'x'.join(map(str, e['logical_shape']))}-{i}" for i, (e, _, _) in enumerate(CASES)]


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[got.dtype]
    g, w = got.contiguous().view(ints), want.contiguous().view(ints)
    bad = (g != w).nonzero()
    assert bad.numel() == 0, f"{len(bad)} elements differ, first at {bad[0].tolist()}: {got[tuple(bad[0])]} vs " \
                             f"{want[tuple(bad[0])]}"


@pytest.fixture(params=["native", "native-threaded", "native-no-bf16", "portable", "torch", "torch-chunked"])
def path(request, monkeypatch) -> str:
    if request.param.startswith(("native", "portable")) and native.dequant_library() is None:
        pytest.skip("dequant.c was not built (python setup.py build_ext --inplace)")
    if request.param == "native-threaded":  # every weight over torch's threads (only big ones are, by default)
        monkeypatch.setattr(_grouped, "NATIVE_THREADED_MIN", 0)
    if request.param == "portable":
        monkeypatch.setenv("MOECC_DEQUANT_PORTABLE", "1")
    if request.param == "native-no-bf16":  # AVX-512 without its bf16 conversion (on a CPU that has it)
        monkeypatch.setenv("MOECC_DEQUANT_NO_BF16", "1")
    if request.param.startswith("torch"):
        monkeypatch.setattr(native, "dequant_library", lambda: None)
    if request.param == "torch-chunked":
        monkeypatch.setattr(_grouped, "CHUNK", 7)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bit_identical_to_reference(case: Case, dtype: torch.dtype, path: str) -> None:
    entry, stored, reference = case
    assert_same_bits(materialize(entry, stored, dtype), reference(stored, entry, dtype))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_into_out_buffer(case: Case) -> None:
    entry, stored, reference = case
    n = int(torch.tensor(entry["logical_shape"]).prod())
    buf = torch.full((n + 8,), float("nan"), dtype=torch.bfloat16)
    got = materialize(entry, stored, torch.bfloat16, out=buf[4:4 + n])
    assert got.data_ptr() >= buf.data_ptr() + 8 and got.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert_same_bits(got, reference(stored, entry, torch.bfloat16))
    assert buf[:4].isnan().all() and buf[-4:].isnan().all()  # nothing written outside `out`


@pytest.mark.parametrize("fmt", ["int8_channel", "int4_group", "awq_gemm"])
def test_denormal_inf_and_nan_results_round_as_torch(fmt: str, path: str) -> None:
    """Results that vcvtneps2bf16 would round otherwise (fp32 denormals: it reads them as zero;
    NaNs from 0 x inf: it keeps their sign) take the integer rounding, lane for lane."""
    R, C = 6, 64
    scale = torch.tensor([1e-39, 3e-41, float("inf"), -float("inf"), 1e-45, 2.0])  # [R]
    if fmt == "int8_channel":
        data = _bytes(R, C, seed=3).view(torch.int8)
        data[:, :4] = 0  # 0 x inf: NaN
        st, entry, ref = {"data": data, "scale": scale}, _entry(fmt, [R, C]), int8_channel.reference
    elif fmt == "awq_gemm":  # a scale per column (the percol path), 32 columns a vector pair
        sc = torch.tensor([1e-39, 2.0, float("inf"), 3e-41] * 16)  # [64] output channels
        st = {"data": _words(32, 8, seed=5), "zero": _words(1, 8, seed=6), "scale": sc[None, :]}
        st["data"][:, 0] = 0  # 0 less zero 0 (some columns) x inf: NaN
        entry, ref = _entry(fmt, [C, 32], group=32), awq.reference
    else:
        data = _bytes(R, C // 2, seed=4)
        data[:, :2] = 0x88  # nibble 8 less zero 8: 0 x inf
        st = {"data": data, "scale": scale[:, None].repeat(1, 2), "zero": torch.full((R, 2), 8, dtype=torch.uint8)}
        entry, ref = _entry(fmt, [R, C], group=32, transpose=False), int4_group.reference
    for dtype in DTYPES:
        assert_same_bits(materialize(entry, st, dtype), ref(st, entry, dtype))


def test_nan_codes_stay_nan(path: str) -> None:
    """NaN codes of both signs, and signed zeros, under positive and negative scales: the same bits
    as the reference (e4m3 into a 16-bit dtype goes through its block's table of magnitudes)."""
    data = torch.tensor([[0x7F, 0xFF, 0x01, 0x80, 0x00, 0x81] * 22], dtype=torch.uint8).view(torch.float8_e4m3fn)
    for sc in (1.0, -3.0):
        st = {"data": data, "scale": torch.full((1, 2), sc)}  # [1, 132]: a table group and a tail
        for dtype in DTYPES:
            got = materialize(_entry("fp8_block", [1, 132], block=[128, 128]), st, dtype)
            want = fp8_block.reference(st, {"format_attrs": {"block": [128, 128]}}, dtype)
            assert torch.equal(got.isnan(), want.isnan())
            assert_same_bits(got, want)


def test_rejects_a_wrong_out_buffer() -> None:
    entry, stored, _ = int8_cases()[1]
    with pytest.raises(ValueError, match="out must be a dense"):
        materialize(entry, stored, torch.bfloat16, out=torch.empty(3, dtype=torch.bfloat16))


def test_runs_without_the_extension(tmp_path) -> None:
    """MOECC_NO_NATIVE=1 (what an install without a compiler gives): the torch path, same bits."""
    entry, stored, _ = int4_cases()[2]
    torch.save({"entry": entry, "stored": stored}, tmp_path / "case.pt")
    code = ("import sys, torch; from moecc_runtime import native; from moecc_runtime.formats import materialize, "
            "int4_group; c = torch.load(sys.argv[1], weights_only=True); assert native.dequant_library() is None; "
            "w = materialize(c['entry'], c['stored'], torch.bfloat16); "
            "assert torch.equal(w.view(torch.int16), int4_group.reference(c['stored'], c['entry'], torch.bfloat16)"
            ".view(torch.int16))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "case.pt")], capture_output=True, text=True,
                       env={**os.environ, "MOECC_NO_NATIVE": "1"})
    assert r.returncode == 0, r.stderr


def test_scratch_ring_hands_out_depth_buffers_in_turn() -> None:
    from moecc_runtime.formats.scratch import DEPTH, Ring, ring

    r = Ring()
    entry = {"logical_shape": [3, 5]}
    bufs = [r.out(entry, torch.bfloat16, torch.device("cpu")) for _ in range(DEPTH + 1)]
    assert len({b.data_ptr() for b in bufs[:DEPTH]}) == DEPTH and bufs[DEPTH] is bufs[0]
    assert bufs[0].numel() == 15 and bufs[0].dtype == torch.bfloat16
    assert r.out(entry, torch.float32, torch.device("cpu")).dtype == torch.float32  # a ring per dtype
    assert r.out(entry, torch.bfloat16, torch.device("meta")) is None  # off the CPU: the caller allocates

    class Owner:
        pass

    o = Owner()
    assert ring(o) is ring(o) and ring(o) is not ring(Owner())
