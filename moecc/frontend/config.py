"""Config reading: the checkpoint's config.json as transformers' config object, checked
against what moecc supports, and the model facts the graph carries (`ModelInfo`).

Needs: a read checkpoint (moecc/frontend/checkpoint.py).
Does: `load_config` checks every field moecc reads (type, range, consistency: see
`check_raw_config` and `check_config`), then lets transformers parse it, and refuses
unsupported architectures, rope types and quantization methods by name (`quantization`:
the readers in QUANT_METHODS); `model_info` reads sizes, the compute dtype
(`compute_dtype`), EOS ids, MLA widths, the quantization.
Guarantees: plain data only; nothing is traced or built here. A bad config fails with a
ConfigError (a CheckpointError) naming the file and the field, never a raw exception.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from moecc.errors import CheckpointError, ConfigError, UnsupportedModelError
from moecc.frontend.checkpoint import Checkpoint, read_json_object
from moecc.ir.graph import ModelInfo

SUPPORTED_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
                           "OlmoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM")
_ARCH_BY_MODEL_TYPE = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                       "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                       "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                       "gpt_oss": "GptOssForCausalLM"}
_STATIC_ROPE = ("default", "linear", "yarn", "llama3")


# -- the fields moecc reads, per family ----------------------------------------------------
#: integer field -> the least value it may take
_INT_MIN: dict[str, int] = {
    "num_hidden_layers": 1, "hidden_size": 1, "vocab_size": 1, "num_attention_heads": 1,
    "num_key_value_heads": 1, "head_dim": 1, "intermediate_size": 1, "moe_intermediate_size": 1,
    "shared_expert_intermediate_size": 1, "num_local_experts": 1, "num_experts": 1, "n_routed_experts": 1,
    "num_experts_per_tok": 1, "max_position_embeddings": 2, "decoder_sparse_step": 1, "n_shared_experts": 1,
    "first_k_dense_replace": 0, "q_lora_rank": 1, "kv_lora_rank": 1, "qk_rope_head_dim": 1,
    "qk_nope_head_dim": 1, "v_head_dim": 1, "n_group": 1, "topk_group": 1, "sliding_window": 1,
}
_COMMON = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "max_position_embeddings",
           "num_experts_per_tok")
_MLA = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class _Family:
    """What one family reads from its config: `experts` counts the routed experts,
    `required` integers must be present (transformers' default counts) and never null,
    `optional` ones may be null; `mla`: latent attention (no head_dim of its own);
    `groups`: when n_group/topk_group limit routing ("always", a topk_method, or "")."""

    experts: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ("num_key_value_heads", "head_dim")
    mla: bool = False
    groups: str = ""


_DEEPSEEK = ("moe_intermediate_size", "intermediate_size", "n_shared_experts", "first_k_dense_replace", *_MLA)
_FAMILIES: dict[str, _Family] = {
    "mixtral": _Family("num_local_experts", ("intermediate_size",),
                       ("num_key_value_heads", "head_dim", "sliding_window")),
    "qwen3_moe": _Family("num_experts", ("moe_intermediate_size", "intermediate_size", "decoder_sparse_step")),
    "qwen2_moe": _Family("num_experts", ("moe_intermediate_size", "intermediate_size",
                                         "shared_expert_intermediate_size", "decoder_sparse_step")),
    "olmoe": _Family("num_experts", ("intermediate_size",)),
    "deepseek_v2": _Family("n_routed_experts", _DEEPSEEK, ("num_key_value_heads", "q_lora_rank", "n_group",
                                                            "topk_group"), mla=True, groups="group_limited_greedy"),
    "deepseek_v3": _Family("n_routed_experts", (*_DEEPSEEK, "n_group", "topk_group"),
                           ("num_key_value_heads", "q_lora_rank"), mla=True, groups="always"),
    "gpt_oss": _Family("num_local_experts", ("intermediate_size",),
                       ("num_key_value_heads", "head_dim", "sliding_window")),
}
_KIND = {bool: "a boolean", str: "a string", float: "a floating-point number", list: "a list", dict: "an object"}


def _show(v: Any) -> str:
    """`v` as config.json spells it (true, null, "64", 2.5, NaN)."""
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_int(path: str, name: str, v: Any, least: int, nullable: bool) -> None:
    """needs: the value `v` of integer field `name`. guarantees: ConfigError unless `v` is an
    integer >= `least` (or null, where `nullable`)."""
    if v is None:
        if not nullable:
            raise ConfigError(path, name, f"is null; it must be an integer of at least {least}")
        return
    if not _is_int(v):
        kind = _KIND.get(type(v), type(v).__name__)
        raise ConfigError(path, name, f"is {_show(v)} ({kind}); it must be an integer of at least {least}")
    if v < least:
        raise ConfigError(path, name, f"is {v}; it must be at least {least}")


def _check_positive(path: str, name: str, v: Any) -> None:
    """A real-valued field (rms_norm_eps, rope_theta, a rope factor): a finite number > 0."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        kind = _KIND.get(type(v), type(v).__name__)
        raise ConfigError(path, name, f"is {_show(v)} ({kind}); it must be a finite number greater than 0")
    if not math.isfinite(v) or v <= 0:
        raise ConfigError(path, name, f"is {_show(v)}; it must be a finite number greater than 0")


def _check_token_id(path: str, name: str, v: Any, vocab: int | None) -> None:
    """A token id field: null, an id in [0, vocab), or (eos_token_id) a list of such ids."""
    ids = v if name == "eos_token_id" and isinstance(v, list) else [v]
    for t in ids:
        if t is None and v is None:
            return
        if not _is_int(t):
            kind = _KIND.get(type(t), type(t).__name__)
            what = "a token id, a list of token ids or null" if name == "eos_token_id" else "a token id or null"
            raise ConfigError(path, name, f"is {_show(v)} ({kind}); it must be {what}")
        if t < 0 or (vocab is not None and t >= vocab):
            bound = f"between 0 and {vocab - 1} (vocab_size is {vocab})" if vocab is not None else "at least 0"
            raise ConfigError(path, name, f"is {_show(v)}; a token id must be {bound}")


def _family(raw: dict) -> _Family | None:
    model_type = raw.get("model_type")
    return _FAMILIES.get(model_type) if isinstance(model_type, str) else None


def check_raw_config(path: str, raw: dict) -> None:
    """needs: config.json as parsed (`path` names it in messages). does: check the type and
    range of every field moecc reads that the file sets, before transformers parses it (whose
    own checks raise raw exceptions). guarantees: ConfigError naming the first bad field."""
    fam = _family(raw)
    if raw.get("model_type") is not None and not isinstance(raw["model_type"], str):
        raise ConfigError(path, "model_type", f"is {_show(raw['model_type'])}; it must be a string such as "
                                              f"\"mixtral\"")
    if "architectures" in raw and not (isinstance(raw["architectures"], list)
                                       and all(isinstance(a, str) for a in raw["architectures"])):
        raise ConfigError(path, "architectures", f"is {_show(raw['architectures'])}; it must be a list of "
                                                 f"class names such as [\"MixtralForCausalLM\"]")
    if fam is None:
        return
    for name in (*_COMMON, fam.experts, *fam.required, *fam.optional):
        if name in raw:
            _check_int(path, name, raw[name], _INT_MIN[name], nullable=name in fam.optional)
    rotary = "qk_rope_head_dim" if fam.mla else "head_dim"
    if _is_int(raw.get(rotary)):
        _check_rotary(path, rotary, raw[rotary])
    if "rms_norm_eps" in raw:
        _check_positive(path, "rms_norm_eps", raw["rms_norm_eps"])
    if "rope_theta" in raw:
        _check_positive(path, "rope_theta", raw["rope_theta"])
    for key in ("rope_parameters", "rope_scaling"):
        _check_rope_dict(path, key, raw.get(key))
    vocab = raw.get("vocab_size")
    for name in _TOKEN_IDS:
        if name in raw:
            _check_token_id(path, name, raw[name], vocab if _is_int(vocab) else None)


def _check_rope_dict(path: str, key: str, rope: Any) -> None:
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise ConfigError(path, key, f"is {_show(rope)}; it must be an object (or null)")
    for name in ("rope_theta", "factor"):
        if rope.get(name) is not None:
            _check_positive(path, f"{key}.{name}", rope[name])


def check_config(path: str, config: Any) -> None:
    """needs: transformers' config object of a supported family (defaults filled in).
    does: check every integer field moecc reads (present, an integer, in range) and how
    fields relate (heads, head width, experts per token, expert groups, token ids).
    guarantees: ConfigError naming the first bad field; nothing else raises."""
    fam = _FAMILIES.get(config.model_type)
    if fam is None:
        return
    get: Callable[[str], Any] = lambda name: getattr(config, name, None)  # noqa: E731
    for name in (*_COMMON, fam.experts, *fam.required):
        _check_int(path, name, get(name), _INT_MIN[name], nullable=False)
    for name in fam.optional:
        _check_int(path, name, get(name), _INT_MIN[name], nullable=True)
    _check_positive(path, "rms_norm_eps", get("rms_norm_eps"))
    _check_heads(path, get, fam)
    _check_top_k(path, get, fam)
    if fam.groups == "always" or (fam.groups and get("topk_method") == fam.groups):
        _check_groups(path, get, fam)
    for name in _TOKEN_IDS:
        _check_token_id(path, name, get(name), get("vocab_size"))


def _check_heads(path: str, get: Callable[[str], Any], fam: _Family) -> None:
    """Key-value heads divide query heads; the head width is known and even (rotary pairs)."""
    heads, kv = get("num_attention_heads"), get("num_key_value_heads") or get("num_attention_heads")
    if heads % kv:
        raise ConfigError(path, "num_key_value_heads", f"is {kv} but num_attention_heads is {heads}; "
                                                       f"it must divide num_attention_heads")
    if fam.mla:
        width, name = get("qk_rope_head_dim"), "qk_rope_head_dim"
    elif get("head_dim") is None:  # derived, as transformers derives it
        hidden = get("hidden_size")
        if hidden % heads:
            raise ConfigError(path, "hidden_size", f"is {hidden} but num_attention_heads is {heads}; with no "
                                                   f"head_dim it must be a multiple of num_attention_heads")
        width, name = hidden // heads, "hidden_size"
    else:
        width, name = get("head_dim"), "head_dim"
    _check_rotary(path, name, width)


def _check_rotary(path: str, name: str, width: int) -> None:
    if width % 2:
        raise ConfigError(path, name, f"gives a rotary width of {width}; rotary embeddings need an even width")


def _check_top_k(path: str, get: Callable[[str], Any], fam: _Family) -> None:
    k, n = get("num_experts_per_tok"), get(fam.experts)
    if k > n:
        raise ConfigError(path, "num_experts_per_tok", f"is {k} but the model has {n} experts ({fam.experts}); "
                                                       f"it must be between 1 and {n}")


def _check_groups(path: str, get: Callable[[str], Any], fam: _Family) -> None:
    """DeepSeek's group-limited routing: the experts split into n_group equal groups (of at
    least two with V3's sigmoid scores, which sum each group's best two), topk_group of them
    compete, and they hold at least num_experts_per_tok experts."""
    n, k = get(fam.experts), get("num_experts_per_tok")
    for name in ("n_group", "topk_group"):
        _check_int(path, name, get(name), _INT_MIN[name], nullable=False)
    groups, top = get("n_group"), get("topk_group")
    if n % groups:
        raise ConfigError(path, "n_group", f"is {groups} but the {n} experts ({fam.experts}) do not split into "
                                           f"{groups} equal groups; it must divide {fam.experts}")
    if top > groups:
        raise ConfigError(path, "topk_group", f"is {top} but there are {groups} expert groups (n_group); "
                                              f"it must be between 1 and {groups}")
    if fam.groups == "always" and n // groups < 2:
        raise ConfigError(path, "n_group", f"is {groups}, which leaves {n // groups} expert per group; a group "
                                           f"is scored by its best two experts, so it must be at most {n // 2}")
    if k > top * (n // groups):
        raise ConfigError(path, "num_experts_per_tok", f"is {k} but only {top * (n // groups)} experts compete "
                                                       f"(topk_group {top} of n_group {groups} groups of "
                                                       f"{n // groups}); it must be at most {top * (n // groups)}")


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
    from moecc_runtime.worker.kernels import ACTIVATIONS

    act = getattr(config, "hidden_act", None)
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{path}: field 'hidden_act' is {_show(act)}, which moecc does not "
                                    f"implement yet; supported: {', '.join(ACTIVATIONS)}")


# -- quantized checkpoints -----------------------------------------------------------------
@dataclass(frozen=True)
class Quantization:
    """A checkpoint's `quantization_config` as moecc reads it: weight-only (the runtime
    dequantizes each weight next to its GEMM; activations stay in the compute dtype).

    `method`: quant_method as config.json spells it; `format`: the runtime's stored format
    (runtime/formats/) its quantized weights get; `data_dtype`: their stored dtype; `block`:
    [rows, columns] of one scale block (mxfp4: [1, 32] along each stored row); `skip`:
    modules_to_not_convert (kept dense)."""

    method: str
    format: str
    data_dtype: str
    block: tuple[int, int]
    skip: tuple[str, ...] = ()

    def skips(self, name: str) -> bool:
        """Whether tensor `name` belongs to a module the config keeps unquantized, matched as
        transformers' should_convert_module matches modules_to_not_convert: each entry a
        regex from the start up to a module boundary ("model.layers.*.self_attn" matches
        "model.layers.3.self_attn"), or a suffix ("lm_head")."""
        module = name.rsplit(".", 1)[0]
        return any(re.match(rf"(?:{m}){_BOUNDARY}", module) or module.endswith(m) for m in self.skip)


_QUANT = "quantization_config"
_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"  # a module-name boundary (transformers' should_convert_module)
_FP8_FMTS = {"e4m3": "float8_e4m3fn"}  # fmt -> the data dtype (e5m2 is not published for weights)


def _fp8_scheme(path: str, q: dict) -> Quantization:
    """Fine-grained FP8 (DeepSeek-V3/R1, the Qwen3 FP8 releases): e4m3 data, one scale per
    weight_block_size block, dynamic activation scales (unused: moecc computes W8A16)."""
    fmt = q.get("fmt", "e4m3")
    if fmt not in _FP8_FMTS:
        raise UnsupportedModelError(f"{path}: field '{_QUANT}.fmt' is {_show(fmt)}; moecc reads fp8 weights in "
                                    f"{', '.join(_FP8_FMTS)} only")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise UnsupportedModelError(f"{path}: field '{_QUANT}.activation_scheme' is {_show(scheme)}; moecc reads "
                                    f"fp8 checkpoints with dynamic activation scales only (it computes "
                                    f"weight-only, activations in the compute dtype)")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(_is_int(b) and b >= 1 for b in block)):
        raise ConfigError(path, f"{_QUANT}.weight_block_size", f"is {_show(block)}; it must be two positive "
                                                                f"integers [rows, columns], e.g. [128, 128] "
                                                                f"(per-tensor fp8 scales are not read yet)")
    return Quantization("fp8", "fp8_block", _FP8_FMTS[fmt], (block[0], block[1]), _skip_list(path, q))


def _skip_list(path: str, q: dict) -> tuple[str, ...]:
    """modules_to_not_convert: module names or patterns (transformers reads them as regexes)."""
    skip = q.get("modules_to_not_convert") or []
    field = f"{_QUANT}.modules_to_not_convert"
    if not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
        raise ConfigError(path, field, f"is {_show(skip)}; it must be a list of module names (or null)")
    for m in skip:
        try:
            re.compile(m)
        except re.error as e:
            raise ConfigError(path, field, f"has {_show(m)}, which is not a module name or pattern "
                                           f"transformers can match ({e}); e.g. \"model.layers.*.self_attn\"") from e
    return tuple(skip)


def _mxfp4_scheme(path: str, q: dict) -> Quantization:
    """MXFP4 as gpt-oss publishes it: the routed experts' weights as E2M1 values in groups of
    32 along each stored row (the module's input dimension), one E8M0 scale per group
    (`*_blocks` uint8 [E, R, C/32, 16], `*_scales` uint8 [E, R, C/32]); attention, routers,
    embeddings and lm_head in bf16 (modules_to_not_convert). `dequantize` (transformers'
    switch to load it unquantized) changes nothing here: moecc always dequantizes at the GEMM."""
    flag = q.get("dequantize", False)
    if not isinstance(flag, bool):
        raise ConfigError(path, f"{_QUANT}.dequantize", f"is {_show(flag)}; it must be true or false")
    return Quantization("mxfp4", "mxfp4", "uint8", (1, 32), _skip_list(path, q))


#: quant_method -> its reader (config.json's quantization_config -> Quantization). A method
#: is supported when it is here and runtime/formats/ materializes its format.
QUANT_METHODS: dict[str, Callable[[str, dict], Quantization]] = {
    "fp8": _fp8_scheme,
    "mxfp4": _mxfp4_scheme,
}
#: quant_method -> the model types whose checkpoints publish it (absent: any family)
QUANT_FAMILIES: dict[str, tuple[str, ...]] = {"mxfp4": ("gpt_oss",)}
_QUANT_HELP = ("fp8: fine-grained FP8, e4m3 with weight_block_size, as DeepSeek-V3/R1 and the Qwen3 FP8 releases "
               "publish it; mxfp4: gpt-oss's MXFP4 experts, as gpt-oss-20b/120b publish them")


def quantization(ckpt: Checkpoint) -> Quantization | None:
    """needs: a read checkpoint. guarantees: None for an unquantized config.json, its
    Quantization when moecc reads the method, else an UnsupportedModelError (a method
    moecc does not read) or ConfigError (a malformed field) naming config.json, the field
    and what is supported."""
    path = f"{ckpt.directory}/config.json"
    q = ckpt.config.get(_QUANT)
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(path, _QUANT, f"is {_show(q)}; it must be an object with a quant_method (or null)")
    method = q.get("quant_method")
    reader = QUANT_METHODS.get(method) if isinstance(method, str) else None
    if reader is None:
        raise UnsupportedModelError(
            f"{path}: field '{_QUANT}.quant_method' is {_show(method)}, which moecc does not read yet; "
            f"supported: {', '.join(QUANT_METHODS)} ({_QUANT_HELP}); use a bf16 checkpoint otherwise")
    families, model_type = QUANT_FAMILIES.get(method), ckpt.config.get("model_type")
    if families is not None and model_type not in families:
        raise UnsupportedModelError(
            f"{path}: field '{_QUANT}.quant_method' is {_show(method)}, which moecc reads for model_type "
            f"{' or '.join(families)} only, not {_show(model_type)}; supported: {', '.join(QUANT_METHODS)} "
            f"({_QUANT_HELP}); use a bf16 checkpoint otherwise")
    return reader(path, q)


#: the dtypes a model can compute in (what transformers' dtype="auto" considers floating)
_FLOATS = ("float64", "float32", "float16", "bfloat16")


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
        return name if name in _FLOATS else "bfloat16"
    floats = {loc.dtype for loc in ckpt.tensors.values() if loc.dtype in _FLOATS}
    if len(floats) == 1:
        return floats.pop()
    if configured is not None or not floats:
        return _dtype_name(configured)
    first = ckpt.headers[min(ckpt.headers)].tensors
    return next((first[n].dtype for n in sorted(first) if first[n].dtype in _FLOATS), "float32")


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
