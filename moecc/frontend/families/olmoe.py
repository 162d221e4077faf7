"""OLMoE (OlmoeForCausalLM): q/k RMS norms over the whole projection (not per head),
q/k/v clipping (clip_qkv)."""

from __future__ import annotations

from moecc.frontend.families.family import Family

FAMILY = Family(
    model_type="olmoe",
    architecture="OlmoeForCausalLM",
    experts="num_experts",
    required=("intermediate_size",),
    tiny={
        "hidden_size": 64,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "clip_qkv": 0.5,
        "max_position_embeddings": 512,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    },
    published={"olmoe-1b-7b": 6.9e9},
)
