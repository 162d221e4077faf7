"""The library layouts of issue 33 dequantize exactly (runtime/formats/: gptq, awq_gemm,
ct_packed, ct_naive, nvfp4), and their checkpoints' configs are read as the libraries read
them (moecc/frontend/quant_schemes.py, quant_linear.py).

- compressed-tensors is installed: its own compressors make the stored tensors and its own
  decompression is the reference, bit for bit in the scale's dtype.
- GPTQ, AWQ and ModelOpt do not install on CPU: moecc.testing.quantized_libs transcribes
  their packing and dequantization from their sources (AutoGPTQ
  auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py, AutoAWQ awq/modules/linear/gemm.py and
  awq/utils/packing_utils.py, TensorRT-Model-Optimizer
  modelopt/torch/quantization/qtensor/nvfp4_tensor.py), and words packed by hand pin the
  bit order independently of both sides."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moecc.compiler import compile_model
from moecc.frontend.build import build_graph
from moecc.errors import CheckpointError, ConfigError, UnsupportedModelError
from moecc.frontend.checkpoint import read_checkpoint
from moecc.frontend.config import quantization
from moecc.testing import quantized_libs as L
from moecc.testing.checkpoints import write_checkpoint
from moecc_runtime.formats import materialize

SMALL = dict(prompt_tokens=16, output_tokens=8, max_batch=4)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest


def _w(R: int, C: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(R, C, generator=torch.Generator().manual_seed(seed)) * 0.1


def _entry(fmt: str, R: int, C: int, **attrs) -> dict:
    return {"format": fmt, "logical_shape": [R, C], "shape": [], "format_attrs": attrs}


# -- exact dequantization ------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", list(L.CT_SCHEMES))
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_ct_dequantization_is_the_librarys_bit_for_bit(scheme, scale_dtype):
    fmt, args = L.CT_SCHEMES[scheme]
    w = _w(24, 64)
    t = L.ct_compress(w, scheme, scale_dtype)
    want = L.ct_decompress(t, scheme)  # the library's, in the scale's dtype
    assert want.dtype == scale_dtype
    parts = {"data": t.get("weight_packed", t.get("weight")), "scale": t["weight_scale"]}
    if "weight_zero_point" in t:
        parts["zero"] = t["weight_zero_point"]
    name = "ct_packed" if fmt == "pack-quantized" else "ct_naive"
    group = args.get("group_size", 0) if args["strategy"] == "group" else 0
    got = materialize(_entry(name, 24, 64, bits=args["num_bits"], group=group), parts, scale_dtype)
    assert torch.equal(got, want)
    assert (got.float() - w).abs().max() < 0.25 * w.abs().max()


@pytest.mark.parametrize("bits,group,desc_act,sym,v1", [
    (4, 16, False, True, True), (4, 16, True, False, True), (4, -1, True, True, False),
    (8, 32, True, False, False), (8, -1, False, False, True)])
def test_gptq_dequantization_is_autogptqs(bits, group, desc_act, sym, v1):
    w = _w(32, 64, seed=bits + group)
    t = L.gptq_pack(w, bits, group, sym, desc_act, v1)
    parts = {"data": t["qweight"], "zero": t["qzeros"], "scale": t["scales"]}
    if desc_act:
        parts["g_idx"] = t["g_idx"]
    got = materialize(_entry("gptq", 32, 64, bits=bits, group=group, zero_offset=int(v1), desc_act=desc_act),
                      parts, torch.float32)
    assert torch.equal(got, L.gptq_dequantize(t, bits, v1))
    assert (got - w).abs().max() < 0.2 * w.abs().max()


def test_gptq_and_awq_words_pack_in_the_libraries_bit_order():
    """Values 0..7 of eight consecutive channels: GPTQ packs them in order (0x76543210),
    AWQ's gemm interleaves them [0, 2, 4, 6, 1, 3, 5, 7] (0x75316420)."""
    gptq_word = torch.tensor([[0x76543210]], dtype=torch.int32)  # qweight [1, 1]: channels 0..7 of one output
    zero = torch.tensor([[0]], dtype=torch.int32)
    got = materialize(_entry("gptq", 1, 8, bits=4, group=-1, zero_offset=0), {
        "data": gptq_word, "zero": zero, "scale": torch.ones(1, 1)}, torch.float32)
    assert got.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    awq_word = torch.tensor([[0x75316420]], dtype=torch.int32)  # qweight [1, 1]: outputs 0..7 of one input
    got = materialize(_entry("awq_gemm", 8, 1, bits=4, group=1), {
        "data": awq_word, "zero": zero, "scale": torch.ones(1, 8)}, torch.float32)
    assert got.flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    t = L.awq_pack(torch.arange(8.0).repeat(16, 1).t() - 0.0, 16)  # [8, 16]: output r is r everywhere
    assert t["qweight"].shape == (16, 1) and L.awq_dequantize(t, 16).shape == (8, 16)


def test_awq_and_nvfp4_dequantization_are_the_libraries():
    w = _w(32, 48, seed=3)
    t = L.awq_pack(w, 16)
    got = materialize(_entry("awq_gemm", 32, 48, bits=4, group=16),
                      {"data": t["qweight"], "zero": t["qzeros"], "scale": t["scales"]}, torch.float32)
    assert torch.equal(got, L.awq_dequantize(t, 16)) and (got - w).abs().max() < 0.15 * w.abs().max()
    t = L.nvfp4_pack(w)
    parts = {"data": t["weight"], "scale": t["weight_scale"], "scale_2": t["weight_scale_2"]}
    got = materialize(_entry("nvfp4", 32, 48), parts, torch.float32)
    assert torch.equal(got, L.nvfp4_dequantize(t)) and (got - w).abs().max() < 0.25 * w.abs().max()
    one = {"data": torch.tensor([[0x21, 0xF9] * 4], dtype=torch.uint8),  # 0.5, 1.0, -0.5, -6.0, ...
           "scale": torch.tensor([[2.0]]).to(torch.float8_e4m3fn), "scale_2": torch.tensor(0.25)}
    assert materialize(_entry("nvfp4", 1, 16), one, torch.float32)[0, :4].tolist() == [0.25, 0.5, -0.25, -3.0]


# -- checkpoints: what is quantized, what stays dense, stored bytes ---------------------------------
@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("lay") / "src", "qwen3_moe")


def _formats(plan: dict) -> dict[str, str]:
    return {e["tensor"]: e.get("format", "dense") for e in plan["weights"].values()}


def _graph_formats(path: Path) -> dict[str, str]:
    """data tensor -> stored format of every weight of the traced graph (no planning)."""
    g, _ = build_graph(path)
    return {w.tensor: w.format for n in g.nodes for w in n.weights.values()}


def test_ct_config_groups_and_ignore_match_as_the_library_matches(src, tmp_path):
    """A regex group for attention (float-quantized fp8 per channel) beats the "Linear" class
    group (pack-quantized int4) there; the ignore list keeps routers and lm_head dense; the
    plan's weight bytes are the stored ones."""
    path = L.write_ct_checkpoint(src, tmp_path / "ct", scheme="w4_group_asym", attention_scheme="fp8_channel")
    plan, _ = compile_model(path, **SMALL)
    f = _formats(plan)
    assert f["model.layers.0.self_attn.q_proj.weight"] == "ct_naive"
    assert f["model.layers.0.mlp.experts.3.up_proj.weight_packed"] == "ct_packed"
    assert f["model.layers.1.mlp.down_proj.weight_packed"] == "ct_packed"  # the dense MLP layer
    assert f["model.layers.0.mlp.gate.weight"] == "dense" and f["lm_head.weight"] == "dense"
    ckpt = read_checkpoint(path)
    unread = sum(loc.nbytes for n, loc in ckpt.tensors.items() if n.endswith("weight_shape"))
    assert plan["predicted"]["weight_bytes"] == sum(loc.nbytes for loc in ckpt.tensors.values()) - unread
    assert plan["memory"]["host"]["weights"] == plan["predicted"]["weight_bytes"]  # host RAM: the stored bytes
    e = next(e for e in plan["weights"].values() if e["tensor"].endswith("experts.3.up_proj.weight_packed"))
    assert e["dtype"] == "int32" and e["shape"] == [48, 8] and e["parts"]["zero"]["shape"] == [6, 4]
    assert e["logical_shape"] == [48, 64] and e["format_attrs"] == {"bits": 4, "group": 16}


def test_nvfp4_exclude_modules_and_the_config_json_variant(src, tmp_path):
    path = L.write_nvfp4_checkpoint(src, tmp_path / "a", exclude=("lm_head", "model.layers.0.self_attn*"))
    assert (path / "hf_quant_config.json").is_file() and "quantization_config" not in json.loads(
        (path / "config.json").read_text())
    f = _graph_formats(path)
    assert f["model.layers.0.self_attn.q_proj.weight"] == "dense"
    assert f["model.layers.1.self_attn.q_proj.weight"] == "nvfp4"
    path = L.write_nvfp4_checkpoint(src, tmp_path / "b", hf_quant_config=False)
    assert quantization(read_checkpoint(path)).method == "modelopt"
    assert set(_graph_formats(path).values()) == {"dense", "nvfp4"}


def test_awq_modules_to_not_convert_stay_dense(src, tmp_path):
    path = L.write_awq_checkpoint(src, tmp_path / "awq", not_convert=("model.layers.*.self_attn",))
    f = _graph_formats(path)
    assert f["model.layers.2.self_attn.o_proj.weight"] == "dense"
    assert f["model.layers.2.mlp.experts.0.gate_proj.qweight"] == "awq_gemm"


# -- refusals ----------------------------------------------------------------------------------
def _edit(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


_CONFIGS = {  # quant_method -> a quantization_config as the library writes it
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "ct": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                                             "strategy": "group", "group_size": 128}}}},
    "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]},
}


def _ct_bits(q: dict) -> None:
    q["config_groups"]["group_0"]["weights"]["num_bits"] = 2


@pytest.mark.parametrize("method,edit,error,field", [
    ("gptq", {"bits": 3}, UnsupportedModelError, "bits"),
    ("gptq", {"checkpoint_format": "marlin"}, UnsupportedModelError, "checkpoint_format"),
    ("gptq", {"group_size": 0}, ConfigError, "group_size"),
    ("awq", {"version": "gemv"}, UnsupportedModelError, "version"),
    ("ct", _ct_bits, UnsupportedModelError, "config_groups.group_0.weights"),
    ("ct", {"sparsity_config": {"format": "sparse-24-bitmask"}}, UnsupportedModelError, "sparsity_config"),
    ("nvfp4", {"quant_algo": "W4A8_AWQ"}, UnsupportedModelError, "quant_algo")])
def test_fields_moecc_cannot_read_are_refused_naming_them(src, tmp_path, method, edit, error, field):
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    q = json.loads(json.dumps(_CONFIGS[method]))
    edit(q) if callable(edit) else q.update(edit)
    cfg["quantization_config"] = q
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(error, match=f"quantization_config.{field}") as e:
        quantization(read_checkpoint(tmp_path / "m"))
    assert "config.json" in str(e.value)


def test_a_scale_of_the_wrong_shape_or_a_quantized_ignored_module_is_refused(src, tmp_path):
    from safetensors.torch import load_file, save_file

    path = L.write_gptq_checkpoint(src, tmp_path / "g")
    f = path / "model.safetensors"
    t = load_file(str(f))
    name = "model.layers.0.self_attn.k_proj.scales"  # [4, 32]
    t[name] = t[name][:3].contiguous()
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name} has shape \[3, 32\].*needs \[4, 32\]"):
        build_graph(path)
    path = _edit(L.write_ct_checkpoint(src, tmp_path / "c"), tmp_path / "c2",
                 lambda q: q["ignore"].append("re:.*self_attn.*"))
    with pytest.raises(CheckpointError, match=r"stored quantized, but .*keeps module .*self_attn"):
        build_graph(path)
