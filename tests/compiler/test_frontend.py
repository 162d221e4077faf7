"""Frontend: roles from what modules hold, weight refs for both expert layouts, a real-size
config compiled without weights, and clear errors for what it cannot lower."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest
import torch

from moecc.compiler import compile_model
from moecc.errors import FrontendError
from moecc.frontend.roles import classify
from moecc.frontend.build import build_graph
from moecc.frontend.families import FAMILIES, family

ROOT = Path(__file__).parents[2]


def test_every_family_file_is_complete_and_every_published_config_has_a_family():
    """The registry (moecc/frontend/families/): each family names transformers' own causal-LM
    class for its model_type, its tiny config builds, its published configs exist; every
    config under examples/configs/ is of a registered family."""
    import json

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from moecc.testing.checkpoints import tiny_config

    assert len({f.model_type for f in FAMILIES}) == len(FAMILIES)
    for f in FAMILIES:
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[f.model_type] == f.architecture, f.model_type
        assert getattr(tiny_config(f.model_type), f.experts) == f.tiny[f.experts], f.model_type
        assert set(f.layouts) <= {"per_expert", "fused"} and f.layouts, f.model_type
        for name in f.published:
            cfg = json.loads((ROOT / "examples/configs" / name / "config.json").read_text())
            assert cfg["model_type"] == f.model_type, name
    for path in sorted((ROOT / "examples/configs").glob("*/config.json")):
        assert family(json.loads(path.read_text()).get("model_type")) is not None, path


def test_roles_come_from_what_modules_hold():
    from torch import nn

    class Odd(nn.Module):  # no telling name; holds stacked experts
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 8, 2))

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))
            self.eps = 1e-6

    assert classify(Odd()) == "experts"
    assert classify(Scale()) == "norm"
    assert classify(nn.Linear(2, 2)) is None


@pytest.mark.parametrize("family", [f.model_type for f in FAMILIES if {"per_expert", "fused"} <= set(f.layouts)])
def test_graph_is_the_same_for_both_layouts(family, checkpoints):
    g1, _ = build_graph(checkpoints(family, "per_expert"))
    g2, _ = build_graph(checkpoints(family, "fused"))
    assert [(n.name, n.op, n.role, n.shape) for n in g1.nodes] == [(n.name, n.op, n.role, n.shape) for n in g2.nodes]
    e1 = next(n for n in g1.nodes if n.op == "experts")
    e2 = next(n for n in g2.nodes if n.op == "experts")
    assert set(e1.weights) == set(e2.weights)
    assert e1.weight_bytes == e2.weight_bytes
    assert ".experts.0." in e1.weights["e0.gate"].tensor  # published per-expert tensors
    assert e2.weights["e0.gate"].tensor.endswith("experts.gate_up_proj")  # fused, sliced
    assert e2.weights["e1.up"].index == 1 and e2.weights["e1.up"].rows[0] == e2.weights["e1.up"].shape[0]


def test_nodes_carry_role_shape_flops_and_bytes(checkpoints):
    g, _ = build_graph(checkpoints("mixtral", "per_expert"))
    info = g.info
    experts = next(n for n in g.nodes if n.op == "experts")
    inter = experts.attrs["intermediate_size"]
    assert experts.shape == ("T", info.hidden_size)
    assert experts.flops_per_token == info.top_k * 6 * info.hidden_size * inter
    assert experts.weight_bytes == info.num_experts * 3 * info.hidden_size * inter * 4
    for n in g.nodes:
        if n.op not in ("input", "output"):
            assert n.role and n.shape, n.name
    from safetensors import safe_open

    with safe_open(str(checkpoints("mixtral", "per_expert") / "model.safetensors"), "pt") as f:
        total = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    assert g.weight_bytes == total * 4  # every checkpoint tensor is read exactly once


@pytest.mark.slow
def test_mixtral_8x22b_config_compiles_without_weights(tmp_path):
    """A 141B-parameter model compiles from its published config.json alone, quickly and in
    little memory: nothing is materialised."""
    d = tmp_path / "8x22b"
    d.mkdir()
    (d / "config.json").write_text((ROOT / "examples/configs/mixtral-8x22b/config.json").read_text())
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    plan, g = compile_model(d, gpu_mem=24 * 10**9, host_mem=512 * 10**9)
    seconds = time.perf_counter() - start
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    params = g.weight_bytes / 2  # bf16
    assert abs(params - 140.6e9) / 140.6e9 < 0.01, params  # Mixtral-8x22B: 140.6B parameters
    assert grown_kib < 1_500_000, f"compile grew RSS by {grown_kib} KiB"
    assert seconds < 60
    assert len(plan["schedule"]) == 2 + 2 * 56
    assert plan["model"]["fingerprint"]["weight_files"] == {}
    assert g.info.kv_bytes_per_token == 2 * 56 * 8 * 128 * 2


def test_unsupported_glue_names_layer_and_node(checkpoints, monkeypatch):
    from transformers.models.mixtral import modeling_mixtral

    original = modeling_mixtral.MixtralDecoderLayer.forward

    def forward(self, hidden_states, **kwargs):
        return torch.tanh(original(self, hidden_states, **kwargs))

    monkeypatch.setattr(modeling_mixtral.MixtralDecoderLayer, "forward", forward)
    with pytest.raises(FrontendError, match=r"frontend: layer 0, node %tanh: unsupported operation .*tanh"):
        build_graph(checkpoints("mixtral", "per_expert"))


def test_missing_tensor_is_named(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from moecc.errors import CheckpointError

    src = checkpoints("mixtral", "per_expert")
    d = tmp_path / "broken"
    shutil.copytree(src, d)
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.layers.1.self_attn.k_proj.weight is missing"):
        build_graph(d)


def test_qwen2_moe_shared_expert_gate_is_lowered_from_transformers_glue(checkpoints):
    """Qwen2-MoE: the shared expert's sigmoid gate (a [1, H] linear) and the product come from
    transformers' own layer code; top-k weights are not renormalised (norm_topk_prob false)."""
    g, _ = build_graph(checkpoints("qwen2_moe", "per_expert"))
    moe_layers = [0, 2]  # mlp_only_layers=[1]
    for i in moe_layers:
        ops = [n.op for n in g.nodes if n.layer == i]
        assert ops.count("mlp") == 1 and "sigmoid" in ops and "mul" in ops and "linear" in ops, ops
        gate = next(n for n in g.nodes if n.layer == i and n.op == "linear")
        assert gate.shape == ("T", 1) and gate.weights["weight"].tensor.endswith("shared_expert_gate.weight")
        router = next(n for n in g.nodes if n.layer == i and n.op == "router")
        assert router.attrs["norm_topk_prob"] is False
    assert [n.op for n in g.nodes if n.layer == 1].count("mlp") == 1


def test_olmoe_qk_norm_over_the_whole_projection(checkpoints):
    g, _ = build_graph(checkpoints("olmoe", "per_expert"))
    a = next(n for n in g.nodes if n.op == "attention")
    i = g.info
    assert a.attrs["qk_norm"] == "full" and a.attrs["clip_qkv"] == 0.5
    assert a.weights["q_norm"].shape == (i.num_heads * i.head_dim,)
    assert a.weights["k_norm"].shape == (i.num_kv_heads * i.head_dim,)
    q3 = next(n for n in build_graph(checkpoints("qwen3_moe", "per_expert"))[0].nodes if n.op == "attention")
    assert q3.attrs["qk_norm"] == "head" and "clip_qkv" not in q3.attrs
