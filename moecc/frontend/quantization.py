"""A checkpoint's `quantization_config` as moecc reads it (`quantization`): the methods it
supports (QUANT_METHODS: fp8 fine-grained, mxfp4; GPTQ, AWQ, compressed-tensors and ModelOpt
NVFP4 through moecc/frontend/quant_schemes.py), each mapped to the runtime's stored
format of its weights (runtime/formats/), and which modules stay dense.

Needs: a read checkpoint. Does: reads and checks the config's quantization block.
Guarantees: a Quantization, None for an unquantized checkpoint, or an UnsupportedModelError /
ConfigError naming config.json, the field and the supported methods.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from moecc.errors import ConfigError, UnsupportedModelError
from moecc.frontend.checkpoint import Checkpoint
from moecc_runtime.contract.formats import MXFP4_GROUP
from moecc.frontend.config_checks import _is_int, _show
from moecc.frontend.families import FAMILIES
from moecc.frontend.quant_schemes import (LinearScheme, awq_scheme, ct_match, ct_rank, ct_schemes, fnmatch_module,
                                          gptq_scheme, nvfp4_scheme)

# -- quantized checkpoints -----------------------------------------------------------------
@dataclass(frozen=True)
class Quantization:
    """A checkpoint's `quantization_config` as moecc reads it: weight-only (the runtime
    dequantizes each weight next to its GEMM; activations stay in the compute dtype).

    `method`: quant_method as config.json spells it; `format`: the runtime's stored format
    (runtime/formats/) its quantized weights get; `data_dtype`: their stored dtype; `block`:
    [rows, columns] of one scale block (mxfp4: [1, 32] along each stored row); `skip`:
    modules_to_not_convert (kept dense; compressed-tensors: `ignore`, ModelOpt:
    `exclude_modules`). Integer and FP4 methods (quant_schemes.py) also have `schemes`:
    (targets, LinearScheme) per config group, and `match`, how their module names match
    ("transformers", "ct": compressed-tensors' match_name, "fnmatch": ModelOpt's wildcards)."""

    method: str
    format: str
    data_dtype: str
    block: tuple[int, int]
    skip: tuple[str, ...] = ()
    schemes: tuple[tuple[tuple[str, ...], LinearScheme], ...] = ()
    match: str = "transformers"

    def linear_scheme(self, module: str) -> LinearScheme | None:
        """How Linear `module` (its checkpoint name, no ".weight") is stored; None: dense (an
        ignored module, one no config group targets, or a method without schemes)."""
        if not self.schemes:
            return None
        if self.match == "ct":
            if any(ct_match(module, t) for t in self.skip):
                return None
            ranked = [(r, i) for i, (targets, _) in enumerate(self.schemes)
                      if (r := ct_rank(module, targets)) is not None]
            return self.schemes[min(ranked)[1]][1] if ranked else None
        if self.match == "fnmatch":
            return None if fnmatch_module(module, self.skip) else self.schemes[0][1]
        return None if self.skips(module + ".weight") else self.schemes[0][1]

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
    return Quantization("mxfp4", "mxfp4", "uint8", (1, MXFP4_GROUP), _skip_list(path, q))


def _gptq(path: str, q: dict) -> Quantization:
    s, skip = gptq_scheme(path, q)
    return Quantization("gptq", s.format, "int32", (1, s.group), skip, (((), s),))


def _awq(path: str, q: dict) -> Quantization:
    s, skip = awq_scheme(path, q)
    return Quantization("awq", s.format, "int32", (1, s.group), skip, (((), s),))


def _nvfp4(path: str, q: dict) -> Quantization:
    s, skip = nvfp4_scheme(path, q)
    return Quantization("modelopt", s.format, "uint8", (1, 16), skip, (((), s),), match="fnmatch")


def _compressed_tensors(path: str, q: dict) -> Quantization:
    schemes, ignore = ct_schemes(path, q)
    first = schemes[0][1] if schemes else LinearScheme("dense", 16, 0)
    return Quantization("compressed-tensors", first.format, "int32" if first.format == "ct_packed" else "int8",
                        (1, first.group), ignore, schemes, match="ct")


#: quant_method -> its reader (config.json's quantization_config -> Quantization). A method
#: is supported when it is here and runtime/formats/ materializes its format.
QUANT_METHODS: dict[str, Callable[[str, dict], Quantization]] = {
    "fp8": _fp8_scheme,
    "mxfp4": _mxfp4_scheme,
    "gptq": _gptq,
    "awq": _awq,
    "compressed-tensors": _compressed_tensors,
    "modelopt": _nvfp4,
}
#: quant_method -> the model types whose checkpoints publish it (absent: any family), from each
#: family's `quant_methods` (moecc/frontend/families/)
QUANT_FAMILIES: dict[str, tuple[str, ...]] = {
    m: tuple(f.model_type for f in FAMILIES if m in f.quant_methods)
    for m in dict.fromkeys(m for f in FAMILIES for m in f.quant_methods)}
_QUANT_HELP = ("fp8: fine-grained FP8, e4m3 with weight_block_size, as DeepSeek-V3/R1 and the Qwen3 FP8 releases "
               "publish it; mxfp4: gpt-oss's MXFP4 experts, as gpt-oss-20b/120b publish them; gptq: 4/8-bit GPTQ "
               "(v1 or v2 files); awq: AutoAWQ gemm; compressed-tensors: pack-quantized int4/int8, naive-quantized "
               "int8, float-quantized fp8; modelopt: NVFP4 (hf_quant_config.json or quantization_config)")


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
