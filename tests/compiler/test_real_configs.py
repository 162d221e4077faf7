"""Real-size configs (examples/configs/*/config.json, written from the published values):
each compiles without weights to a plan with predicted figures, and its weight and KV byte
counts match the published parameter counts (within 1%) and the attention's cache layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moecc.compiler import compile_model
from moecc.frontend.families import FAMILIES
from moecc.sizes import parse_size

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
# published total parameters (model cards), weights counted in the config's bf16: each family
# file's `published` (moecc/frontend/families/; mixtral-8x22b: tests/compiler/test_frontend.py;
# deepseek-v3, 671B: tests/compiler/test_deepseek_plan.py)
PUBLISHED = {name: params for f in FAMILIES for name, params in f.published.items()}


@pytest.mark.parametrize("name", [n if n == "olmoe-1b-7b" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(PUBLISHED)])  # fast tier: the smallest
def test_real_config_compiles_and_counts_match(name):
    cfg = json.loads((CONFIGS / name / "config.json").read_text())
    host = parse_size("1TB")
    plan, g = compile_model(CONFIGS / name, gpu_mem=parse_size("24GB"), host_mem=host, hardware="a5000",
                            prompt_tokens=512, output_tokens=256)
    params = g.weight_bytes / 2
    assert abs(params / PUBLISHED[name] - 1) < 0.01, f"{name}: {params / 1e9:.2f}B parameters"
    if cfg.get("kv_lora_rank"):  # MLA: the latent and the rope key, not the expanded heads
        row = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    else:
        row = 2 * cfg["num_key_value_heads"] * (cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    assert g.info.kv_bytes_per_token == cfg["num_hidden_layers"] * row * 2
    p = plan["predicted"]
    assert p["decode_tokens_per_s"] > 0 and p["prefill_tokens_per_s"] > 0 and p["bottleneck"]["decode"]
    assert plan["arena"]["bytes"] <= parse_size("24GB")
    assert plan["model"]["fingerprint"]["weight_files"] == {}  # config only: for planning, exec refuses it


@pytest.mark.parametrize("name", ["gpt-oss-20b", pytest.param("gpt-oss-120b", marks=pytest.mark.slow)])
def test_gpt_oss_layers_alternate_sliding_and_full_attention(name):
    """layer_types decides each layer's window (128 on sliding layers, none on full ones);
    every attention carries its sinks and every router its bias."""
    from moecc.frontend.build import build_graph

    cfg = json.loads((CONFIGS / name / "config.json").read_text())
    g, _ = build_graph(CONFIGS / name)
    attn = sorted((n for n in g.nodes if n.op == "attention"), key=lambda n: n.layer)
    assert [n.attrs.get("sliding_window") for n in attn] == [
        cfg["sliding_window"] if t == "sliding_attention" else None for t in cfg["layer_types"]]
    assert all("sinks" in n.weights for n in attn)
    routers = [n for n in g.nodes if n.op == "router"]
    assert all("bias" in n.weights and n.attrs["scoring"] == "topk_softmax" for n in routers)
