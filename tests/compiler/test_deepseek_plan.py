"""DeepSeek-V3 compiles from its published config.json alone (671B parameters, weights
absent): MLA attention traced as one role leaf whose cache is the compressed latent plus the
rope key, V3 routing attributes on the router, the first layers dense, the MoE block's
`view(*orig_shape)` traced through shape-carrying proxies; the planner solves it in seconds.
A tiny DeepSeek-V3 checkpoint runs streamed through a small arena, token-identical to
transformers, with a host KV pool that holds only the latent and the rope key."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from moecc.compiler import compile_model
from tests.e2e.test_equivalence import hf_models  # noqa: F401  (a fixture)
from moecc.sizes import parse_size

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "deepseek-v3"


@pytest.fixture(scope="module")
def v3():
    t0 = time.perf_counter()
    plan, g = compile_model(CONFIG, gpu_mem=parse_size("24GB"), host_mem=parse_size("2TB"), hardware="a5000",
                            prompt_tokens=512, output_tokens=256)
    return plan, g, time.perf_counter() - t0


@pytest.mark.slow
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


@pytest.mark.slow
def test_v3_parameter_count_matches_the_published_671b(v3):
    _, g, _ = v3
    params = g.weight_bytes / 2  # bf16
    assert abs(params / 671e9 - 1) < 0.01, params


@pytest.mark.slow
def test_v3_plan_solves_in_seconds_and_fits_the_budget(v3):
    plan, _, seconds = v3
    assert seconds < 60, f"compile took {seconds:.1f}s"
    dev = plan["memory"]["device"]
    assert dev["arena"] <= parse_size("24GB") and max(dev["decode_total"], dev["prefill_total"]) <= dev["budget"]
    assert plan["predicted"]["decode_tokens_per_s"] > 0 and plan["arena"]["expert_slots"] >= 1


@pytest.mark.slow
def test_tiny_v3_streams_token_identical_with_a_latent_kv_pool(checkpoints, hf_models):
    """MLA decode reads only the cached latent (absorbed form, never expanding K/V heads);
    streamed through an arena below the weights' size, greedy output equals transformers'."""
    from moecc_runtime.engine import Engine, generate
    from moecc_runtime.scheduler.sequence import GenRequest

    from tests.e2e.test_equivalence import _prompts, _reference

    path = checkpoints("deepseek_v3", "per_expert")
    model, tok = hf_models(path)
    plan, g = compile_model(path, gpu_mem=450_000, prompt_tokens=16, output_tokens=8, max_batch=4)
    assert plan["arena"]["bytes"] <= 450_000 < plan["predicted"]["weight_bytes"]
    eng = Engine(plan, path, "cpu", expert_chunk=3, attn_micro_batch=2)
    cfg = model.config
    L, latent = cfg.num_hidden_layers, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert eng.worker.kv.k.shape[1] == 1 and eng.worker.kv.k.shape[-1] == latent and eng.worker.kv.v.shape[-1] == 0
    assert eng.worker.kv.bytes_per_token == L * latent * 4 == g.info.kv_bytes_per_token
    reqs = [GenRequest(str(i), tok(p)["input_ids"], 6) for i, p in enumerate(_prompts(6))]
    got: dict = {}
    try:
        generate(eng, reqs, lambda r: got.__setitem__(r.key, r), record_logits=True)
    finally:
        eng.close()
    worst = 0.0
    for r in reqs:
        ref_ids, ref_logits = _reference(model, r.prompt_ids, 6)
        assert got[r.key].token_ids == ref_ids, r.key
        worst = max([worst, *((a - b).abs().max().item() for a, b in zip(got[r.key].logits, ref_logits))])
    assert worst < 1e-4, worst
    assert 0 < eng.stats.peak_device_bytes <= 450_000 and eng.stats.copy_bytes > 0
