"""Mixed-dtype checkpoints run, and compute as transformers does.

A common layout keeps the big matrices in bf16 and the norms and routers in fp32. moecc
computes in the dtype transformers' `from_pretrained(dir)` (default dtype="auto") loads the
model in: config.json's dtype, else the first floating tensor's by name; the runtime casts
each slice of another dtype when it reads it (the manifest keeps the file dtype), except
DeepSeek's router weights, which transformers keeps in fp32 and moecc's router reads in fp32.

The reference is transformers loading the same directory with its default dtype; its
experts run with experts_implementation="eager" (its default grouped_mm kernel rounds
bf16 differently; tests/e2e/test_equivalence.py does the same)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moecc.compiler import compile_model
from moecc.frontend.checkpoint import read_checkpoint
from moecc.frontend.config import compute_dtype, load_config
from moecc.testing.checkpoints import FAMILY_CLASSES, write_checkpoint
from moecc_runtime.engine import Engine, generate
from moecc_runtime.scheduler.sequence import GenRequest
from tests.e2e.test_equivalence import _prompts

NEW_TOKENS = 8
FP32 = ("norm", "mlp.gate.weight")  # norms and routers kept in fp32, everything else bf16


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """mixed(family, layout, config_dtype=None) -> a bf16 checkpoint with fp32 norms and
    routers (config.json's dtype replaced by `config_dtype`, or removed with "")."""
    root = tmp_path_factory.mktemp("mixed")
    cache: dict[tuple, Path] = {}

    def get(family: str, layout: str = "per_expert", config_dtype: str | None = None,
            fp32: tuple[str, ...] = FP32) -> Path:
        key = (family, layout, config_dtype, fp32)
        if key not in cache:
            d = root / f"{family}-{layout}-{config_dtype}-{len(cache)}"
            write_checkpoint(d, family, layout=layout, dtype="bfloat16", fp32_params=fp32)
            if config_dtype is not None:
                cfg = json.loads((d / "config.json").read_text())
                cfg.pop("dtype", None)
                if config_dtype:
                    cfg["dtype"] = config_dtype
                (d / "config.json").write_text(json.dumps(cfg))
            cache[key] = d
        return cache[key]

    return get


def _file_dtypes(path: Path) -> set[str]:
    return {loc.dtype for loc in read_checkpoint(path).tensors.values()}


def _hf(path: Path):
    """transformers as a user loads the directory: default dtype; eager experts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), experts_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def _hf_greedy(model, ids: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), [l[0].float() for l in out.logits]


def _moecc(plan: dict, path: Path, reqs: list[GenRequest]) -> dict:
    engine = Engine(plan, path, "cpu", expert_chunk=7, attn_micro_batch=5, attention="device")  # SDPA rounding (see test_equivalence)
    results: dict = {}
    try:
        generate(engine, reqs, lambda r: results.__setitem__(r.key, r), record_logits=True)
    finally:
        engine.close()
    return results


@pytest.mark.parametrize("config_dtype,fp32,expected", [
    (None, FP32, "bfloat16"),  # config.json says bfloat16 (as save_pretrained wrote it)
    ("", FP32, "bfloat16"),  # no dtype in config.json: the first floating tensor by name (lm_head, bf16)
    ("", ("norm", "lm_head"), "float32"),  # ... which is fp32 here
    ("float32", FP32, "float32"),  # config.json's dtype wins over the weights'
])
def test_compute_dtype_is_transformers_default(mixed, config_dtype, fp32, expected):
    """moecc's compute dtype is the dtype from_pretrained(dir) loads the model in."""
    path = mixed("mixtral", config_dtype=config_dtype, fp32=fp32)
    assert _file_dtypes(path) == {"bfloat16", "float32"}
    ckpt = read_checkpoint(path)
    model, _ = _hf(path)
    assert str(model.dtype) == f"torch.{expected}"
    assert {p.dtype for p in model.parameters()} == {model.dtype}  # transformers casts every tensor
    assert compute_dtype(ckpt, load_config(ckpt)) == expected


def test_uniform_weights_decide_over_config(tmp_path):
    """The one documented difference: weights all of one dtype are computed in it, read in
    place, even when config.json names another (transformers would cast them all)."""
    path = write_checkpoint(tmp_path / "m", "mixtral", dtype="float32", num_hidden_layers=1)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    ckpt = read_checkpoint(path)
    assert compute_dtype(ckpt, load_config(ckpt)) == "float32"


@pytest.fixture(scope="module")
def mixed_runs(mixed):
    """family -> (path, in-place plan, requests, moecc results, transformers' greedy output)."""
    cache: dict = {}

    def get(family: str, layout: str):
        if (family, layout) not in cache:
            path = mixed(family, layout)
            model, tok = _hf(path)
            reqs = [GenRequest(str(i), tok(p)["input_ids"], NEW_TOKENS) for i, p in enumerate(_prompts(8))]
            plan, _ = compile_model(path)
            ref = {r.key: _hf_greedy(model, r.prompt_ids, NEW_TOKENS) for r in reqs}
            cache[family, layout] = (path, plan, reqs, _moecc(plan, path, reqs), ref)
        return cache[family, layout]

    return get


@pytest.mark.parametrize("family,layout", [("mixtral", "per_expert"), ("qwen3_moe", "fused")])
@pytest.mark.slow
def test_mixed_greedy_matches_transformers(mixed_runs, family, layout):
    """bf16 matrices with fp32 norms and routers: token-identical to transformers, and the
    first step's logits bit-identical (the fp32 tensors are cast to bf16 as it casts them)."""
    path, plan, reqs, got, ref = mixed_runs(family, layout)
    assert plan["model"]["info"]["dtype"] == "bfloat16"
    norms = [e for e in plan["weights"].values() if "norm" in e["tensor"]]
    assert norms and all(e["dtype"] == "float32" for e in norms)  # the manifest keeps the file dtype
    for r in reqs:
        assert got[r.key].token_ids == ref[r.key][0], f"prompt {r.key} ({len(r.prompt_ids)} tokens)"
        assert torch.equal(got[r.key].logits[0], ref[r.key][1][0]), f"prompt {r.key}"


@pytest.mark.slow
def test_streamed_mixed_plan_gives_the_same_tokens(mixed_runs):
    """A --gpu-mem below the weights: slices stream through the arena as cast, same tokens."""
    path, _, reqs, in_place, ref = mixed_runs("mixtral", "per_expert")
    gpu_mem = 700_000
    # _moecc runs attention on the device: the plan must give it KV buffers
    plan, _ = compile_model(path, prompt_tokens=24, output_tokens=8, max_batch=4, gpu_mem=gpu_mem, attention="device")
    assert plan["arena"] is not None and plan["arena"]["bytes"] <= gpu_mem < plan["predicted"]["weight_bytes"]
    assert not any(g.endswith(".experts") for g in plan["arena"]["resident"]), "experts must stream"
    got = _moecc(plan, path, reqs)
    for r in reqs:
        assert got[r.key].token_ids == in_place[r.key].token_ids == ref[r.key][0], f"prompt {r.key}"


def test_fp32_routers_are_those_transformers_keeps_in_fp32():
    """transformers keeps DeepSeek's router weights in fp32 whatever the dtype
    (_keep_in_fp32_modules_strict); those are the routers moecc marks `fp32_weights`."""
    strict = {f: cls._keep_in_fp32_modules_strict for f, (_, cls) in FAMILY_CLASSES.items()
              if cls._keep_in_fp32_modules_strict}
    assert set(strict) == {"deepseek_v2", "deepseek_v3"}
    assert all("gate.weight" in keep for keep in strict.values())


def test_deepseek_router_reads_its_fp32_gate_as_stored(mixed):
    """bf16 compute: DeepSeek-V2's fp32 router gate is not rounded to bf16 (the runtime skips
    the cast for `fp32_weights` ops), the fp32 norms are; the plan runs."""
    from safetensors import safe_open

    from moecc_runtime.worker.worker import Worker

    path = mixed("deepseek_v2")
    plan, _ = compile_model(path)
    assert plan["model"]["info"]["dtype"] == "bfloat16"
    routers = [op for m in plan["schedule"] for op in m["ops"] if op["op"] == "router"]
    assert routers and all(op["attrs"]["fp32_weights"] for op in routers)
    worker = Worker(plan, path, "cpu")
    try:
        gate_key = routers[0]["weights"]["weight"]
        gate = worker.store.host(gate_key)
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            stored = f.get_tensor(plan["weights"][gate_key]["tensor"])
        assert gate.dtype == torch.float32 and torch.equal(gate, stored)
        assert stored.to(torch.bfloat16).float().ne(stored).any(), "the gate must need fp32 to be exact"
        norm_key = next(k for k, e in plan["weights"].items() if "layernorm" in e["tensor"])
        assert plan["weights"][norm_key]["dtype"] == "float32"
        assert worker.store.host(norm_key).dtype == torch.bfloat16
        assert worker.store.host(norm_key) is worker.store.host(norm_key)  # cast once, kept
    finally:
        worker.close()
    _, tok = _hf(path)
    reqs = [GenRequest("0", tok(_prompts(1)[0])["input_ids"], 4)]
    assert len(_moecc(plan, path, reqs)["0"].token_ids) == 4


@pytest.mark.slow
def test_deepseek_bf16_weights_computed_in_fp32_match_transformers(mixed):
    """config.json says float32 over bf16 matrices: both compute in fp32 (the bf16 slices cast
    up when read), token-identical and logits within 1e-4."""
    path = mixed("deepseek_v2", config_dtype="float32")
    model, tok = _hf(path)
    assert model.dtype == torch.float32
    plan, _ = compile_model(path)
    assert plan["model"]["info"]["dtype"] == "float32"
    reqs = [GenRequest(str(i), tok(p)["input_ids"], 6) for i, p in enumerate(_prompts(4))]
    got = _moecc(plan, path, reqs)
    for r in reqs:
        ids, logits = _hf_greedy(model, r.prompt_ids, 6)
        assert got[r.key].token_ids == ids, f"prompt {r.key}"
        assert max((a - b).abs().max().item() for a, b in zip(got[r.key].logits, logits)) < 1e-4


def test_write_checkpoint_keeps_the_named_tensors_in_fp32(mixed):
    """The test helper's option: names containing a fragment stay fp32, config.json records
    the model's dtype (bf16), and transformers loads it."""
    path = mixed("mixtral")
    tensors = read_checkpoint(path).tensors
    fp32 = {n for n, loc in tensors.items() if loc.dtype == "float32"}
    assert fp32 == {n for n in tensors if "norm" in n or n.endswith("block_sparse_moe.gate.weight")}
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
