"""The runtime's routing kernels pick the same experts with the same weights as
transformers' routers: DeepSeek-V3's group-limited sigmoid routing (correction bias, groups,
scaling) against DeepseekV3TopkRouter, on random inputs and biases that move the choice, and
DeepSeek-V2's softmax routing (greedy or limited to the top groups, scaled) against
DeepseekV2TopkRouter."""

from __future__ import annotations

import pytest
import torch
import transformers

from moecc_runtime.worker import kernels


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm", [True, False])
def test_v3_grouped_sigmoid_routing_matches_transformers(seed, norm):
    cfg = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=norm)
    torch.manual_seed(seed)
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.3)  # large enough to change picks
    x = torch.randn(64, 32)
    with torch.no_grad():
        _, ref_w, ref_i = router(x)
    a = {"scoring": "sigmoid", "top_k": 4, "num_groups": 4, "topk_groups": 2, "routed_scaling_factor": 2.5,
         "norm_topk_prob": norm}
    w, i = kernels.route(x, router.weight.detach(), a, router.e_score_correction_bias)
    # same set of experts per token, same weight on each (topk order may differ)
    ro, mo = ref_i.sort(dim=-1), i.sort(dim=-1)
    assert torch.equal(ro.values, mo.values)
    torch.testing.assert_close(w.gather(1, mo.indices), ref_w.gather(1, ro.indices), rtol=1e-6, atol=1e-6)
    # the bias changed some choices: without it the picks differ for some token
    _, i0 = kernels.route(x, router.weight.detach(), a, None)
    assert not torch.equal(i0.sort(dim=-1).values, mo.values)


def _same_choice(ref_w, ref_i, w, i):
    ro, mo = ref_i.sort(dim=-1), i.sort(dim=-1)
    assert torch.equal(ro.values, mo.values)
    torch.testing.assert_close(w.gather(1, mo.indices), ref_w.gather(1, ro.indices), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("method,groups,topk_groups", [("greedy", 1, 1), ("group_limited_greedy", 4, 2)])
def test_v2_softmax_routing_matches_transformers(seed, method, groups, topk_groups):
    cfg = transformers.DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=groups,
                                        topk_group=topk_groups, topk_method=method, routed_scaling_factor=16.0)
    torch.manual_seed(seed)
    router = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(64, 32)
    with torch.no_grad():
        _, ref_w, ref_i = router(x)
    a = {"top_k": 4, "topk_method": method, "num_groups": groups, "topk_groups": topk_groups,
         "routed_scaling_factor": 16.0, "norm_topk_prob": False, "scoring": "softmax"}
    w, i = kernels.route(x, router.weight.detach(), a)
    _same_choice(ref_w, ref_i, w, i)
