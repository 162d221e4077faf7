"""gpt-oss as published in MXFP4 (issue 21, item 3): `quantization_config {quant_method:
mxfp4, modules_to_not_convert}`, each experts module's gate_up_proj and down_proj stored as
`*_blocks` uint8 [E, R, C/32, 16] (two E2M1 values a byte) with `*_scales` uint8 [E, R, C/32]
(E8M0), rows the module's outputs; attention, routers, embeddings, lm_head and the expert
biases in bf16. moecc computes weight-only in config.json's dtype: each expert's weight is
dequantized (and transposed to the module's x @ W layout) next to its GEMM; the bytes it
keeps and moves are the stored ones, 17/32 of a byte per expert weight.

The checkpoint is tiny (moecc.testing.quantized.write_mxfp4_checkpoint of a bf16 gpt-oss
with hidden 64 and intermediate 96: gate_up's rows group into 2 groups, down's into 3).
The reference is transformers' model of the same config with the experts dequantized by
transformers' own convert_moe_packed_tensors, loaded as an unquantized checkpoint (its
MXFP4 loading needs accelerate and is never used), experts eager. A bf16 tiny gpt-oss is
bit-exact with transformers unquantized, so the bf16 comparison is exact (first step's
logits bit-identical in place); an fp32 compute case (config dtype float32 over the same
stored blocks) is compared within 1e-4.

Legend: E = experts; H = hidden size; I = expert intermediate size; R, C = rows and columns
of an expert's matrix as stored ([out, in]); G = C/32 groups per row."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from moecc.compiler import compile_model
from moecc.errors import CheckpointError, UnsupportedModelError
from moecc.frontend.build import build_graph
from moecc.frontend.checkpoint import read_checkpoint
from moecc.frontend.config import QUANT_METHODS, compute_dtype, load_config, quantization
from moecc.sizes import parse_size
from moecc.testing.checkpoints import write_checkpoint
from moecc.testing.quantized import (MXFP4_QUANTIZATION_CONFIG, dequantized_state_dict, write_dequantized_checkpoint,
                                     write_mxfp4_checkpoint)
from moecc_runtime.memory.weights import WeightStore
from moecc_runtime.scheduler.sequence import GenRequest
from tests.e2e.test_equivalence import _prompts, _reference
from tests.runtime.formats.test_fp8 import _assert_matches, _rewrite, _run, _streamed

CONFIGS = Path(__file__).resolve().parents[3] / "examples" / "configs"
H, I, E = 64, 96, 32  # 32 experts: the routed experts outweigh the rest, so an arena below the weights runs
NEW = 6
SEED = 2  # no bf16 ties in the reference's best two logits (tests/runtime/formats/test_fp8.py's _assert_matches)


@dataclass(frozen=True)
class Case:
    path: Path  # the MXFP4 checkpoint
    ref: Path  # its exactly dequantized weights, unquantized
    dtype: torch.dtype  # the compute dtype (config.json's torch_dtype)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    """mx(dtype) -> Case: one bf16 gpt-oss source, its MXFP4 release computed in `dtype`."""
    root = tmp_path_factory.mktemp("mxfp4")
    src = write_checkpoint(root / "src", "gpt_oss", dtype="bfloat16", seed=SEED, hidden_size=H,
                           intermediate_size=I, num_local_experts=E)
    cache: dict[str, Case] = {}

    def get(dtype: str = "bfloat16") -> Case:
        if dtype not in cache:
            path = write_mxfp4_checkpoint(src, root / dtype / "mxfp4", dtype=dtype)
            cache[dtype] = Case(path, write_dequantized_checkpoint(path, root / dtype / "ref"), getattr(torch, dtype))
        return cache[dtype]

    return get


@pytest.fixture(scope="module")
def hf(mx):
    """hf(dtype) -> (requests, transformers' greedy output on the dequantized weights)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache: dict = {}

    def get(dtype: str = "bfloat16"):
        if dtype not in cache:
            c = mx(dtype)
            model = AutoModelForCausalLM.from_pretrained(str(c.ref), dtype=c.dtype, experts_implementation="eager")
            tok = AutoTokenizer.from_pretrained(str(c.ref))
            reqs = [GenRequest(str(i), tok(p)["input_ids"], NEW) for i, p in enumerate(_prompts(6))]
            cache[dtype] = (reqs, {r.key: _reference(model.eval(), r.prompt_ids, NEW) for r in reqs})
        return cache[dtype]

    return get


# -- greedy output -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype,streamed", [("bfloat16", False), pytest.param("bfloat16", True, marks=pytest.mark.slow),
                                           pytest.param("float32", False, marks=pytest.mark.slow)])
def test_greedy_matches_transformers_on_the_dequantized_weights(mx, hf, dtype, streamed):
    """bf16 (as published): token-identical, in place the first step's logits bit-identical;
    streamed through an arena below the stored weights (experts through slots); fp32
    compute over the same blocks: token-identical, logits within 1e-4."""
    c = mx(dtype)
    reqs, ref = hf(dtype)
    plan = _streamed(c.path, 0.7) if streamed else compile_model(c.path)[0]
    assert plan["model"]["info"]["dtype"] == dtype
    bf16 = c.dtype == torch.bfloat16
    _assert_matches(_run(plan, c.path, reqs), ref, None if bf16 else 1e-4, first_exact=bf16 and not streamed)


def test_materialized_weights_are_transformers_dequantization(mx):
    """Every expert weight the runtime reads (resident store) is bit-identical to what
    transformers makes of the same blocks: [E, H, 2I] gate_up (gate/up interleaved by
    column, as stored) and [E, I, H] down, expert by expert."""
    c = mx()
    plan, _ = compile_model(c.path)
    want = dequantized_state_dict(c.path)
    store = WeightStore(plan["weights"], c.path, torch.device("cpu"), compute_dtype=c.dtype)
    try:
        entries = {k: e for k, e in plan["weights"].items() if e.get("format") == "mxfp4"}
        assert len(entries) == 2 * 2 * E  # 2 layers x (gate_up, down) x E
        for key, e in entries.items():
            w = want[e["tensor"].removesuffix("_blocks")][e["index"]]
            got = store.get(key)
            assert got.dtype == c.dtype and torch.equal(got, w), key
    finally:
        store.close()


# -- the plan -----------------------------------------------------------------------------
def test_manifest_names_mxfp4_parts_and_expert_bytes_are_17_32_of_a_byte(mx):
    c = mx()
    plan, _ = compile_model(c.path)
    ckpt = read_checkpoint(c.path)
    q = {k: e for k, e in plan["weights"].items() if e.get("format") == "mxfp4"}
    dense = [e for e in plan["weights"].values() if e.get("format", "dense") == "dense"]
    logical = {"gate_up": [H, 2 * I], "down": [I, H]}
    for key, e in q.items():
        part = key.rsplit(".", 1)[1]
        (C, R), scale = logical[part], e["parts"]["scale"]
        assert e["tensor"].endswith(f"experts.{part}_proj_blocks") and e["dtype"] == "uint8"
        assert e["logical_shape"] == [C, R] and e["shape"] == [R, C // 32, 16] and e["format_attrs"] == {
            "transpose": True}
        assert scale["tensor"] == e["tensor"].replace("_blocks", "_scales") and scale["dtype"] == "uint8"
        assert scale["shape"] == [R, C // 32] and scale["index"] == e["index"]
    # attention, routers, embeddings, lm_head, norms and the expert biases: bf16 as published
    assert {e["tensor"].split(".")[-1] for e in dense} >= {"gate_up_proj_bias", "down_proj_bias", "sinks", "bias"}
    assert not any(e["tensor"].endswith(("_blocks", "_scales")) for e in dense)
    assert all(e["dtype"] == "bfloat16" for e in dense)
    # predicted weight bytes: every stored tensor once; experts 17/32 byte per weight
    assert plan["predicted"]["weight_bytes"] == sum(loc.nbytes for loc in ckpt.tensors.values())
    stored = sum(e["nbytes"] + e["parts"]["scale"]["nbytes"] for e in q.values())
    weights = sum(e["logical_shape"][0] * e["logical_shape"][1] for e in q.values())
    assert stored / weights == 17 / 32
    bf16, _ = compile_model(c.ref)
    assert plan["predicted"]["weight_bytes"] < 0.4 * bf16["predicted"]["weight_bytes"]


def test_traced_graph_is_the_unquantized_models_and_computes_in_bf16(mx):
    c = mx()
    g, _ = build_graph(c.path)
    ref, _ = build_graph(c.ref)
    assert [(n.name, n.op, n.shape, sorted(n.weights), n.attrs) for n in g.nodes] == \
           [(n.name, n.op, n.shape, sorted(n.weights), n.attrs) for n in ref.nodes]
    assert all(w.shape == ref.node(n.name).weights[k].shape for n in g.nodes for k, w in n.weights.items())
    assert g.info.extra["quantization"] == {"method": "mxfp4", "format": "mxfp4", "block": [1, 32]}
    ckpt = read_checkpoint(c.path)
    assert {loc.dtype for loc in ckpt.tensors.values()} == {"uint8", "bfloat16"}
    assert compute_dtype(ckpt, load_config(ckpt)) == "bfloat16"


@pytest.mark.parametrize("name", ["model.layers.0.self_attn", "model.layers.11.self_attn.q_proj",
                                  "model.layers.3.mlp.router", "model.layers.3.mlp.experts", "model.embed_tokens",
                                  "lm_head", "model.layers.1.mlp.routers", "model.norm"])
def test_modules_to_not_convert_match_as_transformers_matches_them(mx, name):
    from transformers.quantizers.quantizers_utils import should_convert_module

    q = quantization(read_checkpoint(mx().path))
    assert q is not None and q.skip == tuple(MXFP4_QUANTIZATION_CONFIG["modules_to_not_convert"])
    assert q.skips(f"{name}.weight") == (not should_convert_module(name, list(q.skip)))


# -- refusals -----------------------------------------------------------------------------
@pytest.mark.parametrize("tensor,keep,want", [
    ("model.layers.1.mlp.experts.down_proj_scales", lambda t: t[:, :, :2], "[32, 64, 3]"),  # a group short
    ("model.layers.0.mlp.experts.gate_up_proj_blocks", lambda t: t[:, :-1], "[32, 192, 2, 16]"),  # a row short
])
def test_blocks_or_scales_of_the_wrong_shape_are_refused_naming_tensor_and_shapes(mx, tmp_path, tensor, keep, want):
    path = tmp_path / "m"
    shutil.copytree(mx().path, path)
    got: list[list[int]] = []

    def cut(t: dict) -> None:
        t[tensor] = keep(t[tensor]).contiguous()
        got.append(list(t[tensor].shape))

    _rewrite(path, cut)
    with pytest.raises(CheckpointError) as e:
        compile_model(path)
    msg = str(e.value)
    assert tensor in msg and str(got[0]) in msg and want in msg and "model.safetensors" in msg


def _with_config(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_blocks_without_a_quantization_config_are_refused(mx, tmp_path):
    path = _with_config(mx().path, tmp_path / "m", lambda cfg: cfg.pop("quantization_config"))
    with pytest.raises(CheckpointError, match=r"gate_up_proj_blocks holds MXFP4 blocks but .*config.json has no "
                                              r"quantization_config"):
        compile_model(path)


def test_mxfp4_is_read_for_gpt_oss_only_and_gpt_oss_in_other_methods_is_refused(mx, tmp_path):
    src = write_checkpoint(tmp_path / "qwen", "qwen3_moe")
    qwen = _with_config(src, tmp_path / "q", lambda cfg: cfg.update(quantization_config=MXFP4_QUANTIZATION_CONFIG))
    with pytest.raises(UnsupportedModelError) as e:
        compile_model(qwen)
    msg = str(e.value)
    assert "quantization_config.quant_method" in msg and "gpt_oss only" in msg and '"qwen3_moe"' in msg
    assert f"supported: {', '.join(QUANT_METHODS)}" in msg
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    path = _with_config(mx().ref, tmp_path / "g", lambda cfg: cfg.update(quantization_config=fp8))
    with pytest.raises(UnsupportedModelError, match="quantization_config fp8 for gpt-oss experts .* mxfp4"):
        compile_model(path)


# -- the published configs, without weights -------------------------------------------------
@pytest.mark.slow
def test_gpt_oss_20b_mxfp4_config_plans_at_24gb_in_a_third_of_the_bf16_bytes():
    """The published gpt-oss-20b config.json (quantization_config included) plans at 24GB:
    its experts at 17/32 byte per weight, the rest bf16: about 13.8 GB (the release's
    files) against 41.8 GB in bf16."""
    plan, g = compile_model(CONFIGS / "gpt-oss-20b-mxfp4", gpu_mem=parse_size("24GB"), hardware="a5000",
                            prompt_tokens=512, output_tokens=256)
    bf16, _ = build_graph(CONFIGS / "gpt-oss-20b")
    assert 11e9 < plan["predicted"]["weight_bytes"] < 15e9 and 40e9 < bf16.weight_bytes < 43e9
    assert plan["arena"]["bytes"] <= parse_size("24GB") and plan["predicted"]["decode_tokens_per_s"] > 0
    q = [e for e in plan["weights"].values() if e.get("format") == "mxfp4"]
    assert len(q) == 24 * 32 * 2
    e = next(e for e in q if e["tensor"] == "model.layers.0.mlp.experts.gate_up_proj_blocks")
    assert e["shape"] == [5760, 90, 16] and e["parts"]["scale"]["shape"] == [5760, 90]
    assert e["logical_shape"] == [2880, 5760] and e["file"] is None
    dense = {e["tensor"].split(".")[-2] for e in plan["weights"].values() if e.get("format", "dense") == "dense"}
    assert {"router", "q_proj", "o_proj", "embed_tokens", "lm_head", "experts"} <= dense  # experts: the biases


@pytest.mark.slow
def test_gpt_oss_120b_mxfp4_config_counts_the_release_bytes():
    """gpt-oss-120b in MXFP4: about 65 GB (the release's files) against 233 GB in bf16."""
    g, _ = build_graph(CONFIGS / "gpt-oss-120b-mxfp4")
    bf16, _ = build_graph(CONFIGS / "gpt-oss-120b")
    assert 60e9 < g.weight_bytes < 70e9 and 230e9 < bf16.weight_bytes < 236e9
    experts = [w for n in g.nodes if n.op == "experts" for k, w in n.weights.items() if not k.endswith("bias")]
    assert len(experts) == 36 * 128 * 2 and all(w.format == "mxfp4" for w in experts)
