"""DeepSeek-V3 compiles for planning from its published config.json alone (671B parameters,
weights absent): MLA attention traced as one role leaf whose cache is the compressed latent
plus the rope key, V3 routing attributes on the router, the first layers dense, the MoE
block's `view(*orig_shape)` traced through shape-carrying proxies; the planner solves it in
seconds. A DeepSeek checkpoint with weights is refused (the runtime has no MLA kernels yet)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from moecc.compiler import compile_model
from moecc.errors import UnsupportedModelError
from moecc.frontend.trace import build_graph
from moecc.sizes import parse_size

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "deepseek-v3"


@pytest.fixture(scope="module")
def v3():
    t0 = time.perf_counter()
    plan, g = compile_model(CONFIG, gpu_mem=parse_size("24GB"), host_mem=parse_size("2TB"), hardware="a5000",
                            prompt_tokens=512, output_tokens=256)
    return plan, g, time.perf_counter() - t0


def test_v3_graph_has_mla_latent_cache_and_v3_routing(v3):
    _, g, _ = v3
    cfg = json.loads((CONFIG / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    attn = [n for n in g.nodes if n.op == "attention"]
    assert len(attn) == L and all(n.attrs["variant"] == "mla" for n in attn)
    a = attn[0]
    assert {"q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b", "o"} <= set(a.weights)
    # the cache per token and layer: the latent (512) and the shared rope key (64), in bf16
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert g.info.kv_bytes_per_token == L * latent * 2
    expanded = L * 2 * cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) * 2
    assert g.info.kv_bytes_per_token * 50 < expanded  # far below the expanded heads
    kv_loads = [n for n in g.nodes if n.op == "kv_load"]
    assert kv_loads and all(n.attrs["bytes_per_ctx_token"] == latent * 2 for n in kv_loads)
    routers = [n for n in g.nodes if n.op == "router"]
    assert len(routers) == L - cfg["first_k_dense_replace"]
    r = routers[0].attrs
    assert r["scoring"] == "sigmoid" and r["num_groups"] == 8 and r["topk_groups"] == 4
    assert r["routed_scaling_factor"] == 2.5 and "bias" in routers[0].weights
    dense = [n for n in g.nodes if n.op == "mlp" and n.layer < cfg["first_k_dense_replace"]]
    assert len(dense) == cfg["first_k_dense_replace"]
    shared = [n for n in g.nodes if n.op == "mlp" and n.layer >= cfg["first_k_dense_replace"]]
    assert len(shared) == L - cfg["first_k_dense_replace"]  # one shared expert per MoE layer


def test_v3_parameter_count_matches_the_published_671b(v3):
    _, g, _ = v3
    params = g.weight_bytes / 2  # bf16
    assert abs(params / 671e9 - 1) < 0.01, params


def test_v3_plan_solves_in_seconds_and_fits_the_budget(v3):
    plan, _, seconds = v3
    assert seconds < 60, f"compile took {seconds:.1f}s"
    dev = plan["memory"]["device"]
    assert dev["arena"] <= parse_size("24GB") and max(dev["decode_total"], dev["prefill_total"]) <= dev["budget"]
    assert plan["predicted"]["decode_tokens_per_s"] > 0 and plan["arena"]["expert_slots"] >= 1


def test_v3_checkpoint_with_weights_is_refused(tmp_path):
    """The runtime has no MLA kernels yet: a directory holding weights fails at compile time,
    naming the architecture and what runs."""
    d = tmp_path / "v3"
    d.mkdir()
    (d / "config.json").write_text((CONFIG / "config.json").read_text())
    from safetensors.torch import save_file
    import torch

    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(d / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="DeepseekV3ForCausalLM compiles for planning only.*Runnable: "
                                                    "MixtralForCausalLM"):
        build_graph(d)
