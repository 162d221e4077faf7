"""config.json checked field by field: every field moecc reads, its type, range and
consistency with the others, per family; before transformers parses it (`check_raw_config`,
whose own checks would raise raw exceptions) and after (`check_config`, defaults filled in).

Needs: the parsed config.json (and transformers' config object). Does: checks only.
Guarantees: a ConfigError naming the file and the first bad field, with what it must be.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from moecc.errors import ConfigError
from moecc.frontend.families import Family, family

# -- the fields moecc reads (which ones, per family: moecc/frontend/families/) -------------
#: integer field -> the least value it may take (a family's `minima` adds its own)
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
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


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


def _least(fam: Family, name: str) -> int:
    """The least value of integer field `name`: the family's own (`minima`), else the common table's."""
    return fam.minima[name] if name in fam.minima else _INT_MIN[name]


def check_raw_config(path: str, raw: dict) -> None:
    """needs: config.json as parsed (`path` names it in messages). does: check the type and
    range of every field moecc reads that the file sets, before transformers parses it (whose
    own checks raise raw exceptions). guarantees: ConfigError naming the first bad field."""
    fam = family(raw.get("model_type"))
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
            _check_int(path, name, raw[name], _least(fam, name), nullable=name in fam.optional)
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
    fam = family(config.model_type)
    if fam is None:
        return
    get: Callable[[str], Any] = lambda name: getattr(config, name, None)  # noqa: E731
    for name in (*_COMMON, fam.experts, *fam.required):
        _check_int(path, name, get(name), _least(fam, name), nullable=False)
    for name in fam.optional:
        _check_int(path, name, get(name), _least(fam, name), nullable=True)
    _check_positive(path, "rms_norm_eps", get("rms_norm_eps"))
    _check_heads(path, get, fam)
    _check_top_k(path, get, fam)
    if fam.groups == "always" or (fam.groups and get("topk_method") == fam.groups):
        _check_groups(path, get, fam)
    for name in _TOKEN_IDS:
        _check_token_id(path, name, get(name), get("vocab_size"))


def _check_heads(path: str, get: Callable[[str], Any], fam: Family) -> None:
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


def _check_top_k(path: str, get: Callable[[str], Any], fam: Family) -> None:
    k, n = get("num_experts_per_tok"), get(fam.experts)
    if k > n:
        raise ConfigError(path, "num_experts_per_tok", f"is {k} but the model has {n} experts ({fam.experts}); "
                                                       f"it must be between 1 and {n}")


def _check_groups(path: str, get: Callable[[str], Any], fam: Family) -> None:
    """DeepSeek's group-limited routing: the experts split into n_group equal groups (of at
    least two with V3's sigmoid scores, which sum each group's best two), topk_group of them
    compete, and they hold at least num_experts_per_tok experts."""
    n, k = get(fam.experts), get("num_experts_per_tok")
    for name in ("n_group", "topk_group"):
        _check_int(path, name, get(name), _least(fam, name), nullable=False)
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
