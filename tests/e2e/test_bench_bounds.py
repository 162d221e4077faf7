"""bench/bounds.py's counting: a job's arithmetic and bytes by hand on a tiny shape, the three
floors' order on any job (hypothesis), and a peers result priced into the shares its table
prints. Nothing here measures this machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import bounds  # noqa: E402  (bench/ is not a package; a broken bounds.py fails here, not skips)

TINY = bounds.Shapes(H=8, inter=4, layers=2, experts=4, top_k=2, heads=2, kv_heads=1, head_dim=4, vocab=16)


def test_tiny_job_counted_by_hand():
    # one prompt of 3 tokens generating 2: a prefill step, then one decode step at context 4
    layer_params = 8 * (8 + 4 + 4) + 8 * 8 + 8 * 4 + 2 * (8 * 8 + 4 * 8)  # q/k/v, o, router, top-2 gate/up + down
    token = 2 * 2 * layer_params
    assert TINY.token_flops() == token
    head, attn = 2 * 8 * 16, lambda positions: 4 * positions * 2 * 4 * 2
    weights = 2 * (8 * 16 + 8 * 8 + 8 * 4 + 4 * 3 * 8 * 4) + 8 * 16  # every expert's weights, and the lm_head
    kv = 2 * 1 * 4 * 2  # K and V of one position, both layers
    assert TINY.weight_elems() == weights and TINY.kv_elems() == kv
    work = bounds.job_work(TINY, [3], [2], itemsize=4, step_tokens=8192, rate=1.0, bw=1.0)
    assert work["prefill"].flops == 3 * token + head + attn(1 + 2 + 3)
    assert work["prefill"].bytes == 4 * (weights + 3 * kv)
    assert work["decode"].flops == token + head + attn(4)
    assert work["decode"].bytes == 4 * (weights + 4 * kv)


def test_prefill_steps_read_the_weights_each():
    one = bounds.job_work(TINY, [100], [1], 2, step_tokens=100, rate=1.0, bw=1.0)["prefill"]
    four = bounds.job_work(TINY, [100], [1], 2, step_tokens=25, rate=1.0, bw=1.0)["prefill"]
    assert four.flops == pytest.approx(one.flops)
    assert four.bytes - one.bytes == pytest.approx(3 * 2 * TINY.weight_elems())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6)), min_size=1, max_size=8),
       st.floats(1e3, 1e9), st.floats(1e3, 1e9), st.integers(8, 64))
def test_floors_are_ordered(jobs, rate, bw, step):
    work = bounds.job_work(TINY, [n for n, _ in jobs], [o for _, o in jobs], 2, step, rate, bw)
    f = bounds.floors(work, rate, bw)
    assert f["roofline"] <= f["per_step"] * (1 + 1e-9)
    assert f["per_step"] <= f["serial"] * (1 + 1e-9)
    assert f["serial"] == pytest.approx(f["compute"] + f["memory"])


def test_a_result_priced_into_shares():
    result = {"preset": "bench768", "dtype": "bfloat16", "workload": "long-context", "prompts": 4,
              "prompt_tokens": [10, 20], "output_tokens": [3, 3],
              "engines": [{"engine": "moecc (--dtype bfloat16)", "seconds": 2.0},
                          {"engine": "vLLM CPU", "seconds": 3.0}, {"engine": "llama.cpp", "seconds": 5.0}]}
    row = bounds.cell(result, 8192, 0, {"GEMM": 1e12, "ceiling": None}, 2e10)
    assert set(row["at"]) == {"GEMM"}  # a ceiling not measured here is left out
    assert row["peer"] == "vLLM CPU" and row["need_s"] == pytest.approx(3.0 / 1.3)
    p = row["at"]["GEMM"]
    floor = p["floors_s"]["per_step"]
    assert p["moecc_of_floor"] == pytest.approx(floor / 2.0)
    assert p["peer_of_floor"] == pytest.approx(floor / 3.0)
    assert p["need_of_floor"] == pytest.approx(floor * 1.3 / 3.0)
    # every decode step of this tiny job reads longer than it computes: the best share is the ratio
    assert p["decode_best_of_roofline"] == pytest.approx((p["flops"]["decode"] / 1e12) / (p["bytes"]["decode"] / 2e10))
    assert 0 < p["decode_best_of_roofline"] < 1
