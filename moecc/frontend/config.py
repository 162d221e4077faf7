"""Config reading: the checkpoint's config.json as transformers' config object, checked
against what moecc supports, and the model facts the graph carries (`ModelInfo`).

Needs: a read checkpoint (moecc/frontend/checkpoint.py).
Does: `load_config` refuses unsupported architectures and rope types by name;
`model_info` reads sizes, dtype (the weights' own when they have one), EOS ids, MLA widths.
Guarantees: plain data only; nothing is traced or built here.
"""

from __future__ import annotations

from typing import Any

import torch

from moecc.errors import CheckpointError, UnsupportedModelError
from moecc.frontend.checkpoint import Checkpoint
from moecc.ir.graph import ModelInfo

SUPPORTED_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
                           "OlmoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM")
_ARCH_BY_MODEL_TYPE = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                       "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                       "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                       "gpt_oss": "GptOssForCausalLM"}
_STATIC_ROPE = ("default", "linear", "yarn", "llama3")


def _dtype_name(dt: Any) -> str:
    if isinstance(dt, torch.dtype):
        return str(dt).removeprefix("torch.")
    if isinstance(dt, str) and dt not in ("auto", ""):
        return dt
    return "float32"


def load_config(ckpt: Checkpoint):
    """transformers' config object for the checkpoint, checked against what moecc supports."""
    model_type = ckpt.config.get("model_type")
    archs = ckpt.config.get("architectures") or [_ARCH_BY_MODEL_TYPE.get(model_type, model_type)]
    if not model_type:
        raise CheckpointError(
            f"{ckpt.directory}/config.json: no 'architectures' or 'model_type'; is this a "
            f"transformers causal-LM checkpoint?"
        )
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{ckpt.directory}: architecture {archs[0]} is not supported yet; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(ckpt.directory), local_files_only=True)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in _STATIC_ROPE:
        raise UnsupportedModelError(
            f"{ckpt.directory}: rope_type {rope.get('rope_type')!r} is not supported yet; "
            f"supported: {', '.join(_STATIC_ROPE)}"
        )
    return config


def model_info(ckpt: Checkpoint, config) -> ModelInfo:
    arch = (config.architectures or [_ARCH_BY_MODEL_TYPE[config.model_type]])[0]
    eos = config.eos_token_id
    gen = ckpt.directory / "generation_config.json"
    if gen.is_file():
        import json

        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = _dtype_name(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
    if ckpt.has_weights:  # the weights decide: a config may say bfloat16 for an fp32 file
        dtypes = {loc.dtype for loc in ckpt.tensors.values()}
        if len(dtypes) == 1:
            dtype = dtypes.pop()
    extra: dict[str, Any] = {"hidden_act": config.hidden_act,
                             "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False))}
    if getattr(config, "kv_lora_rank", None):
        extra["mla"] = {k: getattr(config, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                        "qk_rope_head_dim", "v_head_dim")}
        head_dim = config.qk_rope_head_dim  # the rotary table's width
    return ModelInfo(
        architecture=arch,
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        num_experts=num_experts,
        top_k=config.num_experts_per_tok,
        dtype=dtype,
        max_position_embeddings=config.max_position_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_ids=eos_ids,
        pad_token_id=getattr(config, "pad_token_id", None),
        extra=extra,
    )

