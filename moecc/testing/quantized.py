"""Tiny FP8 checkpoints in the published layout, made from the tiny checkpoints of
moecc.testing.checkpoints, and their exact dequantization (the reference's weights).

Fine-grained FP8 as DeepSeek-V3/R1 and the Qwen3 FP8 releases publish it: every Linear
weight of attention, experts, shared experts and dense MLPs is `X.weight` float8_e4m3fn
[R, C] with `X.weight_scale_inv` [ceil(R/bR), ceil(C/bC)] (fp32 or bf16: real value = fp8
value x its block's scale; the last block of a dimension that is not a multiple of the
block is partial); embeddings, norms, router gates and lm_head stay in the compute dtype
(DeepSeek's e_score_correction_bias in fp32, as published); config.json gains
`quantization_config` and `torch_dtype`. Fused experts (transformers 5's own layout)
become `experts.gate_up_proj` [E, 2I, H] fp8 with `experts.gate_up_proj_scale_inv`,
blocked over the fused rows ("whole": [E, ceil(2I/bR), ceil(H/bC)]) or gate and up apart
("halves": [E, 2 ceil(I/bR), ceil(H/bC)], what transformers makes by concatenating the
per-expert scales).

Needs: a checkpoint directory written by write_checkpoint (one or more safetensors files).
Does: quantizes per block (block amax -> 448, the scale rounded to its dtype first, so
data x scale is the stored value exactly), writes one model.safetensors, copies the
tokenizer and generation files.
Guarantees: deterministic; `dequantized_state_dict` gives the exact fp32 products, cast
to the checkpoint's compute dtype, under the same tensor names (scales dropped).

MXFP4 as gpt-oss publishes it (`write_mxfp4_checkpoint`): each experts module's
`gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H] (transformers' x @ W layout, gate and up
interleaved by column) become `*_blocks` uint8 [E, R, C/32, 16] and `*_scales` uint8
[E, R, C/32] of each expert's matrix transposed to [R, C] = [out, in] ([2I, H], [H, I]), as
runtime/formats/mxfp4.quantize makes them; biases and everything else stay in the compute
dtype; config.json gains the release's quantization_config (quant_method mxfp4,
modules_to_not_convert). Its dequantization is transformers' own
(`transformers.integrations.mxfp4.convert_moe_packed_tensors`: blocks -> [E, R, C] ->
transposed to the module's [E, C, R]), named as the unquantized checkpoint names them.

Legend: R, C = rows and columns of a weight; bR, bC = the block; gR, gC = the block grid
(ceil(R/bR), ceil(C/bC)); E = experts; I = expert intermediate size; H = hidden size.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moecc_runtime.formats.fp8_block import FP8_MAX, quantize  # the one FP8 quantizer (tests and tools)

__all__ = ["FP8_MAX", "MXFP4_QUANTIZATION_CONFIG", "QUANTIZATION_CONFIG", "dequantize", "dequantized_state_dict",
           "quantize", "write_dequantized_checkpoint", "write_fp8_checkpoint", "write_mxfp4_checkpoint"]

#: the published block (DeepSeek-V3's config.json); weight_block_size is set per checkpoint
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [128, 128]}
SCALE_SUFFIX = "_scale_inv"
#: gpt-oss-20b/120b's quantization_config as published
MXFP4_QUANTIZATION_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                        "model.embed_tokens", "lm_head"],
                             "quant_method": "mxfp4"}
_MX_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")  # gpt-oss: [E, C, R], x @ W
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Linear weights the releases quantize: attention (MHA and MLA) and MLP / expert projections
_LINEAR = re.compile(r"\.(q|k|v|o|q_a|q_b|kv_b|gate|up|down)_proj\.weight$|\.kv_a_proj_with_mqa\.weight$"
                     r"|\.w[123]\.weight$")
_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
_KEEP_FP32 = ("e_score_correction_bias",)
_COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """scale [gR, gC] -> one scale per element [R, C] (fp32), cropped to partial last blocks."""
    (R, C), (b_r, b_c) = shape, block
    full = scale.float()[:, None, :, None].expand(-1, b_r, -1, b_c)  # [gR, bR, gC, bC]
    return full.reshape(scale.shape[0] * b_r, scale.shape[1] * b_c)[:R, :C]  # [R, C]


def dequantize(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """data [R, C] fp8 x its blocks' scales [gR, gC]: the exact product in fp32 [R, C]."""
    return data.float() * _expand(scale, tuple(data.shape), block)  # type: ignore[arg-type]


def _read(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            tensors.update({k: st.get_tensor(k) for k in st.keys()})
    return tensors


def _quantize_fused(name: str, w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype,
                    halves: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused expert tensor w [E, R, C]: data [E, R, C] fp8 and scale [E, S, gC], blocked
    over each expert's rows, or (gate_up with `halves`) over its two halves apart."""
    rows = w.shape[1] // 2
    if halves and -(-w.shape[1] // block[0]) == 2 * _cdiv(rows, block[0]) and rows % block[0]:
        raise ValueError(f"{name}: halves of {rows} rows in blocks of {block[0]} give the scale grid of the whole "
                         f"tensor, so a reader cannot tell them apart; pick another block or intermediate size")
    datas, scales = [], []
    for m in w:  # [R, C]
        if halves and name.endswith("gate_up_proj"):
            (dg, sg), (du, su) = (quantize(h, block, scale_dtype) for h in m.chunk(2, dim=0))
            d, s = torch.cat([dg, du]), torch.cat([sg, su])
        else:
            d, s = quantize(m, block, scale_dtype)
        datas.append(d)
        scales.append(s)
    return torch.stack(datas), torch.stack(scales)


def write_fp8_checkpoint(src_dir: str | Path, out_dir: str | Path, *, block: tuple[int, int] = (128, 128),
                         scale_dtype: str = "float32", layout: str | None = None, fused_scale: str = "whole",
                         dtype: str = "bfloat16") -> Path:
    """Write `src_dir` (a write_checkpoint directory) in the published FP8 layout to `out_dir`.

    `layout`: None, or the source's expert layout ("per_expert" / "fused") checked;
    `fused_scale`: "whole" or "halves" (see the module docstring); `dtype`: the compute
    dtype (config.json's torch_dtype) the unquantized tensors are stored in. Returns out_dir."""
    src, out = Path(src_dir), Path(out_dir)
    if scale_dtype not in ("float32", "bfloat16") or dtype not in _DTYPES or fused_scale not in ("whole", "halves"):
        raise ValueError(f"scale_dtype float32|bfloat16, dtype {'|'.join(_DTYPES)}, fused_scale whole|halves; "
                         f"got {scale_dtype!r}, {dtype!r}, {fused_scale!r}")
    tensors = _read(src)
    found = "fused" if any(_FUSED.search(n) for n in tensors) else "per_expert"
    if layout is not None and layout != found:
        raise ValueError(f"{src}: its experts are {found}, not {layout}; write the source with "
                         f"write_checkpoint(layout={layout!r})")
    sd, b = _DTYPES[scale_dtype], (int(block[0]), int(block[1]))
    stored: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if t.dim() == 2 and _LINEAR.search(name):
            stored[name], stored[name + SCALE_SUFFIX] = quantize(t, b, sd)
        elif t.dim() == 3 and _FUSED.search(name):
            stored[name], stored[name + SCALE_SUFFIX] = _quantize_fused(name, t, b, sd, fused_scale == "halves")
        elif t.is_floating_point():
            stored[name] = t.float() if any(k in name for k in _KEEP_FP32) else t.to(_DTYPES[dtype])
        else:
            stored[name] = t
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg.pop("dtype", None)
    cfg.update(torch_dtype=dtype, quantization_config={**QUANTIZATION_CONFIG, "weight_block_size": list(b)})
    return _write(out, src, stored, cfg)


def _write(out: Path, src: Path, tensors: dict[str, torch.Tensor], cfg: dict) -> Path:
    """One model.safetensors of `tensors`, config.json `cfg`, and `src`'s tokenizer and generation files."""
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    for f in _COPIED:
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    return out


def write_mxfp4_checkpoint(src_dir: str | Path, out_dir: str | Path, *, dtype: str = "bfloat16") -> Path:
    """Write `src_dir` (a gpt_oss write_checkpoint directory; hidden and intermediate sizes
    multiples of 32) in gpt-oss's published MXFP4 layout to `out_dir` (see the module
    docstring); `dtype`: the compute dtype (config.json's torch_dtype) of every other
    tensor. Returns out_dir."""
    from moecc_runtime.formats import mxfp4

    src = Path(src_dir)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {'|'.join(_DTYPES)}; got {dtype!r}")
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if cfg.get("model_type") != "gpt_oss":
        raise ValueError(f"{src}: model_type {cfg.get('model_type')!r}; MXFP4 is gpt-oss's (write it with "
                         f"write_checkpoint(..., 'gpt_oss'))")
    stored: dict[str, torch.Tensor] = {}
    for name, t in _read(src).items():
        if _MX_FUSED.search(name):  # [E, C, R] -> per expert [R, C] -> blocks [R, C/32, 16], scales [R, C/32]
            packed = [mxfp4.quantize(w.t().float()) for w in t]
            stored[name + "_blocks"] = torch.stack([b for b, _ in packed])  # [E, R, C/32, 16]
            stored[name + "_scales"] = torch.stack([s for _, s in packed])  # [E, R, C/32]
        else:
            stored[name] = t.to(_DTYPES[dtype]) if t.is_floating_point() else t
    cfg.pop("dtype", None)
    cfg.update(torch_dtype=dtype, quantization_config=json.loads(json.dumps(MXFP4_QUANTIZATION_CONFIG)))
    return _write(Path(out_dir), src, stored, cfg)


def _config(directory: Path) -> tuple[dict, torch.dtype, dict]:
    """(quantization_config, the compute dtype, config.json) of a quantized checkpoint
    (ModelOpt's hf_quant_config.json read as its quantization_config)."""
    cfg = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" not in cfg and (directory / "hf_quant_config.json").is_file():
        hf = json.loads((directory / "hf_quant_config.json").read_text(encoding="utf-8"))
        return {"quant_method": "modelopt", **hf["quantization"]}, _DTYPES[cfg["torch_dtype"]], cfg
    return cfg["quantization_config"], _DTYPES[cfg["torch_dtype"]], cfg


def _block(directory: Path) -> tuple[tuple[int, int], torch.dtype, dict]:
    q, dtype, cfg = _config(directory)
    return (int(q["weight_block_size"][0]), int(q["weight_block_size"][1])), dtype, cfg


def _dequantize_stored(name: str, data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """One stored FP8 tensor (2-D, or fused [E, R, C] blocked whole or by halves) in fp32."""
    if data.dim() == 2:
        return dequantize(data, scale, block)
    whole = _cdiv(data.shape[1], block[0])
    out = []
    for d, s in zip(data, scale):  # [R, C], [S, gC]
        if s.shape[0] != whole and name.endswith("gate_up_proj"):  # gate and up blocked apart
            (dg, du), (sg, su) = d.chunk(2, dim=0), s.chunk(2, dim=0)
            out.append(torch.cat([dequantize(dg, sg, block), dequantize(du, su, block)]))
        else:
            out.append(dequantize(d, s, block))
    return torch.stack(out)


def _mxfp4_dequantized(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An MXFP4 checkpoint's tensors with each `X_blocks`/`X_scales` pair replaced by `X` as
    transformers dequantizes it (convert_moe_packed_tensors, in `dtype`: exact)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            out[base] = convert_moe_packed_tensors(t, tensors[base + "_scales"], dtype=dtype)  # [E, C, R]
        elif not name.endswith("_scales"):
            out[name] = t
    return out


def dequantized_state_dict(q_dir: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a quantized checkpoint as the reference model holds them. FP8: each
    FP8 weight's exact fp32 product with its scales, cast to the compute dtype (config.json's
    torch_dtype); MXFP4: each experts tensor as transformers dequantizes it, in that dtype;
    every other tensor as stored; scales dropped."""
    d = Path(q_dir)
    q, dtype, _ = _config(d)
    if q["quant_method"] == "mxfp4":
        return _mxfp4_dequantized(_read(d), dtype)
    if q["quant_method"] in ("gptq", "awq", "compressed-tensors", "modelopt"):
        from moecc.testing.quantized_libs import library_dequantized

        return library_dequantized(d, _read(d), q, dtype)
    block, dtype, _ = _block(d)
    tensors = _read(d)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if t.dtype == torch.float8_e4m3fn:
            out[name] = _dequantize_stored(name, t, tensors[name + SCALE_SUFFIX], block).to(dtype)
        else:
            out[name] = t
    return out


def write_dequantized_checkpoint(q_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None) -> Path:
    """An unquantized checkpoint of `q_dir`'s exactly dequantized weights (FP8 or MXFP4;
    config.json without quantization_config): what the reference model loads, with
    transformers' own quantized loading never involved. `dtype`: every floating tensor cast
    to it (e.g. float32, for an fp32 reference of bf16 weights: exact) and recorded as
    config.json's torch_dtype; None keeps the checkpoint's. Returns out_dir."""
    src = Path(q_dir)
    _, _, cfg = _config(src)
    tensors = dequantized_state_dict(src)
    if dtype is not None:
        tensors = {k: v.to(_DTYPES[dtype]) if v.is_floating_point() else v for k, v in tensors.items()}
        cfg["torch_dtype"] = dtype
    cfg.pop("quantization_config", None)
    return _write(Path(out_dir), src, tensors, cfg)
