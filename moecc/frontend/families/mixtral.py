"""Mixtral (MixtralForCausalLM): top-2 of 8 softmax routing, published per-expert tensors
under `block_sparse_moe` (w1/w3/w2), an optional sliding window."""

from __future__ import annotations

from moecc.frontend.families.family import Family

FAMILY = Family(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    experts="num_local_experts",
    required=("intermediate_size",),
    optional=("num_key_value_heads", "head_dim", "sliding_window"),
    path_aliases=((".mlp.", ".block_sparse_moe."),),
    tiny={
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 512,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    },
    # mixtral-8x22b: tests/compiler/test_frontend.py
    published={"mixtral-8x7b": 46.7e9},
)
