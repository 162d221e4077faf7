"""Fine-grained FP8 checkpoints as DeepSeek-V3/R1 and the Qwen3 FP8 releases publish them
(issue 21, items 2 and 6): `quantization_config {quant_method: fp8, fmt: e4m3,
weight_block_size}`, every Linear weight float8_e4m3fn with a `weight_scale_inv` per block.
moecc computes weight-only (W8A16): each weight is dequantized next to its GEMM, in the
compute dtype config.json names; the bytes it keeps and moves are the stored ones.

The checkpoints are tiny (moecc.testing.quantized) with dims that are not multiples of the
block [32, 24]: partial last blocks in rows and columns, and fused gate_up slices whose up
half starts mid-block. The reference is transformers' model of the same config with the
exactly dequantized weights loaded as an unquantized checkpoint (its own FP8 path is never
used), experts eager (tests/e2e/test_equivalence.py). DeepSeek-V3 in bf16 is compared with
moecc's own plan of those dequantized weights (moecc's bf16 MLA rounds apart from
transformers' for dense bf16 checkpoints too) and with transformers in fp32."""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from moecc.compiler import compile_model
from moecc.errors import CheckpointError, UnsupportedModelError
from moecc.frontend.build import build_graph
from moecc.frontend.checkpoint import read_checkpoint
from moecc.frontend.config import QUANT_METHODS, compute_dtype, load_config
from moecc.sizes import parse_size
from moecc.testing.checkpoints import write_checkpoint
from moecc.testing.quantized import dequantized_state_dict, write_dequantized_checkpoint, write_fp8_checkpoint
from moecc_runtime.engine import Engine, generate
from moecc_runtime.memory.weights import WeightStore
from moecc_runtime.plan import PlanError, check_checkpoint, save_plan
from moecc_runtime.scheduler.sequence import GenRequest
from tests.e2e.test_equivalence import _prompts, _reference

CONFIGS = Path(__file__).resolve().parents[3] / "examples" / "configs"
BLOCK = (32, 24)
NEW = 6
# 32 experts: the routed experts outweigh a module's working set, so an arena below the
# weights runs; DeepSeek-V3: expert and dense rows 40 and 72 (partial row blocks), columns
# 64, 40, 32, 16 partial; Qwen3: expert rows 48, the fused up half from row 48 (mid-block)
SHAPES = {"deepseek_v3": dict(moe_intermediate_size=40, intermediate_size=72, n_routed_experts=32),
          "qwen3_moe": dict(num_experts=32)}


@dataclass(frozen=True)
class Case:
    path: Path  # the FP8 checkpoint
    ref: Path  # its exactly dequantized weights, unquantized
    dtype: torch.dtype  # the compute dtype (config.json's torch_dtype)


_CASES = {  # name -> (family, layout, source seed, scale dtype, compute dtype, fused scale)
    "ds": ("deepseek_v3", "per_expert", 0, "float32", "bfloat16", "whole"),
    "ds32": ("deepseek_v3", "per_expert", 0, "float32", "float32", "whole"),
    "qwen": ("qwen3_moe", "per_expert", 0, "bfloat16", "bfloat16", "whole"),  # seed 0: no bf16 ties (below)
    "qwen_fused": ("qwen3_moe", "fused", 0, "float32", "float32", "whole"),
    "qwen_halves": ("qwen3_moe", "fused", 0, "bfloat16", "float32", "halves"),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """fp8(name) -> Case, written once per module."""
    root = tmp_path_factory.mktemp("fp8")
    cache: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in cache:
            family, layout, seed, scale, dtype, fused = _CASES[name]
            src = write_checkpoint(root / name / "src", family, layout=layout, seed=seed, **SHAPES[family])
            path = write_fp8_checkpoint(src, root / name / "fp8", block=BLOCK, scale_dtype=scale, layout=layout,
                                        fused_scale=fused, dtype=dtype)
            ref = write_dequantized_checkpoint(path, root / name / "ref")
            cache[name] = Case(path, ref, getattr(torch, dtype))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def hf(fp8):
    """hf(name) -> (transformers' model of the dequantized weights, tokenizer, requests, greedy output)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache: dict = {}

    def get(name: str):
        if name not in cache:
            c = fp8(name)
            model = AutoModelForCausalLM.from_pretrained(str(c.ref), dtype=c.dtype, experts_implementation="eager")
            tok = AutoTokenizer.from_pretrained(str(c.ref))
            reqs = [GenRequest(str(i), tok(p)["input_ids"], NEW) for i, p in enumerate(_prompts(6))]
            cache[name] = (model.eval(), reqs, {r.key: _reference(model, r.prompt_ids, NEW) for r in reqs})
        return cache[name]

    return get


def _run(plan: dict, path: Path, reqs: list[GenRequest]) -> dict:
    engine = Engine(plan, path, "cpu", expert_chunk=3, attn_micro_batch=2)
    got: dict = {}
    try:
        generate(engine, reqs, lambda r: got.__setitem__(r.key, r), record_logits=True)
    finally:
        engine.close()
    return got


def _streamed(path: Path, fraction: float) -> dict:
    """A plan whose arena holds `fraction` of the stored weights: the experts stream (the
    dense groups may all be resident)."""
    plan, _ = compile_model(path)
    gpu_mem = int(plan["predicted"]["weight_bytes"] * fraction)
    plan, _ = compile_model(path, gpu_mem=gpu_mem, prompt_tokens=16, output_tokens=8, max_batch=4)
    lay = plan["arena"]
    assert lay is not None and lay["bytes"] <= gpu_mem < plan["predicted"]["weight_bytes"]
    assert lay["expert_slots"] >= 1 and not any(g.endswith(".experts") for g in lay["resident"]), "experts stream"
    return plan


def _assert_matches(got: dict, ref: dict, tol: float | None, first_exact: bool = False) -> None:
    """Token-identical greedy output; logits within `tol` (None, bf16: the reference's best
    two logits apart at every step: a bf16 tie could go either way with one rounding
    changed, so the checkpoint's seed avoids them); `first_exact`: the first step's logits
    bit-identical (in place: the same prefill as transformers'; a streamed plan's smaller
    prefill steps round attention apart)."""
    for key, (ids, logits) in ref.items():
        if tol is None:
            assert all(len(set(torch.topk(lg, 2).values.tolist())) == 2 for lg in logits), f"prompt {key}: a tie"
        assert got[key].token_ids == ids, f"prompt {key}"
        if first_exact:
            assert torch.equal(got[key].logits[0], logits[0]), f"prompt {key}"
        if tol is not None:
            worst = max((a - b).abs().max().item() for a, b in zip(got[key].logits, logits))
            assert worst < tol, f"prompt {key}: {worst}"


# -- greedy output -----------------------------------------------------------------------
@pytest.mark.parametrize("name,streamed", [("qwen", False), pytest.param("qwen", True, marks=pytest.mark.slow),
                                           pytest.param("ds32", False, marks=pytest.mark.slow),
                                           pytest.param("ds32", True, marks=pytest.mark.slow),
                                           pytest.param("qwen_fused", True, marks=pytest.mark.slow)])
def test_greedy_matches_transformers_on_the_dequantized_weights(fp8, hf, name, streamed):
    """bf16 (Qwen3, bf16 scales): token-identical (in place: the first step's logits
    bit-identical); fp32 compute (DeepSeek-V3, Qwen3 fused): token-identical, logits within
    1e-4. Resident and streamed through an arena below the stored weights."""
    c = fp8(name)
    _, reqs, ref = hf(name)
    plan = _streamed(c.path, 0.7) if streamed else compile_model(c.path)[0]
    assert plan["model"]["info"]["dtype"] == str(c.dtype).removeprefix("torch.")
    bf16 = c.dtype == torch.bfloat16
    _assert_matches(_run(plan, c.path, reqs), ref, None if bf16 else 1e-4, first_exact=bf16 and not streamed)


@pytest.mark.slow
def test_deepseek_v3_bf16_fp8_equals_its_dequantized_bf16_checkpoint(fp8, hf):
    """DeepSeek-V3 as published (bf16 compute): the FP8 plan's tokens and every step's logits
    are bit-identical to moecc's plan of the exactly dequantized bf16 weights: dequantizing
    at the GEMM adds nothing."""
    c = fp8("ds")
    _, reqs, _ = hf("ds32")
    reqs = reqs[:3]
    plan, _ = compile_model(c.path)
    dense, _ = compile_model(c.ref)
    assert plan["model"]["info"]["dtype"] == dense["model"]["info"]["dtype"] == "bfloat16"
    got, want = _run(plan, c.path, reqs), _run(dense, c.ref, reqs)
    for r in reqs:
        assert got[r.key].token_ids == want[r.key].token_ids
        assert all(torch.equal(a, b) for a, b in zip(got[r.key].logits, want[r.key].logits))


@pytest.mark.parametrize("name", ["ds", "qwen", "qwen_fused", "qwen_halves"])
def test_materialized_weights_are_the_exact_dequantization(fp8, name):
    """Every weight the runtime reads (resident store) equals the reference's tensor: per
    expert, each fused gate/up slice (up starting mid-block; scales blocked over the fused
    rows or over each half), partial last blocks in both directions."""
    c = fp8(name)
    plan, _ = compile_model(c.path)
    want = dequantized_state_dict(c.path)
    store = WeightStore(plan["weights"], c.path, torch.device("cpu"), compute_dtype=c.dtype)
    try:
        fp8_entries = {k: e for k, e in plan["weights"].items() if e.get("format") == "fp8_block"}
        assert fp8_entries
        for key, e in fp8_entries.items():
            w = want[e["tensor"]]
            if e["index"] is not None:
                w = w[e["index"]]
            if e["rows"] is not None:
                w = w[e["rows"][0]:e["rows"][1]]
            assert torch.equal(store.get(key), w.to(c.dtype)), key
    finally:
        store.close()
    if name == "qwen_halves":
        gu = next(e for e in fp8_entries.values() if e["rows"] and e["rows"][0] > 0)
        assert gu["format_attrs"]["row0"] == 0 and gu["parts"]["scale"]["rows"] == [2, 4]


# -- the plan -----------------------------------------------------------------------------
def test_manifest_names_fp8_parts_and_weight_bytes_are_the_stored_bytes(fp8):
    c = fp8("ds")
    plan, _ = compile_model(c.path)
    ckpt = read_checkpoint(c.path)
    entries = plan["weights"].values()
    q = [e for e in entries if e.get("format") == "fp8_block"]
    dense = [e for e in entries if e.get("format", "dense") == "dense"]
    assert all(e["dtype"] == "float8_e4m3fn" and e["parts"]["scale"]["tensor"] == e["tensor"] + "_scale_inv"
               and e["parts"]["scale"]["dtype"] == "float32" and e["format_attrs"]["block"] == BLOCK
               and e["logical_shape"] == e["shape"] for e in q)
    # attention (MLA), dense MLP, shared and routed experts quantized; the rest as published
    kinds = {e["tensor"].split(".")[-2] for e in q}
    assert kinds == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"}
    assert {e["tensor"] for e in dense} >= {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                                            "model.layers.1.mlp.gate.weight",
                                            "model.layers.1.self_attn.kv_a_layernorm.weight"}
    assert all(e["dtype"] in ("bfloat16", "float32") for e in dense)
    # predicted weight bytes: every stored tensor once (data and scales), about half of bf16
    assert plan["predicted"]["weight_bytes"] == sum(loc.nbytes for loc in ckpt.tensors.values())
    stored = sum(e["nbytes"] + e["parts"]["scale"]["nbytes"] for e in q)
    logical = sum(2 * e["shape"][0] * e["shape"][1] for e in q)
    assert 0.5 < stored / logical < 0.53
    bf16, _ = compile_model(c.ref)
    assert plan["predicted"]["weight_bytes"] < 0.7 * bf16["predicted"]["weight_bytes"]


def test_compute_dtype_is_the_configs_never_fp8(fp8):
    for name in ("ds", "qwen"):  # fp32 and bf16 scales
        ckpt = read_checkpoint(fp8(name).path)
        assert {loc.dtype for loc in ckpt.tensors.values()} >= {"float8_e4m3fn", "bfloat16"}
        assert compute_dtype(ckpt, load_config(ckpt)) == "bfloat16"


def test_traced_graph_is_the_unquantized_models(fp8):
    """transformers' from_config does not swap nn.Linear for FP8Linear (moecc takes the
    quantization_config off the config it builds anyway): the graph is the bf16 model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    c = fp8("ds")
    config = AutoConfig.from_pretrained(str(c.path))
    assert config.quantization_config["quant_method"] == "fp8"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert not any("FP8" in type(m).__name__ for m in model.modules())
    g, _ = build_graph(c.path)
    ref, _ = build_graph(c.ref)
    assert [(n.name, n.op, n.shape, sorted(n.weights)) for n in g.nodes] == \
           [(n.name, n.op, n.shape, sorted(n.weights)) for n in ref.nodes]
    assert all(w.shape == ref.node(n.name).weights[k].shape for n in g.nodes for k, w in n.weights.items())
    assert g.info.extra["quantization"] == {"method": "fp8", "format": "fp8_block", "block": list(BLOCK)}


# -- refusals -----------------------------------------------------------------------------
def _with_config(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("method", ["hqq", "eetq", "bitsandbytes", "quanto", "mxfp4", "fbgemm_fp8"])  # gptq, awq,
# compressed-tensors and modelopt are read now (tests/test_formats_*.py)
def test_other_quant_methods_are_refused_naming_the_field_and_the_supported(fp8, tmp_path, method):
    path = _with_config(fp8("qwen").path, tmp_path / "m",
                        lambda cfg: cfg.update(quantization_config={"quant_method": method, "bits": 4}))
    with pytest.raises(UnsupportedModelError) as e:
        compile_model(path)
    msg = str(e.value)
    assert "config.json" in msg and "quantization_config.quant_method" in msg and f'"{method}"' in msg
    assert f"supported: {', '.join(QUANT_METHODS)}" in msg


@pytest.mark.parametrize("field,value,error,says", [
    ("fmt", "e5m2", UnsupportedModelError, "quantization_config.fmt"),
    ("weight_block_size", [128], CheckpointError, "quantization_config.weight_block_size"),
    ("activation_scheme", "static", UnsupportedModelError, "quantization_config.activation_scheme"),
])
def test_fp8_fields_moecc_cannot_read_are_refused(fp8, tmp_path, field, value, error, says):
    path = _with_config(fp8("qwen").path, tmp_path / "m",
                        lambda cfg: cfg["quantization_config"].update({field: value}))
    with pytest.raises(error, match=says) as e:
        compile_model(path)
    assert "config.json" in str(e.value)


def test_fp8_tensors_without_a_quantization_config_are_refused(fp8, tmp_path):
    path = _with_config(fp8("qwen").path, tmp_path / "m", lambda cfg: cfg.pop("quantization_config"))
    with pytest.raises(CheckpointError, match=r"stored as float8_e4m3fn but .*config.json has no fp8 quantization"):
        compile_model(path)


def _rewrite(path: Path, edit) -> None:
    """Rewrite model.safetensors with edit(tensors) applied."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_a_scale_of_the_wrong_shape_is_refused_naming_tensor_and_shapes(fp8, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(fp8("ds").path, path)
    name = "model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv"  # [40, 64] in [32, 24] blocks: [2, 3]

    def drop_a_column(t: dict) -> None:
        t[name] = t[name][:, :2].contiguous()

    _rewrite(path, drop_a_column)
    with pytest.raises(CheckpointError) as e:
        compile_model(path)
    msg = str(e.value)
    assert name in msg and "[2, 2]" in msg and "[2, 3]" in msg and "[40, 64]" in msg and "weight_block_size" in msg


@pytest.mark.slow
def test_exec_refuses_a_plan_whose_scale_changed_in_the_header(fp8, tmp_path):
    """A scale tensor re-laid in the header (same bytes, other shape): exec refuses the plan
    (the fingerprint's header hash); with that hash forged, the manifest check of the scale
    part refuses it, naming the weight and its part."""
    from moecc_runtime.job.exec import run_job

    path = tmp_path / "m"
    shutil.copytree(fp8("ds").path, path)
    plan, _ = compile_model(path, prompt_tokens=16, output_tokens=4, max_batch=4)
    save_plan(plan, tmp_path / "plan.pt")
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "prompt": "The kettle", "max_tokens": 3}\n')
    f = path / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"  # [128, 16]: [4, 1] -> [1, 4]
    assert header[name]["shape"] == [4, 1]
    header[name]["shape"] = [1, 4]
    text = json.dumps(header, separators=(",", ":")).encode()
    f.write_bytes(struct.pack("<Q", n) + text.ljust(n) + raw[8 + n:])
    with pytest.raises(PlanError, match="tensor layout"):
        run_job(tmp_path / "plan.pt", tmp_path / "in.jsonl", tmp_path / "out.jsonl", log=None)
    forged = read_checkpoint(path).fingerprint()
    plan["model"]["fingerprint"] = forged
    with pytest.raises(PlanError, match=r"\.parts\['scale'\]: names bytes at .* of shape \[4, 1\]") as e:
        check_checkpoint(plan)
    assert "kv_b" in str(e.value)


# -- the published configs, without weights -------------------------------------------------
@pytest.mark.slow
def test_deepseek_v3_fp8_config_plans_at_24gb_1tb_a5000():
    """The published DeepSeek-V3 config.json (quantization_config included) plans within
    1TB of host memory, which its bf16 weights (1.34TB) do not fit: 671B parameters, the
    Linear ones at a byte each plus fp32 scales per 128x128 block, the rest bf16."""
    plan, g = compile_model(CONFIGS / "deepseek-v3-fp8", gpu_mem=parse_size("24GB"), host_mem=parse_size("1TB"),
                            hardware="a5000", prompt_tokens=512, output_tokens=256)
    assert 0.6e12 < plan["predicted"]["weight_bytes"] < 0.8e12
    assert plan["memory"]["host"]["weights"] == plan["predicted"]["weight_bytes"]
    assert plan["arena"]["bytes"] <= parse_size("24GB") and plan["predicted"]["decode_tokens_per_s"] > 0
    q = [e for e in plan["weights"].values() if e.get("format") == "fp8_block"]
    assert all(e["dtype"] == "float8_e4m3fn" and e["parts"]["scale"]["dtype"] == "float32" for e in q)
    e = next(e for e in q if e["tensor"].endswith("q_b_proj.weight"))  # [24576, 1536]
    assert e["parts"]["scale"]["shape"] == [192, 12] and e["format_attrs"]["block"] == (128, 128)
    dense = {e["tensor"].split(".")[-2] for e in plan["weights"].values() if e.get("format", "dense") == "dense"}
    assert {"gate", "embed_tokens", "lm_head", "kv_a_layernorm"} <= dense
    assert not dense & {"q_a_proj", "kv_b_proj", "o_proj", "gate_proj", "experts"}


@pytest.mark.slow
def test_qwen3_30b_fp8_config_counts_half_the_bf16_bytes():
    g, _ = build_graph(CONFIGS / "qwen3-30b-a3b-fp8")
    bf16, _ = build_graph(CONFIGS / "qwen3-30b-a3b")
    assert 0.5 < g.weight_bytes / bf16.weight_bytes < 0.53
    routers = [n for n in g.nodes if n.op == "router"]
    assert routers and all(w.format == "dense" for n in routers for w in n.weights.values())
