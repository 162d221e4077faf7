"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention (q and kv low rank,
interleaved rope as rope_interleave says), a dense first layer, group-limited sigmoid
routing with a shared expert."""

from __future__ import annotations

from moecc.frontend.families.deepseek_v2 import DEEPSEEK_FIELDS
from moecc.frontend.families.family import Family

FAMILY = Family(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    experts="n_routed_experts",
    required=(*DEEPSEEK_FIELDS, "n_group", "topk_group"),
    optional=("num_key_value_heads", "q_lora_rank"),
    mla=True,
    groups="always",
    tiny={
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "max_position_embeddings": 512,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    },
    # deepseek-v3 (671B): tests/compiler/test_deepseek_plan.py
)
