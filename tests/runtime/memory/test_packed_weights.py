"""Weights packed for the host GEMM (runtime/memory/packed_weights.py): the packed product is
F.linear's (bf16 bit for bit, fp32 to rounding), an expert's stacked gate and up give the
unpacked MLP, an attention's stacked q, k and v its three projections (bf16 bit for bit), and a
plan packs exactly the weights only a GEMM reads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moecc.compiler import compile_model
from moecc.testing.checkpoints import write_checkpoint
from moecc_runtime.contract.plan_types import PlanView
from moecc_runtime.memory.packed_weights import (PackedInPlaceWeights, PackedLinear, bucket_rows, in_place_weights,
                                                 packable, packing_available)
from moecc_runtime.memory.streaming import InPlaceWeights
from moecc_runtime.memory.weights import TORCH_DTYPES, WeightStore, fp32_weight_keys
from moecc_runtime.worker.kernels import attention_qkv, gated_mlp, rope_table

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")
SMALL = dict(prompt_tokens=16, output_tokens=8, max_batch=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_is_f_linear(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 80, generator=g).to(dtype)
    got, want = PackedLinear(w, 128)(x, b), F.linear(x, w, b)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rows_are_padded_to_few_buckets_and_give_the_same_rows():
    """oneDNN JITs a kernel per row count: packed GEMMs run at bucketed row counts (zeros
    padded, the output cut back), and a [..., in] input keeps its leading shape."""
    assert [bucket_rows(m) for m in (0, 1, 16, 17, 256, 257, 1024, 1025, 4096)] == \
        [0, 16, 16, 32, 256, 288, 1024, 1088, 4096]
    assert len({bucket_rows(m) for m in range(1, 4097)}) == 16 + 24 + 48
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 80, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 5, 80, generator=g).to(torch.bfloat16)  # 15 rows: padded to 16
    got = PackedLinear(w, 16)(x)
    assert got.shape == (3, 5, 96) and torch.equal(got, F.linear(x, w))


def test_stacked_gate_and_up_give_the_gated_mlp():
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(*s, generator=g) for s in ((48, 32), (48, 32), (32, 48)))
    x = torch.randn(20, 32, generator=g)
    packed = gated_mlp(x, PackedLinear(torch.cat((gate, up)), 16, split=48), None, PackedLinear(down, 16), "silu")
    torch.testing.assert_close(packed, gated_mlp(x, gate, up, down, "silu"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 9, 512])
def test_stacked_q_k_v_give_the_three_projections(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    H, D, Hq, Hkv = 64, 16, 4, 2
    q, k, v = (torch.randn(n * D, H, generator=g).to(dtype) for n in (Hq, Hkv, Hkv))
    x = torch.randn(rows, H, generator=g).to(dtype)
    a = {"head_dim": D, "num_heads": Hq, "num_kv_heads": Hkv}
    rope = rope_table(torch.arange(rows), 1.0 / 10000 ** (torch.arange(0, D, 2) / D), 1.0, dtype)  # [rows, 2D]
    stacked = PackedLinear(torch.cat((q, k, v)), 16, sections=(Hq * D, Hkv * D, Hkv * D))
    got = attention_qkv(x, {"q": stacked, "k": None, "v": None}, a, rope)
    want = attention_qkv(x, {"q": PackedLinear(q, 16), "k": PackedLinear(k, 16), "v": PackedLinear(v, 16)}, a, rope)
    for t, u in zip(got, want):
        assert t.shape == u.shape
        if dtype == torch.bfloat16:
            assert torch.equal(t, u)
        else:
            torch.testing.assert_close(t, u, rtol=1e-5, atol=1e-5)


def _store(plan, model_dir):
    view = PlanView.of(plan)
    dtype = TORCH_DTYPES[view.info.dtype]
    return view, WeightStore(plan["weights"], model_dir, torch.device("cpu"), compute_dtype=dtype,
                             keep=fp32_weight_keys(view.schedule))


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2", "gpt_oss"])
def test_a_plan_packs_the_weights_only_a_gemm_reads(family, tmp_path):
    ckpt = write_checkpoint(tmp_path / family, family)
    plan, _ = compile_model(ckpt, **SMALL)
    view, store = _store(plan, ckpt)
    pack = packable(view, store)
    kinds = {op.op: op for m in view.schedule for op in m.ops}
    routers = {op.weights["weight"] for m in view.schedule for op in m.ops if op.op == "router"}
    assert not routers & set(pack.keys())
    assert kinds["lm_head"].weights["weight"] in pack.single
    attn = kinds["attention"].weights
    assert attn["o"] in pack.single
    if family == "mixtral":  # q, k, v without biases: one stacked GEMM
        assert pack.qkv == [(op.weights["q"], op.weights["k"], op.weights["v"])
                            for m in view.schedule for op in m.ops if op.op == "attention"]
    else:  # MLA has no k / v; gpt-oss's projections have biases: each its own GEMM
        assert pack.qkv == []
        assert family != "gpt_oss" or "q_bias" in attn
    if "kv_b" in attn:  # MLA's absorption reads kv_b as a tensor
        assert attn["kv_b"] not in pack.keys()
    experts = kinds["experts"]
    stacked_gates = {gate for gate, _ in pack.stacked}
    if experts.attrs["act"] == "clamped_swiglu":  # gpt-oss reads gate_up as [H, 2I]
        assert not any(k in pack.keys() for k in experts.weights.values())
    else:
        assert experts.weights["e0.gate"] in stacked_gates
        assert experts.weights["e0.down"] in pack.single
    weights = in_place_weights(store, view, 16)
    assert isinstance(weights, PackedInPlaceWeights)
    assert weights.packed_bytes == sum(store.manifest[k]["nbytes"] for k in pack.keys())


def test_moecc_pack_0_reads_the_weights_in_place(tmp_path, monkeypatch):
    ckpt = write_checkpoint(tmp_path / "m", "mixtral")
    plan, _ = compile_model(ckpt, **SMALL)
    view, store = _store(plan, ckpt)
    monkeypatch.setenv("MOECC_PACK", "0")
    assert type(in_place_weights(store, view, 16)) is InPlaceWeights
