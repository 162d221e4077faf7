"""The host-attention kernel's per-ISA builds (runtime/native/paged_attention.c + attend_isa.h,
chosen by runtime/native/isa.py):

1. every build this CPU runs, forced through the override, against the float64 reference of
   tests/runtime/worker/test_host_attention.py (fp32 and bf16 pools, GQA, MLA, sinks, windows, strided
   views, 1 and 2 threads), and the builds against each other at the bench shape;
2. the selection: the default is the highest build the CPU's feature bits allow (compared
   with /proc/cpuinfo), MOECC_NATIVE_ISA forces one at load;
3. the refusal: an unknown name, and an ISA the CPU lacks (a stand-in library where this CPU
   has every build), both with errors that say what to choose.

Legend as in tests/runtime/worker/test_host_attention.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from tests.runtime.worker.test_host_attention import attention_cases, build_case, reference

from moecc_runtime import native
from moecc_runtime.native import isa

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not native.available(), reason="the paged attention kernel is not built "
                                 "(or MOECC_NO_NATIVE is set)")]

BUILDS = native.attention_isas()


@pytest.fixture
def restore_isa():
    """Put back the build the process ran before the test forced one."""
    before = native.attention_isa()
    yield
    native.use_attention_isa(before)


# -- 1. every build against the reference ----------------------------------------------------

@pytest.mark.parametrize("name", BUILDS)
@settings(max_examples=int(os.environ.get("MOECC_PROPERTY_EXAMPLES", "150")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(case=attention_cases())
def test_build_matches_reference(name, case, restore_isa):
    native.use_attention_isa(name)
    assert native.attention_isa() == name
    q, k, v, rows, tables, table_off, ctx, lo, scale, out, ost, sinks = build_case(case)
    before = ost.clone()
    native.paged_attention(q, k, v, rows, tables, table_off, ctx, lo, scale, out, sinks, threads=case["threads"])
    ref = reference(q, k, v, rows, tables, table_off, ctx, lo, scale, sinks)
    listed = set(case["rows"])
    for r in range(q.shape[0]):
        if r not in listed:
            assert torch.equal(ost[r], before[r]), f"{name}: row {r} is not in rows but was written"
            continue
        want, top = ref[r]
        tol = 2e-6 * max(1.0, want.abs().max().item()) * max(1.0, top / 4)  # as test_host_attention's
        err = (out[r].double() - want).abs().max().item()
        assert err <= tol, f"{name}, {case['dtype']}, D {case['D']}, G {case['G']}: row {r} off by {err:.3g} > {tol:.3g}"
        if ost.shape[-1] > out.shape[-1]:
            assert torch.equal(ost[r, :, out.shape[-1]:], before[r, :, out.shape[-1]:]), f"{name}: padding written"


@pytest.mark.parametrize("name", BUILDS)
@settings(max_examples=int(os.environ.get("MOECC_PROPERTY_EXAMPLES", "60")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(case=attention_cases())
def test_bf16_queries_give_their_fp32_values_result(name, case, restore_isa):
    """bf16 queries (a bf16 model's, handed over without an fp32 copy) give every build the
    result of their fp32 values: the same bits where the build widens them; where the
    avx512bf16 build scores them over a bf16 pool by vdpbf16ps (exact products, sums in
    another order), within fp32 rounding of the float64 reference, as every build is."""
    native.use_attention_isa(name)
    q, k, v, rows, tables, table_off, ctx, lo, scale, out, _, sinks = build_case(case)
    qb = q.to(torch.bfloat16)
    o16, o32 = torch.zeros(out.shape), torch.zeros(out.shape)
    native.paged_attention(qb, k, v, rows, tables, table_off, ctx, lo, scale, o16, sinks, threads=case["threads"])
    native.paged_attention(qb.float(), k, v, rows, tables, table_off, ctx, lo, scale, o32, sinks,
                           threads=case["threads"])
    if name != "avx512bf16" or case["dtype"] != torch.bfloat16:
        assert torch.equal(o16, o32), f"{name}: bf16 queries differ from their fp32 values"
        return
    ref = reference(qb.float(), k, v, rows, tables, table_off, ctx, lo, scale, sinks)
    for r in set(case["rows"]):
        want, top = ref[r]
        tol = 2e-6 * max(1.0, want.abs().max().item()) * max(1.0, top / 4)  # as test_build_matches_reference
        err = (o16[r].double() - want).abs().max().item()
        assert err <= tol, f"{name}, D {case['D']}, G {case['G']}: row {r} off by {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_builds_agree_at_the_bench_shape(dtype, restore_isa):
    """bench768's shape (8 query heads, 2 KV heads, head dim 96, blocks of 16), long rows and
    a ragged one: every build within fp32 rounding of the others, each thread count bitwise."""
    case = dict(D=96, Dv=96, mla=False, Hkv=2, G=4, bs=16, ctx=[1024, 257, 31, 600], lo=[0, 0, 0, 100],
                rows=[0, 1, 2, 3], sinks=False, dtype=dtype, threads=1, layout="dense", sharp=1.0, spare=3, seed=11)
    q, k, v, rows, tables, table_off, ctx, lo, scale, out, _, sinks = build_case(case)
    outs = {}
    for name in BUILDS:
        native.use_attention_isa(name)
        per_threads = []
        for threads in (1, 2):
            o = torch.empty_like(out)
            native.paged_attention(q, k, v, rows, tables, table_off, ctx, lo, scale, o, sinks, threads=threads)
            per_threads.append(o)
        assert torch.equal(per_threads[0], per_threads[1]), f"{name}: 1 and 2 threads differ"
        outs[name] = per_threads[0]
    for name, o in outs.items():
        err = (o - outs["baseline"]).abs().max().item()
        assert err < 1e-5, f"{name} differs from the baseline build by {err:.3g}"


# -- 2. the selection ----------------------------------------------------------------------------

def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists() or sys.platform != "linux", reason="needs /proc/cpuinfo")
def test_default_is_the_best_the_cpu_reports():
    flags = _cpu_flags()
    want = ["baseline"]
    if {"avx2", "fma"} <= flags:
        want.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
            want.append("avx512")
            if "avx512_bf16" in flags:
                want.append("avx512bf16")
    assert BUILDS == want, f"the kernel runs {BUILDS}, /proc/cpuinfo allows {want}"
    out = _python("from moecc_runtime import native; print(native.attention_isa())", {})
    assert out.stdout.strip() == want[-1], out.stderr


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != isa.ENV} | env
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", BUILDS)
def test_env_forces_a_build_at_load(name):
    out = _python("from moecc_runtime import native; print(native.attention_isa())", {isa.ENV: name})
    assert out.returncode == 0 and out.stdout.strip() == name, out.stderr


# -- 3. the refusal ------------------------------------------------------------------------------

def test_unknown_isa_is_refused_at_load():
    out = _python("from moecc_runtime import native; native.available()", {isa.ENV: "avx1024"})
    assert out.returncode != 0
    assert "MOECC_NATIVE_ISA=avx1024: unknown ISA" in out.stderr and "baseline, avx2, avx512" in out.stderr


class _CpuWithAvx2Only:
    """A stand-in for the kernel's library on a CPU whose best build is AVX2."""

    def moecc_paged_attention_isa_max(self) -> int:
        return isa.ISAS.index("avx2")

    def moecc_paged_attention_set_isa(self, level: int) -> int:
        return level if level <= self.moecc_paged_attention_isa_max() else -1


def test_an_isa_the_cpu_lacks_is_refused():
    with pytest.raises(RuntimeError, match=r"lacks avx512; it runs baseline, avx2: choose one of those"):
        isa.select(_CpuWithAvx2Only(), "avx512", "MOECC_NATIVE_ISA=avx512")
    isa.select(_CpuWithAvx2Only(), "avx2", "MOECC_NATIVE_ISA=avx2")  # one it has: no error


def test_the_kernel_refuses_a_level_past_its_best(restore_isa):
    """The C side itself: a level above the CPU's best changes nothing and says so (-1)."""
    lib = native._library()
    best = lib.moecc_paged_attention_isa_max()
    assert lib.moecc_paged_attention_set_isa(best + 1) == -1 and lib.moecc_paged_attention_set_isa(-1) == -1
    assert native.attention_isa() == isa.ISAS[lib.moecc_paged_attention_isa()]
    with pytest.raises(ValueError, match="unknown ISA 'sse9'"):
        native.use_attention_isa("sse9")
