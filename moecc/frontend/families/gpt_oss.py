"""gpt-oss (GptOssForCausalLM): attention sinks, sliding and full layers (layer_types),
biases in attention, router and experts, transposed interleaved experts with a clamped
SwiGLU, YaRN rope; published in bf16 or MXFP4 (quant_method mxfp4, its experts only)."""

from __future__ import annotations

from moecc.frontend.families.family import Family

FAMILY = Family(
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    experts="num_local_experts",
    required=("intermediate_size",),
    optional=("num_key_value_heads", "head_dim", "sliding_window"),
    quant_methods=("mxfp4",),
    # window 8 (shorter than most test prompts), a SwiGLU clamp low enough to bite
    tiny={
        "hidden_size": 64,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "swiglu_limit": 1.0,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 150000.0},
        "max_position_embeddings": 512,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    },
    layouts=("per_expert",),  # gpt-oss publishes fused tensors only (save_pretrained writes them)
    published={"gpt-oss-20b": 20.9e9, "gpt-oss-120b": 116.8e9},
)
