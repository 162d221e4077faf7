"""DeepSeek-V2 (DeepseekV2ForCausalLM): multi-head latent attention (full-rank q in
V2-Lite), complex-pair rope, softmax routing (greedy or limited to the top groups), scaled
and not renormalised, shared experts, dense first layers."""

from __future__ import annotations

from moecc.frontend.families.family import Family

#: the integer fields both DeepSeek families require (V3 adds n_group and topk_group)
DEEPSEEK_FIELDS: tuple[str, ...] = ("moe_intermediate_size", "intermediate_size", "n_shared_experts",
                                    "first_k_dense_replace", "kv_lora_rank", "qk_rope_head_dim",
                                    "qk_nope_head_dim", "v_head_dim")

FAMILY = Family(
    model_type="deepseek_v2",
    architecture="DeepseekV2ForCausalLM",
    experts="n_routed_experts",
    required=DEEPSEEK_FIELDS,
    optional=("num_key_value_heads", "q_lora_rank", "n_group", "topk_group"),
    mla=True,
    groups="group_limited_greedy",
    rope_interleave=True,
    tiny={
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 2,
        "num_experts_per_tok": 2,
        "topk_method": "group_limited_greedy",
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 1.5,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "max_position_embeddings": 512,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    },
    published={"deepseek-v2-lite": 15.7e9, "deepseek-v2": 236e9},
)
