"""Qwen3-MoE (Qwen3MoeForCausalLM): per-head q/k RMS norms, renormalised top-k, dense MLP
layers where mlp_only_layers / decoder_sparse_step say."""

from __future__ import annotations

from moecc.frontend.families.family import Family

FAMILY = Family(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    experts="num_experts",
    required=("moe_intermediate_size", "intermediate_size", "decoder_sparse_step"),
    tiny={
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 48,
        "num_hidden_layers": 3,
        "mlp_only_layers": [1],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "max_position_embeddings": 512,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    },
    published={"qwen3-30b-a3b": 30.5e9, "qwen3-235b-a22b": 235e9},
)
