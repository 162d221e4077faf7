"""Qwen2-MoE (Qwen2MoeForCausalLM): a shared expert gated by a sigmoid, q/k/v biases,
top-k weights not renormalised."""

from __future__ import annotations

from moecc.frontend.families.family import Family

FAMILY = Family(
    model_type="qwen2_moe",
    architecture="Qwen2MoeForCausalLM",
    experts="num_experts",
    required=("moe_intermediate_size", "intermediate_size", "shared_expert_intermediate_size",
              "decoder_sparse_step"),
    tiny={
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 80,
        "num_hidden_layers": 3,
        "mlp_only_layers": [1],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "max_position_embeddings": 512,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    },
)
