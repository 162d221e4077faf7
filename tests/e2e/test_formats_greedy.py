"""Greedy output of the integer and FP4 library formats (issue 33): GPTQ, AWQ (gemm),
compressed-tensors and ModelOpt NVFP4 checkpoints (moecc.testing.quantized_libs, each
packed as its library's source packs it), token-identical to transformers running the
exactly dequantized weights in fp32 (each library's own dequantization, loaded as an
unquantized checkpoint), logits within 1e-4. Each format on three families (Mixtral,
Qwen3-MoE, OLMoE) in place; resident and streamed through an arena below the stored weights
(--gpu-mem) on one family.

Sources of the packings: AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py
(QuantLinear.pack / forward), AutoAWQ awq/modules/linear/gemm.py (WQLinear_GEMM.from_linear)
and awq/utils/packing_utils.py (dequantize_gemm), compressed-tensors (installed: its own
compressors write and read the files), TensorRT-Model-Optimizer
modelopt/torch/quantization/qtensor/nvfp4_tensor.py (NVFP4QTensor.quantize / dequantize)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moecc.compiler import compile_model
from moecc.frontend.checkpoint import read_checkpoint
from moecc.testing import quantized_libs as L
from moecc.testing.checkpoints import write_checkpoint
from moecc.testing.quantized import write_dequantized_checkpoint
from moecc_runtime.scheduler.sequence import GenRequest
from tests.e2e.test_equivalence import _prompts, _reference
from tests.runtime.formats.test_fp8 import _assert_matches, _run

NEW = 4
FAMILIES = ("mixtral", "qwen3_moe", "olmoe")
#: streamed: 32 experts, so the routed experts outweigh a module's working set and an arena
#: below the weights runs
STREAMED = ("qwen3_moe", dict(num_experts=32))
SMALL = dict(prompt_tokens=16, output_tokens=8, max_batch=4)  # a quick plan: the tests check output, not sizes
FORMATS = {  # name -> writer(src, out)
    "gptq4_act": lambda s, o: L.write_gptq_checkpoint(s, o, bits=4, group=16, desc_act=True, sym=True),
    "gptq4": lambda s, o: L.write_gptq_checkpoint(s, o, bits=4, group=16, desc_act=False, sym=True),
    "gptq8_asym_v2": lambda s, o: L.write_gptq_checkpoint(s, o, bits=8, group=-1, sym=False, version="gptq_v2"),
    "awq": lambda s, o: L.write_awq_checkpoint(s, o, group=16),
    "ct_w4_asym": lambda s, o: L.write_ct_checkpoint(s, o, scheme="w4_group_asym", attention_scheme="fp8_channel"),
    "ct_w4_sym": lambda s, o: L.write_ct_checkpoint(s, o, scheme="w4_group_sym", attention_scheme="fp8_channel"),
    "ct_w8_naive": lambda s, o: L.write_ct_checkpoint(s, o, scheme="w8_naive_channel", attention_scheme="fp8_tensor"),
    "nvfp4": lambda s, o: L.write_nvfp4_checkpoint(s, o, exclude=("lm_head", "model.layers.0.self_attn*")),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """case(format, family) -> (quantized dir, requests, reference greedy output), made once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("libfmt")
    cache: dict = {}

    def get(fmt: str, family: str, streamed: bool):
        if (fmt, family, streamed) not in cache:
            d = root / (family + ("-streamed" if streamed else ""))
            src = d / "src"
            if not src.exists():
                write_checkpoint(src, family, **(STREAMED[1] if streamed else {}))
            path = FORMATS[fmt](src, d / fmt)
            ref = write_dequantized_checkpoint(path, d / f"{fmt}-ref", dtype="float32")
            model = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32, experts_implementation="eager")
            tok = AutoTokenizer.from_pretrained(str(ref))
            reqs = [GenRequest(str(i), tok(p)["input_ids"], NEW) for i, p in enumerate(_prompts(3))]
            cache[(fmt, family, streamed)] = (path, reqs, {r.key: _reference(model.eval(), r.prompt_ids, NEW)
                                                           for r in reqs})
        return cache[(fmt, family, streamed)]

    return get


def _streamed(path: Path, fraction: float) -> dict:
    """A plan whose arena holds `fraction` of the stored weights: the experts stream."""
    stored = sum(loc.nbytes for loc in read_checkpoint(path).tensors.values())  # the plan's weight bytes
    gpu_mem = int(stored * fraction)
    plan, _ = compile_model(path, gpu_mem=gpu_mem, **SMALL)
    assert plan["predicted"]["weight_bytes"] <= stored  # less what is never read (weight_shape, input_scale)
    lay = plan["arena"]
    assert lay is not None and lay["bytes"] <= gpu_mem < plan["predicted"]["weight_bytes"]
    assert lay["expert_slots"] >= 1 and not any(g.endswith(".experts") for g in lay["resident"]), "experts stream"
    return plan


_CASES = [(f, fam, False) for f in ("gptq4_act", "gptq4", "awq", "ct_w4_asym", "ct_w4_sym", "nvfp4")
          for fam in FAMILIES] + \
         [("gptq8_asym_v2", "qwen3_moe", False), ("ct_w8_naive", "olmoe", False)] + \
         [(f, STREAMED[0], True) for f in ("gptq4_act", "awq", "ct_w4_asym", "nvfp4")]


@pytest.mark.parametrize("fmt,family,streamed", _CASES)
def test_greedy_matches_transformers_on_the_librarys_dequantized_weights(case, fmt, family, streamed):
    path, reqs, ref = case(fmt, family, streamed)
    plan = _streamed(path, 0.7) if streamed else compile_model(path, **SMALL)[0]
    assert plan["model"]["info"]["dtype"] == "float32"
    formats = {e.get("format", "dense") for e in plan["weights"].values()}
    assert len(formats - {"dense"}) >= 1
    _assert_matches(_run(plan, path, reqs), ref, 1e-4)
