"""Tiny checkpoints in the layouts of the integer and FP4 quantization libraries, made from
the tiny checkpoints of moecc.testing.checkpoints (per-expert layout), and each library's
own dequantization of them (the reference's weights, exact in fp32).

Every 2-D Linear weight of attention, experts and dense MLPs is quantized (routers,
embeddings, norms and lm_head stay in the compute dtype, config.json's torch_dtype) and
stored as the library writes it; config.json gains the library's quantization_config:

- GPTQ (`write_gptq_checkpoint`): round-to-nearest with GPTQ's quantizer rule
  (auto_gptq/quantization/quantizer.py find_params: range [min(x, 0), max(x, 0)], sym: zero
  (maxq + 1) / 2), fp16 scales, desc_act as a random permutation's groups (g_idx), packed
  as auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py QuantLinear.pack writes it (qweight
  along the input dimension; qzeros of z - 1 in v1 files, z in gptq_v2; a v1 file cannot
  hold a zero point of 0, AutoGPTQ's packing corrupts it, so zero points are at least 1 there).
- AWQ (`write_awq_checkpoint`): asymmetric per group, fp16 scales, packed as
  awq/modules/linear/gemm.py WQLinear_GEMM.from_linear writes it (order_map [0,2,4,6,1,3,5,7]).
- compressed-tensors (`write_ct_checkpoint`): the library itself computes the qparams
  (calculate_qparams) and compresses (its compressors), so the file is the library's.
- NVFP4 (`write_nvfp4_checkpoint`): as ModelOpt's NVFP4QTensor.quantize makes it
  (modelopt/torch/quantization/qtensor/nvfp4_tensor.py), in hf_quant_config.json or in
  config.json's quantization_config.

Legend: R = output channels, C = input channels, G = groups, k = values per int32.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sources(src: Path, dtype: str):
    from moecc.testing.quantized import _LINEAR, _read

    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = dtype
    tensors = _read(src)
    if any(t.dim() == 3 for t in tensors.values()):
        raise ValueError(f"{src}: fused experts; the quantization libraries publish per-expert Linears "
                         f"(write the source with layout='per_expert')")
    linear = {n for n, t in tensors.items() if t.dim() == 2 and _LINEAR.search(n)}
    rest = {n: (t.to(_DTYPES[dtype]) if t.is_floating_point() else t) for n, t in tensors.items() if n not in linear}
    return cfg, {n: tensors[n].float() for n in sorted(linear)}, rest


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words below 2^32 -> int32 of the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


# -- GPTQ ------------------------------------------------------------------------------------
def _gptq_params(x: torch.Tensor, bits: int, sym: bool, min_zero: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's find_params over the rows of x [N, g]: (scale [N] fp16-rounded, zero [N])."""
    maxq = 2 ** bits - 1
    xmin, xmax = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    tie = (xmin == 0) & (xmax == 0)
    xmin, xmax = torch.where(tie, -1.0, xmin), torch.where(tie, 1.0, xmax)
    scale = ((xmax - xmin) / maxq).half().float()
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale).clamp(min_zero, maxq)
    return scale, zero


def gptq_pack(w: torch.Tensor, bits: int, group: int, sym: bool, desc_act: bool, v1: bool,
              seed: int = 0) -> dict[str, torch.Tensor]:
    """A Linear weight w [R, C] as GPTQ stores it: qweight, qzeros, scales, g_idx."""
    R, C = w.shape
    k, maxq, g = 32 // bits, 2 ** bits - 1, C if group <= 0 else group
    perm = torch.randperm(C, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(C)
    g_idx = torch.empty(C, dtype=torch.int32)
    g_idx[perm] = (torch.arange(C) // g).to(torch.int32)  # channel perm[i] is in group i // g
    G = -(-C // g)
    scales, zeros = torch.empty(G, R), torch.empty(G, R)
    for j in range(G):
        cols = (g_idx == j).nonzero().flatten()
        scales[j], zeros[j] = _gptq_params(w[:, cols], bits, sym, 1 if v1 else 0)
    # QuantLinear.pack: intweight[c] = round((W[:, c] + scale_zeros[g_idx[c]]) / scales[g_idx[c]])
    gi = g_idx.long()
    intweight = torch.round((w.t() + (zeros * scales)[gi]) / scales[gi]).clamp(0, maxq).to(torch.int64)  # [C, R]
    qweight = torch.zeros(C // k, R, dtype=torch.int64)
    for j in range(k):  # qweight[row] |= intweight[row * k + j] << (bits * j)
        qweight |= intweight[j::k] << (bits * j)
    stored_z = (zeros - 1 if v1 else zeros).to(torch.int64)  # [G, R]; `zeros -= 1` in v1
    qzeros = torch.zeros(G, R // k, dtype=torch.int64)
    for j in range(k):  # qzeros[:, col] |= zeros[:, col * k + j] << (bits * j)
        qzeros |= stored_z[:, j::k] << (bits * j)
    return {"qweight": _to_int32(qweight), "qzeros": _to_int32(qzeros), "scales": scales.half(), "g_idx": g_idx}


def gptq_dequantize(t: dict[str, torch.Tensor], bits: int, v1: bool) -> torch.Tensor:
    """AutoGPTQ's torch dequantization (qlinear_cuda_old forward: shifts by wf, mask,
    zeros + 1 in v1, scales[g_idx] * (weight - zeros[g_idx])), in fp32: [R, C]."""
    wf = torch.arange(0, 32, bits, dtype=torch.int32)  # [k]
    mask = 2 ** bits - 1
    qz, qw = t["qzeros"], t["qweight"]
    zeros = (torch.bitwise_right_shift(qz.unsqueeze(2).expand(-1, -1, 32 // bits), wf) & mask)
    zeros = zeros.reshape(qz.shape[0], -1) + (1 if v1 else 0)  # [G, R]
    weight = (torch.bitwise_right_shift(qw.unsqueeze(1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1)) & mask)
    weight = weight.reshape(-1, qw.shape[1])  # [C, R]
    g = t["g_idx"].long()
    return (t["scales"].float()[g] * (weight - zeros[g]).float()).t().contiguous()  # [R, C]


def write_gptq_checkpoint(src_dir: str | Path, out_dir: str | Path, *, bits: int = 4, group: int = 16,
                          desc_act: bool = False, sym: bool = True, version: str = "gptq",
                          dtype: str = "float32") -> Path:
    """`src_dir` (a per-expert write_checkpoint directory) in GPTQ's layout (see the module
    docstring); `version`: checkpoint_format gptq (v1) or gptq_v2. Returns out_dir."""
    from moecc.testing.quantized import _write

    src = Path(src_dir)
    cfg, linear, stored = _sources(src, dtype)
    for i, (name, w) in enumerate(linear.items()):
        m = name.removesuffix(".weight")
        packed = gptq_pack(w, bits, group, sym, desc_act, version == "gptq", seed=i)
        stored.update({f"{m}.{k}": v for k, v in packed.items()})
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
                                  "sym": sym, "damp_percent": 0.01, "true_sequential": True,
                                  "checkpoint_format": version}
    return _write(Path(out_dir), src, stored, cfg)


# -- AWQ -------------------------------------------------------------------------------------
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def awq_pack(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """A Linear weight w [R, C] as AutoAWQ's WQLinear_GEMM stores it (asymmetric, 4-bit)."""
    R, C = w.shape
    x = w.reshape(R, C // group, group)  # [R, G, g]
    mx, mn = x.amax(-1), x.amin(-1)  # [R, G]  (awq/quantize/quantizer.py pseudo_quantize_tensor)
    scales = ((mx - mn).clamp(min=1e-5) / 15).half().float()
    zeros = (-torch.round(mn / scales)).clamp(0, 15)
    intweight = torch.round(w / scales.repeat_interleave(group, 1)) + zeros.repeat_interleave(group, 1)
    intweight = intweight.clamp(0, 15).t().to(torch.int64)  # [C, R]
    z = zeros.t().to(torch.int64)  # [G, R]
    qweight = torch.zeros(C, R // 8, dtype=torch.int64)
    qzeros = torch.zeros(C // group, R // 8, dtype=torch.int64)
    for i in range(8):  # qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)
        qweight |= intweight[:, AWQ_ORDER[i]::8] << (i * 4)
        qzeros |= z[:, AWQ_ORDER[i]::8] << (i * 4)
    return {"qweight": _to_int32(qweight), "qzeros": _to_int32(qzeros), "scales": scales.t().contiguous().half()}


def awq_dequantize(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm (unpack_awq, reverse_awq_order, (iweight - izeros) * scales)
    in fp32: [R, C]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)

    def unpack(q: torch.Tensor) -> torch.Tensor:
        v = torch.bitwise_right_shift(q[:, :, None], shifts[None, None, :]).reshape(q.shape[0], -1)
        order = torch.arange(v.shape[-1]).view(-1, 8)[:, list(AWQ_REVERSE_ORDER)].flatten()
        return v[:, order] & 15

    iweight, izeros = unpack(t["qweight"]), unpack(t["qzeros"])
    scales = t["scales"].float().repeat_interleave(group, dim=0)
    return ((iweight - izeros.repeat_interleave(group, dim=0)).float() * scales).t().contiguous()


def write_awq_checkpoint(src_dir: str | Path, out_dir: str | Path, *, group: int = 16,
                         dtype: str = "float32", not_convert: tuple[str, ...] = ()) -> Path:
    """`src_dir` in AutoAWQ's GEMM layout; modules matching `not_convert` (transformers'
    modules_to_not_convert) stay dense. Returns out_dir."""
    import re

    from moecc.testing.quantized import _write

    src = Path(src_dir)
    cfg, linear, stored = _sources(src, dtype)
    for name, w in linear.items():
        m = name.removesuffix(".weight")
        if any(re.match(rf"(?:{p})(?:\.|$)", m) or m.endswith(p) for p in not_convert):
            stored[name] = w.to(_DTYPES[dtype])
            continue
        stored.update({f"{m}.{k}": v for k, v in awq_pack(w, group).items()})
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                  "version": "gemm", "modules_to_not_convert": list(not_convert) or None}
    return _write(Path(out_dir), src, stored, cfg)


# -- compressed-tensors ----------------------------------------------------------------------
#: scheme name -> (format, weights QuantizationArgs)
CT_SCHEMES = {
    "w4_group_sym": ("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                        "group_size": 16}),
    "w4_group_asym": ("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                         "group_size": 16}),
    "w8_channel_asym": ("pack-quantized", {"num_bits": 8, "type": "int", "symmetric": False,
                                           "strategy": "channel"}),
    "w8_naive_channel": ("naive-quantized", {"num_bits": 8, "type": "int", "symmetric": True,
                                             "strategy": "channel"}),
    "fp8_channel": ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}),
    "fp8_tensor": ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}),
}
CT_IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"]


def _ct_args(scheme: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    fmt, w = CT_SCHEMES[scheme]
    return fmt, QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**w))


def ct_compress(w: torch.Tensor, scheme: str, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A Linear weight w [R, C] as compressed-tensors stores it in `scheme` (CT_SCHEMES),
    qparams and packing by the library."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    fmt, qs = _ct_args(scheme)
    a = qs.weights
    x = w.to(scale_dtype)
    if a.strategy == "group":
        g = x.unflatten(-1, (-1, a.group_size))
        mn, mx = g.amin(-1), g.amax(-1)  # [R, G]
    elif a.strategy == "channel":
        mn, mx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)  # [R, 1]
    else:
        mn, mx = x.amin().reshape(1), x.amax().reshape(1)  # [1]
    scale, zp = calculate_qparams(torch.minimum(mn, torch.zeros_like(mn)), torch.maximum(mx, torch.zeros_like(mx)), a)
    sd = {"weight": x, "weight_scale": scale.to(scale_dtype), "weight_zero_point": zp}
    return dict(BaseCompressor.load_from_registry(fmt).compress(sd, qs))


def ct_decompress(t: dict[str, torch.Tensor], scheme: str) -> torch.Tensor:
    """The library's own decompression of one Linear's stored tensors (in the scale's dtype)."""
    from compressed_tensors.compressors import BaseCompressor

    fmt, qs = _ct_args(scheme)
    return BaseCompressor.load_from_registry(fmt).decompress(dict(t), qs)["weight"]


def write_ct_checkpoint(src_dir: str | Path, out_dir: str | Path, *, scheme: str = "w4_group_sym",
                        dtype: str = "float32", scale_dtype: str = "bfloat16",
                        attention_scheme: str | None = None) -> Path:
    """`src_dir` in compressed-tensors' layout: every Linear in `scheme` (attention in
    `attention_scheme`, a second config group targeting "re:.*self_attn\\..*", when given);
    routers and lm_head in `ignore`. Returns out_dir."""
    from moecc.testing.quantized import _write

    src = Path(src_dir)
    cfg, linear, stored = _sources(src, dtype)
    for name, w in linear.items():
        m = name.removesuffix(".weight")
        s = attention_scheme if attention_scheme and ".self_attn." in name else scheme
        packed = ct_compress(w, s, _DTYPES[scale_dtype])
        stored.update({f"{m}.{k}": v.contiguous() for k, v in packed.items()})
    groups = {"group_0": {"targets": ["Linear"], "weights": CT_SCHEMES[scheme][1], "input_activations": None,
                          "format": CT_SCHEMES[scheme][0]}}
    if attention_scheme:
        groups["group_1"] = {"targets": [r"re:.*self_attn\..*"], "weights": CT_SCHEMES[attention_scheme][1],
                             "format": CT_SCHEMES[attention_scheme][0]}
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": CT_SCHEMES[scheme][0],
                                  "quantization_status": "compressed", "config_groups": groups,
                                  "ignore": CT_IGNORE, "kv_cache_scheme": None, "version": "0.20.1"}
    return _write(Path(out_dir), src, stored, cfg)


# -- NVFP4 -----------------------------------------------------------------------------------
E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5])
E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])


def nvfp4_pack(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """A Linear weight w [R, C] as NVFP4QTensor.quantize makes it: weight, weight_scale,
    weight_scale_2 (and an input_scale, as the releases store one)."""
    R, C = w.shape
    scale_2 = (w.abs().amax().float() / (6.0 * 448.0))
    blocks = w.view(R, C // 16, 16)
    per_block = blocks.abs().amax(-1).float() / (6.0 * scale_2)
    per_block[per_block == 0] = 1.0
    per_block = per_block.to(torch.float8_e4m3fn)  # [R, C/16]
    scaled = (blocks / (per_block.float() * scale_2).unsqueeze(-1)).view(R, C)
    sign = (scaled < 0).to(torch.uint8)
    a = scaled.abs()
    ordinal = torch.searchsorted(E2M1_BOUNDS, a.contiguous(), out_int32=True).to(torch.uint8)
    odd = torch.any(a.unsqueeze(-1) == E2M1_BOUNDS[[1, 3, 5]], dim=-1).to(torch.uint8)
    q = (sign << 3) + ordinal + odd  # _cast_fp4
    packed = (q[..., 1::2] << 4) | q[..., 0::2]
    return {"weight": packed.contiguous(), "weight_scale": per_block, "weight_scale_2": scale_2.reshape(()),
            "input_scale": torch.tensor(1.0)}


def nvfp4_dequantize(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """NVFP4QTensor.dequantize (non-fast path) in fp32: [R, C]."""
    data = t["weight"]
    unpacked = torch.empty(data.shape[0], data.shape[1] * 2, dtype=torch.long)
    unpacked[..., 1::2] = data >> 4
    unpacked[..., 0::2] = data & 0x0F
    vals = E2M1_VALUES[unpacked]
    per_block = t["weight_scale"].to(torch.float32) * t["weight_scale_2"]
    return (vals.view(data.shape[0], -1, 16) * per_block.unsqueeze(-1)).reshape(data.shape[0], -1)


def write_nvfp4_checkpoint(src_dir: str | Path, out_dir: str | Path, *, dtype: str = "float32",
                           hf_quant_config: bool = True, exclude: tuple[str, ...] = ("lm_head",)) -> Path:
    """`src_dir` in ModelOpt's NVFP4 layout; modules matching `exclude` (shell wildcards)
    stay dense; the quantization in hf_quant_config.json or config.json. Returns out_dir."""
    import fnmatch

    from moecc.testing.quantized import _write

    src = Path(src_dir)
    cfg, linear, stored = _sources(src, dtype)
    for name, w in linear.items():
        m = name.removesuffix(".weight")
        if any(fnmatch.fnmatchcase(m, p) for p in exclude):
            stored[name] = w.to(_DTYPES[dtype])
            continue
        stored.update({f"{m}.{k}": v for k, v in nvfp4_pack(w).items()})
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": list(exclude)}
    if not hf_quant_config:
        cfg["quantization_config"] = {"quant_method": "modelopt", **quant}
    out = _write(Path(out_dir), src, stored, cfg)
    if hf_quant_config:
        (out / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.23.0"}, "quantization": quant}, indent=2) + "\n")
    return out


# -- the reference -----------------------------------------------------------------------------
def _modules(tensors: dict[str, torch.Tensor], suffix: str) -> list[str]:
    return sorted(n.removesuffix(suffix) for n in tensors if n.endswith(suffix))


def library_dequantized(directory: Path, tensors: dict[str, torch.Tensor], q: dict,
                        dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with each quantized Linear replaced by `X.weight` as its
    library dequantizes it (exact in fp32), cast to `dtype`; scales and packing dropped."""
    out = dict(tensors)
    method = q["quant_method"]
    if method == "gptq":
        for m in _modules(tensors, ".qweight"):
            parts = {k: out.pop(f"{m}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx")}
            out[m + ".weight"] = gptq_dequantize(parts, q["bits"], q.get("checkpoint_format", "gptq") == "gptq")
    elif method == "awq":
        for m in _modules(tensors, ".qweight"):
            parts = {k: out.pop(f"{m}.{k}") for k in ("qweight", "qzeros", "scales")}
            out[m + ".weight"] = awq_dequantize(parts, q["group_size"])
    elif method == "compressed-tensors":
        for m in _modules(tensors, ".weight_scale"):
            scheme = _ct_scheme_of(q, m)
            parts = {k: out.pop(f"{m}.{k}") for k in ("weight", "weight_packed", "weight_scale", "weight_zero_point",
                                                      "weight_shape") if f"{m}.{k}" in out}
            parts["weight_scale"] = parts["weight_scale"].float()  # the library's arithmetic in fp32: exact
            out[m + ".weight"] = ct_decompress(parts, scheme).float()
    else:
        for m in _modules(tensors, ".weight_scale_2"):
            parts = {k: out.pop(f"{m}.{k}") for k in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
            out[m + ".weight"] = nvfp4_dequantize(parts)
    return {n: t.to(dtype) if n.endswith(".weight") and t.is_floating_point() else t for n, t in out.items()}


def _ct_scheme_of(q: dict, module: str) -> str:
    """The CT_SCHEMES name of the config group write_ct_checkpoint gave `module`."""
    groups = q["config_groups"]
    grp = groups["group_1"] if "group_1" in groups and ".self_attn." in module + "." else groups["group_0"]
    return next(k for k, (f, w) in CT_SCHEMES.items() if w == grp["weights"] and f == grp["format"])
