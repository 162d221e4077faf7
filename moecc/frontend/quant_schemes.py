"""The integer and FP4 quantization methods of published checkpoints, as moecc reads their
config (`quantization_config`, or ModelOpt's hf_quant_config.json): GPTQ, AWQ (GEMM),
compressed-tensors (pack-quantized, naive-/int-quantized, float-quantized) and ModelOpt
NVFP4. Each becomes a Quantization whose `schemes` say, per Linear module, how it is stored
(a LinearScheme: the runtime format of runtime/formats/ and its facts); quant_linear.py
finds the stored tensors.

Needs: config.json's quantization_config (a dict). Does: check its fields. Guarantees: a
Quantization, or an UnsupportedModelError / ConfigError naming config.json, the field and
what moecc reads.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

from moecc.errors import ConfigError, UnsupportedModelError
from moecc.frontend.config_checks import _is_int, _show

_QUANT = "quantization_config"


@dataclass(frozen=True)
class LinearScheme:
    """How a quantized Linear is stored: `format` (runtime/formats/ NAME), `bits`, `group`
    (input columns per scale; 0: one scale per output channel, -1: one group, GPTQ),
    `symmetric`, and the format's other facts `attrs` (plain data, into the plan)."""

    format: str
    bits: int
    group: int
    symmetric: bool = True
    attrs: tuple[tuple[str, Any], ...] = ()


def _field(path: str, q: dict, name: str, ok, want: str, default: Any = None) -> Any:
    """q[name] (or `default` when absent), refused naming the field unless ok(value)."""
    v = q.get(name, default)
    if not ok(v):
        raise ConfigError(path, f"{_QUANT}.{name}", f"is {_show(v)}; it must be {want}")
    return v


def _bits(path: str, q: dict, name: str = "bits", method: str = "") -> int:
    bits = _field(path, q, name, _is_int, "an integer number of bits")
    if bits not in (4, 8):
        raise UnsupportedModelError(f"{path}: field '{_QUANT}.{name}' is {_show(bits)}; moecc reads {method} "
                                    f"weights of 4 or 8 bits only")
    return int(bits)


def _group(path: str, q: dict, name: str = "group_size") -> int:
    return int(_field(path, q, name, lambda v: _is_int(v) and (v == -1 or v >= 1),
                      "a positive number of input columns, or -1 (one group per row)", 128))


def gptq_scheme(path: str, q: dict) -> tuple[LinearScheme, tuple[str, ...]]:
    """GPTQ (AutoGPTQ, GPTQModel, optimum): bits 4 or 8, group_size (-1: per row), desc_act
    (activation order: g_idx read), sym, checkpoint_format gptq (v1: zeros stored minus 1,
    the default) or gptq_v2; modules_to_not_convert kept dense."""
    bits, group = _bits(path, q, method="GPTQ"), _group(path, q)
    desc = _field(path, q, "desc_act", lambda v: isinstance(v, bool), "true or false", False)
    sym = _field(path, q, "sym", lambda v: isinstance(v, bool), "true or false", True)
    fmt = q.get("checkpoint_format", q.get("format", "gptq")) or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedModelError(f"{path}: field '{_QUANT}.checkpoint_format' is {_show(fmt)}; moecc reads "
                                    f"GPTQ files as gptq (v1) or gptq_v2 write them (convert a marlin/bitblas "
                                    f"repack back with GPTQModel)")
    attrs = (("bits", bits), ("group", group), ("zero_offset", 1 if fmt == "gptq" else 0), ("desc_act", desc))
    return LinearScheme("gptq", bits, group, sym, attrs), _names(path, q, "modules_to_not_convert")


def awq_scheme(path: str, q: dict) -> tuple[LinearScheme, tuple[str, ...]]:
    """AutoAWQ's GEMM layout: 4 bits, group_size, zero_point true; modules_to_not_convert dense."""
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedModelError(f"{path}: field '{_QUANT}.version' is {_show(q.get('version'))}; moecc reads "
                                    f"AutoAWQ's gemm layout only (gemv / exllama / marlin repacks: re-export as gemm)")
    bits = _bits(path, q, "bits" if "bits" in q else "w_bit", "AWQ")
    if bits != 4:
        raise UnsupportedModelError(f"{path}: field '{_QUANT}.bits' is {bits}; AutoAWQ's gemm layout is 4-bit")
    group = _group(path, q, "group_size" if "group_size" in q else "q_group_size")
    if not q.get("zero_point", True):
        raise UnsupportedModelError(f"{path}: field '{_QUANT}.zero_point' is false; moecc reads AWQ gemm files "
                                    f"with zero points (zero_point: true), as AutoAWQ writes them")
    return LinearScheme("awq_gemm", 4, group, False, (("bits", 4), ("group", group))), \
        _names(path, q, "modules_to_not_convert")


def nvfp4_scheme(path: str, q: dict) -> tuple[LinearScheme, tuple[str, ...]]:
    """ModelOpt NVFP4: E2M1 weights, an e4m3 scale per 16 columns, an fp32 global scale;
    exclude_modules (config.json: ignore) kept dense."""
    algo = q.get("quant_algo")
    if algo != "NVFP4":
        raise UnsupportedModelError(f"{path}: field '{_QUANT}.quant_algo' is {_show(algo)}; moecc reads ModelOpt "
                                    f"checkpoints of quant_algo NVFP4 only")
    group = q.get("group_size", 16)
    if group != 16:
        raise UnsupportedModelError(f"{path}: field '{_QUANT}.group_size' is {_show(group)}; NVFP4 scales "
                                    f"groups of 16")
    key = "exclude_modules" if "exclude_modules" in q else "ignore"
    return LinearScheme("nvfp4", 4, 16, True, ()), _names(path, q, key)


def _names(path: str, q: dict, key: str) -> tuple[str, ...]:
    names = q.get(key) or []
    if not (isinstance(names, list) and all(isinstance(m, str) for m in names)):
        raise ConfigError(path, f"{_QUANT}.{key}", f"is {_show(names)}; it must be a list of module names (or null)")
    return tuple(names)


def fnmatch_module(module: str, patterns: tuple[str, ...]) -> bool:
    """ModelOpt's exclude_modules: shell wildcards over module names ("model.layers.*.self_attn*")."""
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


# -- compressed-tensors ----------------------------------------------------------------------
_CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized")


def ct_match(name: str, target: str) -> bool:
    """compressed-tensors' match_name: "re:<regex>" matched from the start, else the exact
    name; the class targets "Linear" / "LinearBase" match every Linear moecc quantizes."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target in ("Linear", "LinearBase")


def ct_rank(name: str, targets: tuple[str, ...]) -> int | None:
    """How specifically `targets` match module `name` (0 exact name, 1 regex, 2 class; None:
    no match): the library merges groups most specific first (match_targets)."""
    ranks = [0 if t == name else 1 if t.startswith("re:") else 2 for t in targets if ct_match(name, t)]
    return min(ranks) if ranks else None


def ct_schemes(path: str, q: dict) -> tuple[tuple[tuple[tuple[str, ...], LinearScheme], ...], tuple[str, ...]]:
    """compressed-tensors: each config group's targets and weight scheme; the ignore list."""
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(path, f"{_QUANT}.config_groups", f"is {_show(groups)}; it must be an object of groups, "
                                                            f"each with targets and weights")
    if q.get("sparsity_config") or q.get("transform_config"):
        raise UnsupportedModelError(f"{path}: field '{_QUANT}.sparsity_config' / 'transform_config' is set; moecc "
                                    f"reads dense compressed-tensors weights only")
    out = []
    for gname, grp in groups.items():
        where = f"{_QUANT}.config_groups.{gname}"
        if not isinstance(grp, dict):
            raise ConfigError(path, where, f"is {_show(grp)}; it must be an object with targets and weights")
        targets = grp.get("targets")
        if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
            raise ConfigError(path, f"{where}.targets", f"is {_show(targets)}; it must be a list of module names")
        if grp.get("weights") is None:
            continue  # activations only: the weights stay as stored (dense)
        fmt = grp.get("format") or q.get("format")
        out.append((tuple(targets), _ct_weights(path, where, fmt, grp["weights"])))
    return tuple(out), tuple(_names(path, q, "ignore"))


def _ct_weights(path: str, where: str, fmt: Any, w: Any) -> LinearScheme:
    """One config group's `weights` (QuantizationArgs) in format `fmt` as a LinearScheme."""
    if fmt not in _CT_FORMATS:
        raise UnsupportedModelError(f"{path}: field '{where}.format' (or '{_QUANT}.format') is {_show(fmt)}; "
                                    f"moecc reads compressed-tensors formats {', '.join(_CT_FORMATS)}")
    if not isinstance(w, dict):
        raise ConfigError(path, f"{where}.weights", f"is {_show(w)}; it must be an object (num_bits, type, ...)")
    kind, bits = w.get("type", "int"), w.get("num_bits", 8)
    strategy, sym = w.get("strategy", "tensor"), w.get("symmetric", True)
    group = w.get("group_size") if strategy == "group" else 0
    if strategy == "group" and not (_is_int(group) and group >= 1):
        raise ConfigError(path, f"{where}.weights.group_size", f"is {_show(group)}; strategy group needs a "
                                                               f"positive group size")
    if w.get("dynamic") not in (None, False):
        raise UnsupportedModelError(f"{path}: field '{where}.weights.dynamic' is {_show(w.get('dynamic'))}; "
                                    f"moecc reads statically quantized weights")
    attrs = (("bits", bits), ("group", group))
    if fmt == "pack-quantized" and kind == "int" and bits in (4, 8) and strategy in ("group", "channel"):
        return LinearScheme("ct_packed", bits, group, bool(sym), attrs)
    naive_int = fmt in ("naive-quantized", "int-quantized") and kind == "int" and bits == 8
    fp8 = fmt in ("float-quantized", "naive-quantized") and kind == "float" and bits == 8 and sym
    if (naive_int or fp8) and strategy in ("tensor", "channel", "group"):
        return LinearScheme("ct_naive", 8, group, bool(sym), attrs + (("type", kind),))
    raise UnsupportedModelError(
        f"{path}: field '{where}.weights' is {{type {kind}, num_bits {bits}, strategy {strategy}}} in format "
        f"{fmt}; moecc reads pack-quantized int4/int8 (group or channel), naive-quantized int8 and "
        f"float-quantized fp8 (tensor or channel)")
