"""`moecc compile --dtype auto|fastest|bfloat16|float16|float32` (issue 33, C): the plan records the
compute dtype (model.info.dtype, and why in info.extra.dtype, which `moecc explain` prints);
the runtime casts every floating weight stored in another dtype to it when it reads it, and
computes activations, attention and the KV cache in it. A bf16 checkpoint compiled with
--dtype float32 is token-identical to transformers in fp32 on the upcast weights."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from moecc.cli import app
from moecc.compiler import compile_model
from moecc.testing.checkpoints import write_checkpoint
from moecc.views.explain import explain, format_explain
from moecc_runtime.scheduler.sequence import GenRequest
from tests.e2e.test_equivalence import _prompts, _reference
from tests.runtime.formats.test_fp8 import _assert_matches, _run

SMALL = dict(prompt_tokens=16, output_tokens=8, max_batch=4)
NEW = 5

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dt") / "bf16", "qwen3_moe", dtype="bfloat16")


def test_float32_of_a_bf16_checkpoint_matches_transformers_fp32_on_the_upcast_weights(bf16):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(bf16), dtype=torch.float32).eval()  # upcast: exact
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tok = AutoTokenizer.from_pretrained(str(bf16))
    reqs = [GenRequest(str(i), tok(p)["input_ids"], NEW) for i, p in enumerate(_prompts(3))]
    ref = {r.key: _reference(model, r.prompt_ids, NEW) for r in reqs}
    plan, _ = compile_model(bf16, dtype="float32", **SMALL)
    info = plan["model"]["info"]
    assert info["dtype"] == "float32" and info["extra"]["dtype"]["auto"] == "bfloat16"
    assert {e["dtype"] for e in plan["weights"].values()} == {"bfloat16"}  # stored as they are
    _assert_matches(_run(plan, bf16, reqs), ref, 1e-4)


def test_explain_says_which_dtype_runs_and_why(bf16, tmp_path):
    auto, _ = compile_model(bf16, **SMALL)
    assert auto["model"]["info"]["dtype"] == "bfloat16"
    text = format_explain(explain(auto))
    assert "computes in bfloat16: --dtype auto: every weight is stored in bfloat16" in text
    half, _ = compile_model(bf16, dtype="float16", **SMALL)
    assert "computes in float16: --dtype float16 (auto would be bfloat16)" in format_explain(explain(half))


def test_an_unknown_dtype_is_refused_naming_the_option(bf16, tmp_path):
    out = CliRunner().invoke(app, ["compile", str(bf16), "--dtype", "fp8", "-o", str(tmp_path / "p.pt")])
    assert out.exit_code == 1 and "--dtype must be one of auto, fastest, bfloat16, float16, float32" in out.output


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dt") / "fp32", "qwen3_moe")


@pytest.mark.parametrize("hardware, want", [("cpu", "bfloat16"), ("t4", "float32"), ("a5000", "bfloat16")])
def test_fastest_takes_bf16_for_an_fp32_model_only_where_the_hardware_computes_it_faster(fp32, hardware, want):
    plan, _ = compile_model(fp32, dtype="fastest", hardware=hardware, **SMALL)
    info = plan["model"]["info"]
    assert info["dtype"] == want and info["extra"]["dtype"]["auto"] == "float32"
    why = info["extra"]["dtype"]["why"]
    assert why.startswith("--dtype fastest") and "GFLOP/s" in why


def test_fastest_keeps_a_bf16_model_in_bf16(bf16):
    plan, _ = compile_model(bf16, dtype="fastest", **SMALL)
    assert plan["model"]["info"]["dtype"] == "bfloat16"
