"""The published-config examples of issue 33, without weights: Qwen3-30B-A3B in GPTQ int4
(examples/configs/qwen3-30b-a3b-gptq-int4: Qwen's GPTQ-Int4 quantization_config, fp16) and
DeepSeek-R1 in NVFP4 (examples/configs/deepseek-r1-nvfp4: config.json plus ModelOpt's
hf_quant_config.json, attention and lm_head excluded). The graph counts the stored bytes
of the release's tensors per kind of weight (`moecc explain` prints the same per kind)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from moecc.frontend.build import build_graph
from moecc.views.explain import _format_lines

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]  # see conftest


def _by_role(g) -> dict[str, dict[str, int]]:
    """role -> stored format -> stored bytes."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for n in g.nodes:
        for w in n.weights.values():
            out[n.role][w.format] += w.nbytes
    return out


def test_qwen3_30b_gptq_int4_config_counts_the_release_bytes():
    """4 bits a weight plus an fp16 scale and a 4-bit zero per 128 (0.52 bytes) for attention
    and experts; embeddings, routers, norms and lm_head fp16: 16.8GB, the release's size."""
    g, _ = build_graph(CONFIGS / "qwen3-30b-a3b-gptq-int4")
    roles = _by_role(g)
    assert set(roles["experts"]) == {"gptq"} and set(roles["attention"]) == {"gptq", "dense"}  # + q/k norms
    assert set(roles["router"]) == {"dense"} and set(roles["lm_head"]) == {"dense"}
    assert 16.5e9 < g.weight_bytes < 17.2e9
    experts = next(n for n in g.nodes if n.role == "experts")
    w = experts.weights["e0.gate"]  # [768, 2048] in groups of 128
    assert w.shape == (768, 2048) and [(k, p.shape, p.dtype) for k, p in w.parts] == [
        ("data", (256, 768), "int32"), ("zero", (16, 96), "int32"), ("scale", (16, 768), "float16")]


def test_deepseek_r1_nvfp4_config_counts_the_release_bytes():
    """Experts, shared experts and dense MLPs in NVFP4 (4.5 bits a weight with an e4m3 scale
    per 16, plus one fp32 global scale); MLA attention, routers and lm_head bf16: 397GB."""
    g, _ = build_graph(CONFIGS / "deepseek-r1-nvfp4")
    roles = _by_role(g)
    assert set(roles["experts"]) == {"nvfp4"} and set(roles["attention"]) == {"dense"}
    assert 390e9 < g.weight_bytes < 405e9
    rows = {k: {"formats": dict(v), "stored_bytes": sum(v.values()), "compute_bytes": 1} for k, v in roles.items()}
    assert any("nvfp4" in line for line in _format_lines(rows))
