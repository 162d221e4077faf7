"""Config reading: the checkpoint's config.json as transformers' config object, checked
against what moecc supports, and the model facts the graph carries (`ModelInfo`).

Needs: a read checkpoint (moecc/frontend/checkpoint.py).
Does: `load_config` checks every field moecc reads (type, range, consistency:
moecc/frontend/config_checks.py), then lets transformers parse it, and refuses
unsupported architectures, rope types and quantization methods by name
(moecc/frontend/quantization.py); `model_info` reads sizes, the compute dtype
(`compute_dtype`), EOS ids, MLA widths, the quantization.
Guarantees: plain data only; nothing is traced or built here. A bad config fails with a
ConfigError (a CheckpointError) naming the file and the field, never a raw exception.
"""

from __future__ import annotations

from typing import Any

import torch

from moecc.errors import CheckpointError, UnsupportedModelError
from moecc.frontend.checkpoint import Checkpoint, read_json_object
from moecc.frontend.config_checks import _check_positive, _check_token_id, _show, check_config, check_raw_config
from moecc.frontend.families import FAMILIES
from moecc.frontend.quantization import _QUANT, QUANT_METHODS, Quantization, quantization  # noqa: F401 (re-exported)
from moecc.ir.graph import FLOAT_DTYPES, ModelInfo

# the families moecc reads: moecc/frontend/families/
SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES)
_ARCH_BY_MODEL_TYPE = {f.model_type: f.architecture for f in FAMILIES}
_STATIC_ROPE = ("default", "linear", "yarn", "llama3")


# -- loading --------------------------------------------------------------------------------
def _dtype_name(dt: Any) -> str:
    if isinstance(dt, torch.dtype):
        return str(dt).removeprefix("torch.")
    if isinstance(dt, str) and dt not in ("auto", ""):
        return dt.removeprefix("torch.")
    return "float32"


def _parse_config(ckpt: Checkpoint, path: str) -> Any:
    """transformers' config object; what its parsers raise becomes a CheckpointError naming the file."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(ckpt.directory), local_files_only=True)
    except (ValueError, TypeError, KeyError, AttributeError, StrictDataclassError) as e:
        raise CheckpointError(f"{path}: transformers cannot read it: {type(e).__name__}: "
                              f"{' '.join(str(e).split())}") from e


def load_config(ckpt: Checkpoint):
    """needs: a read checkpoint. does: check config.json's fields (check_raw_config), parse it
    with transformers, check the result (check_config) and the rope type. guarantees:
    transformers' config object of a supported family, or a MoeccError naming what is wrong."""
    path = f"{ckpt.directory}/config.json"
    model_type = ckpt.config.get("model_type")
    check_raw_config(path, ckpt.config)
    archs = ckpt.config.get("architectures") or [_ARCH_BY_MODEL_TYPE.get(model_type, model_type)]
    if not model_type:
        raise CheckpointError(
            f"{path}: no 'architectures' or 'model_type'; is this a transformers causal-LM checkpoint?"
        )
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{ckpt.directory}: architecture {archs[0]} is not supported yet; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    quantization(ckpt)  # refuses a quantization_config moecc cannot read, naming the field
    config = _parse_config(ckpt, path)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in _STATIC_ROPE:
        raise UnsupportedModelError(
            f"{ckpt.directory}: rope_type {rope.get('rope_type')!r} is not supported yet; "
            f"supported: {', '.join(_STATIC_ROPE)}"
        )
    check_config(path, config)
    _check_activation(path, config)
    if rope.get("rope_theta") is not None:
        _check_positive(path, "rope_theta", rope["rope_theta"])
    return config


def _check_activation(path: str, config: Any) -> None:
    """The MLPs' activation is one the runtime's kernels implement."""
    from moecc_runtime.contract.activations import ACTIVATIONS

    act = getattr(config, "hidden_act", None)
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{path}: field 'hidden_act' is {_show(act)}, which moecc does not "
                                    f"implement yet; supported: {', '.join(ACTIVATIONS)}")


def compute_dtype(ckpt: Checkpoint, config: Any) -> str:
    """The dtype moecc computes in. needs: the checkpoint and its parsed config.
    guarantees: the dtype `from_pretrained(dir)` (default dtype="auto") loads the model in --
    config.json's dtype / torch_dtype, else that of the first floating tensor (by name) of the
    first weight file -- except that weights all of one floating dtype are computed in it
    (read in place; transformers would cast every weight to config's dtype). Weights of
    another dtype are cast when the runtime reads them (moecc_runtime/memory/weights.py).
    A quantized checkpoint (quantization_config) computes in config.json's dtype (bf16 for
    the FP8 and MXFP4 releases; bfloat16 when it names none or a non-floating one), never its
    stored fp8 or uint8 blocks: the runtime dequantizes into it."""
    configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if ckpt.config.get(_QUANT) is not None:  # quantized: config's dtype (never the stored fp8 / uint8)
        name = _dtype_name(configured) if configured is not None else "bfloat16"
        return name if name in FLOAT_DTYPES else "bfloat16"
    floats = {loc.dtype for loc in ckpt.tensors.values() if loc.dtype in FLOAT_DTYPES}
    if len(floats) == 1:
        return floats.pop()
    if configured is not None or not floats:
        return _dtype_name(configured)
    first = ckpt.headers[min(ckpt.headers)].tensors
    return next((first[n].dtype for n in sorted(first) if first[n].dtype in FLOAT_DTYPES), "float32")


def _eos_ids(ckpt: Checkpoint, config: Any) -> list[int]:
    """EOS ids: generation_config.json's when it names them (checked like config.json's), else config's."""
    eos = config.eos_token_id
    gen = ckpt.directory / "generation_config.json"
    if gen.is_file():
        data = read_json_object(gen)
        if "eos_token_id" in data:
            _check_token_id(str(gen), "eos_token_id", data["eos_token_id"], config.vocab_size)
        eos = data.get("eos_token_id", eos)
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def model_info(ckpt: Checkpoint, config) -> ModelInfo:
    """needs: a config load_config returned. guarantees: the model facts the graph carries."""
    arch = (config.architectures or [_ARCH_BY_MODEL_TYPE[config.model_type]])[0]
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    extra: dict[str, Any] = {"hidden_act": config.hidden_act,
                             "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False))}
    if getattr(config, "kv_lora_rank", None):
        extra["mla"] = {k: getattr(config, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                        "qk_rope_head_dim", "v_head_dim")}
        head_dim = config.qk_rope_head_dim  # the rotary table's width
    quant = quantization(ckpt)
    if quant is not None:
        extra["quantization"] = {"method": quant.method, "format": quant.format, "block": list(quant.block)}
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
        dtype=compute_dtype(ckpt, config),
        max_position_embeddings=config.max_position_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_ids=_eos_ids(ckpt, config),
        pad_token_id=getattr(config, "pad_token_id", None),
        extra=extra,
    )
