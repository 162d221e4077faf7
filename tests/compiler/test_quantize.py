"""`moecc compile --quantize int8|int4` (moecc/quantize/, the pass quantize_weights, the formats
runtime/formats/int8_channel.py and int4_group.py): on the trained demo model the held-out
perplexity through moecc's runtime stays within 1% (int8) and 5% (int4) of the unquantized
model's; the experts' stored bytes drop 2x / 4x against bf16; the quantized plan runs resident
and streamed; its weights live in one sidecar file beside the plan, checked at exec (missing
or changed: refused, naming the file); the checkpoint is never written; checkpoints already
quantized and unknown options are refused; dequantize(quantize(w)) stays within half a step."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import shutil
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moecc.compiler import compile_model
from moecc.errors import MoeccError
from moecc_runtime.engine import Engine
from moecc_runtime.formats import int4_group, int8_channel, materialize
from moecc_runtime.perplexity import plan_perplexity, score, text_ids
from moecc_runtime.plan import PlanError, check_checkpoint, load_plan, save_plan, sidecar_path

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo-model"
RECORD = json.loads((DEMO / "training.json").read_text(encoding="utf-8"))
HELDOUT = DEMO / "heldout.txt"
WINDOW = RECORD["window"]
UNQUANTIZED = RECORD["heldout_perplexity"]  # moecc's own figure matches it (tests/e2e/test_demo_model.py)
#: --gpu-mem below the int4 plan's 4.4 MB of weights, above its minimum working set
STREAMED_GPU_MEM = 4_200_000


def _digest(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir())}


def _compile(path: Path, model: Path = DEMO, **kw):
    plan, graph = compile_model(model, prompt_tokens=WINDOW, output_tokens=16, max_batch=8, output=path, **kw)
    save_plan(plan, path)
    return plan, graph


@pytest.fixture(scope="module")
def demo_before() -> dict[str, str]:
    """The demo checkpoint's bytes before any compile of this module."""
    return _digest(DEMO)


@pytest.fixture(scope="module")
def plans(tmp_path_factory, demo_before) -> dict[str, tuple[Path, dict, object]]:
    """int8 and int4 (experts, group 128) plans of the demo model: scheme -> (path, plan, graph)."""
    d = tmp_path_factory.mktemp("quantized")
    out = {}
    for scheme in ("int8", "int4"):
        path = d / f"{scheme}.pt"
        out[scheme] = (path, *_compile(path, quantize=scheme))
    return out


def _expert_keys(plan: dict) -> list[str]:
    return [k for m in plan["schedule"] for op in m["ops"] if op["op"] == "experts" for k in op["weights"].values()]


def _stored_bytes(entry: dict) -> int:
    return entry["nbytes"] + sum(p["nbytes"] for p in entry.get("parts", {}).values())


# -- quality -------------------------------------------------------------------------------
@pytest.mark.parametrize(("scheme", "tolerance"), [("int8", 0.01), ("int4", 0.05)])
@pytest.mark.slow
def test_heldout_perplexity_stays_close_to_the_unquantized_model(plans, scheme, tolerance):
    path, _, _ = plans[scheme]
    res = plan_perplexity(path, HELDOUT, window=WINDOW, device="cpu")
    print(f"{scheme}: held-out perplexity {res.value:.4f} (unquantized {UNQUANTIZED})")
    assert res.tokens == RECORD["heldout_tokens"] - 1
    assert res.value == pytest.approx(UNQUANTIZED, rel=tolerance)


# -- stored bytes --------------------------------------------------------------------------
@pytest.mark.parametrize(("scheme", "fmt", "least"), [("int8", "int8_channel", 1.9), ("int4", "int4_group", 3.5)])
def test_expert_bytes_drop_against_bf16(plans, scheme, fmt, least):
    _, plan, graph = plans[scheme]
    keys = _expert_keys(plan)
    entries = [plan["weights"][k] for k in keys]
    assert all(e["format"] == fmt for e in entries)
    stored = sum(_stored_bytes(e) for e in entries)
    bf16 = sum(2 * e["logical_shape"][0] * e["logical_shape"][1] for e in entries)
    assert bf16 / stored >= least, f"{scheme}: experts {stored} B against {bf16} B in bf16"
    experts = [n for n in graph.nodes if n.op == "experts"]
    assert sum(n.weight_bytes for n in experts) == stored  # what the planner sized
    assert plan["predicted"]["weight_bytes"] == graph.weight_bytes
    dense = [e for k, e in plan["weights"].items() if k not in set(keys)]
    assert all("format" not in e for e in dense)  # scope experts: nothing else changed


def test_scope_all_never_touches_embeddings_norms_routers_or_the_head(tmp_path):
    plan, graph = _compile(tmp_path / "all.pt", quantize="int4", quantize_scope="all", quantize_group_size=64)
    formats = {}
    for m in plan["schedule"]:
        for op in m["ops"]:
            for local, key in op["weights"].items():
                formats.setdefault((op["op"], local), set()).add(plan["weights"][key].get("format", "dense"))
    for (op, local), fmts in formats.items():
        want = "int4_group" if op in ("attention", "experts") else "dense"
        assert fmts == {want}, (op, local, fmts)
    attn = next(e for k, e in plan["weights"].items() if k.endswith("self_attn.q"))
    assert attn["format_attrs"] == {"group": 64}


# -- running it ----------------------------------------------------------------------------
@pytest.mark.slow
def test_quantized_plan_runs_streamed_as_it_runs_resident(plans, tmp_path):
    path, plan, _ = plans["int4"]
    spath = tmp_path / "streamed.pt"
    splan, _ = _compile(spath, quantize="int4", gpu_mem=STREAMED_GPU_MEM)
    assert splan["arena"] is not None and splan["predicted"]["weight_bytes"] > STREAMED_GPU_MEM
    assert not any(g.endswith(".experts") for g in splan["arena"]["resident"])  # experts go through slots
    ids = text_ids(DEMO, HELDOUT.read_text(encoding="utf-8"))[:2 * WINDOW + 1]
    nll = []
    for p, pp in ((plan, path), (splan, spath)):
        engine = Engine(load_plan(pp), check_checkpoint(p, None, pp), "cpu", plan_path=pp)
        try:
            nll.append(score(engine, ids, WINDOW).nll)
        finally:
            engine.close()
    assert nll[1] == pytest.approx(nll[0], rel=1e-5)


def test_gpt_oss_experts_quantize_along_their_input_dimension(checkpoints, tmp_path):
    """gpt-oss computes x @ W (W [in, out]): stored as [out, in], read back transposed."""
    src = checkpoints("gpt_oss")
    ids = list(range(3, 40))
    nll = {}
    for q in (None, "int8"):
        p = tmp_path / f"{q}.pt"
        plan, _ = compile_model(src, prompt_tokens=16, output_tokens=8, max_batch=4, quantize=q, output=p)
        save_plan(plan, p)
        if q:
            e = plan["weights"]["l0.mlp_experts.e0.gate_up"]
            assert e["format_attrs"] == {"transpose": True} and e["shape"] == e["logical_shape"][::-1]
        engine = Engine(plan, src, "cpu", plan_path=p)
        try:
            nll[q] = score(engine, ids, 64).nll
        finally:
            engine.close()
    assert nll["int8"] == pytest.approx(nll[None], rel=0.01)


# -- the sidecar ---------------------------------------------------------------------------
def test_the_plan_names_its_sidecar_only_by_its_own_name(plans):
    path, plan, _ = plans["int4"]
    side = plan["model"]["fingerprint"]["sidecar"]
    assert sidecar_path(path) == path.with_name("int4.pt.weights.safetensors") and sidecar_path(path).is_file()
    assert side["file"] == sidecar_path(path).name and side["size"] == sidecar_path(path).stat().st_size
    assert side["quantize"] == {"scheme": "int4", "group_size": 128, "scope": "experts", "symmetric": False}
    parts = [p for k in _expert_keys(plan) for p in (plan["weights"][k], *plan["weights"][k]["parts"].values())]
    assert parts and all(p["root"] == "plan" and p["file"] == side["file"] for p in parts)
    assert all(Path(e["file"]).name == e["file"] for e in plan["weights"].values() if e["file"])
    with pytest.raises(PlanError, match="plan_path"):
        check_checkpoint(plan)  # the sidecar is found from where the plan is, so that must be said
    forged = copy.deepcopy(plan)
    del forged["model"]["fingerprint"]["sidecar"]
    with pytest.raises(PlanError, match="records none"):
        check_checkpoint(forged, None, path)


def test_exec_refuses_a_missing_or_changed_sidecar(plans, tmp_path):
    from typer.testing import CliRunner

    from moecc.cli import app
    from moecc_runtime.job.exec import run_job

    src, _, _ = plans["int4"]
    job = tmp_path / "job"
    job.mkdir()
    plan, side = job / "plan.pt", sidecar_path(job / "plan.pt")
    shutil.copy(src, plan)
    shutil.copy(sidecar_path(src), side)
    prompts = job / "in.jsonl"
    prompts.write_text(json.dumps({"custom_id": "a", "prompt": "A class definition", "max_tokens": 4}) + "\n")
    assert run_job(plan, prompts, job / "ok.jsonl", log=None, device="cpu").succeeded == 1
    good = side.read_bytes()

    side.unlink()
    out = CliRunner().invoke(app, ["exec", str(plan), str(prompts), "-o", str(job / "a.jsonl"), "-q"])
    assert out.exit_code == 1 and "plan.pt.weights.safetensors" in out.output and "missing" in out.output
    assert "recompile" in out.output and "--quantize int4" in out.output
    side.write_bytes(good + b"\0")
    with pytest.raises(PlanError, match=r"plan\.pt\.weights\.safetensors.*changed since compile.*size"):
        run_job(plan, prompts, job / "b.jsonl", log=None, device="cpu")
    side.write_bytes(good)
    assert not (job / "a.jsonl").exists() and not (job / "b.jsonl").exists()


def test_a_sidecar_of_another_checkpoint_is_refused(plans, tmp_path):
    """Same layout, other weights (a fine-tune): the data digest in its header differs."""
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(DEMO, other)
    tensors = load_file(str(DEMO / "model.safetensors"))
    name = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, str(other / "model.safetensors"))
    _compile(tmp_path / "other.pt", model=other, quantize="int4")
    src, _, _ = plans["int4"]
    plan = tmp_path / "mine.pt"
    shutil.copy(src, plan)
    shutil.copy(sidecar_path(tmp_path / "other.pt"), sidecar_path(plan))
    assert sidecar_path(plan).stat().st_size == sidecar_path(src).stat().st_size
    with pytest.raises(PlanError, match=r"changed since compile.*tensor layout.*recompile"):
        check_checkpoint(load_plan(plan), None, plan)


def test_checkpoint_is_byte_identical_after_compiles(plans, demo_before):
    assert _digest(DEMO) == demo_before
    assert not any(f.name.endswith(".weights.safetensors") for f in DEMO.iterdir())


def test_a_failed_compile_keeps_the_earlier_sidecar(plans, tmp_path):
    src, _, _ = plans["int8"]
    plan = tmp_path / "p.pt"
    shutil.copy(src, plan)
    shutil.copy(sidecar_path(src), sidecar_path(plan))
    before = _digest(tmp_path)
    with pytest.raises(MoeccError, match="gpu-mem"):
        compile_model(DEMO, prompt_tokens=WINDOW, output_tokens=16, max_batch=8, gpu_mem=100_000,
                      quantize="int4", output=plan)
    assert _digest(tmp_path) == before  # no partial file left, the earlier sidecar as it was


# -- refusals ------------------------------------------------------------------------------
def test_an_fp8_checkpoint_is_refused(checkpoints, tmp_path):
    from moecc.testing.quantized import write_fp8_checkpoint

    fp8 = write_fp8_checkpoint(checkpoints("mixtral"), tmp_path / "fp8")
    with pytest.raises(MoeccError, match=r"quantization_config.*'fp8'.*quantized already.*without --quantize"):
        compile_model(fp8, prompt_tokens=16, output_tokens=8, max_batch=4, quantize="int4", output=tmp_path / "p.pt")
    assert [f.name for f in tmp_path.iterdir()] == ["fp8"]


def test_integer_weights_are_refused(checkpoints):
    from moecc.frontend.build import build_graph
    from moecc.quantize import QuantizeError, quantize_spec
    from moecc.quantize.select import refuse_quantized, targets

    graph, ckpt = build_graph(checkpoints("mixtral"))
    spec = quantize_spec("int8")
    picked = targets(graph, spec)
    assert picked and all(t.ref.dtype == "float32" for t in picked)
    refuse_quantized(ckpt, picked, spec)  # a float checkpoint passes
    picked[0] = dataclasses.replace(picked[0], ref=dataclasses.replace(picked[0].ref, dtype="int8"))
    with pytest.raises(QuantizeError, match=rf"tensor {picked[0].ref.tensor} is stored as int8.*quantized already"):
        refuse_quantized(ckpt, picked, spec)


@pytest.mark.parametrize(("args", "said"), [
    (["--quantize", "fp3"], "--quantize: unknown scheme 'fp3'; choose one of int8, int4"),
    (["--quantize", "int4", "--quantize-scope", "everything"], "--quantize-scope: unknown scope 'everything'"),
    (["--quantize", "int4", "--quantize-group-size", "0"], "--quantize-group-size must be a positive"),
])
def test_unknown_options_are_refused(tmp_path, args, said):
    from typer.testing import CliRunner

    from moecc.cli import app

    out = CliRunner().invoke(app, ["compile", str(DEMO), "-o", str(tmp_path / "p.pt"), *args])
    assert out.exit_code == 1 and said in out.output, out.output
    assert list(tmp_path.iterdir()) == []


def test_the_sidecar_needs_a_plan_path_outside_the_checkpoint(tmp_path):
    with pytest.raises(MoeccError, match="no plan path"):
        compile_model(DEMO, quantize="int8")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DEMO, ckpt)
    before = _digest(ckpt)
    with pytest.raises(MoeccError, match="inside the checkpoint directory"):
        compile_model(ckpt, quantize="int8", output=ckpt / "plan.pt")
    assert _digest(ckpt) == before


def test_a_config_only_checkpoint_plans_with_the_stored_bytes_and_writes_nothing(tmp_path):
    config_only = Path(__file__).resolve().parent / "passes" / "data" / "tiny-mixtral"
    plan, graph = compile_model(config_only, prompt_tokens=16, output_tokens=8, max_batch=4, quantize="int4",
                                output=tmp_path / "p.pt")
    experts = [plan["weights"][k] for k in _expert_keys(plan)]
    assert experts and all(e["format"] == "int4_group" and e["file"] is None for e in experts)
    assert all(p["file"] is None for e in experts for p in e["parts"].values())
    assert "sidecar" not in plan["model"]["fingerprint"] and list(tmp_path.iterdir()) == []
    assert graph.attrs["quantized"]["tensors"] == len(experts)


# -- the formats ---------------------------------------------------------------------------
def _entry(fmt: str, stored: dict[str, torch.Tensor], shape: list[int], attrs: dict) -> dict:
    return {"format": fmt, "shape": list(stored["data"].shape), "logical_shape": shape, "format_attrs": attrs}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rows=st.integers(1, 24), cols=st.integers(1, 300), group=st.sampled_from((1, 3, 32, 64, 128)),
       symmetric=st.booleans(), transpose=st.booleans(), spread=st.sampled_from((1e-3, 1.0, 50.0)))
def test_int4_group_dequantizes_within_half_a_step(rows, cols, group, symmetric, transpose, spread):
    torch.manual_seed(rows * 301 + cols)
    w = torch.randn(rows, cols) * spread  # [R, C] as stored: rows = outputs
    w[0, : cols // 2] = 0.0  # a group of zeros (scale 1) where the row holds them
    stored = int4_group.quantize(w, group, symmetric)
    layout = int4_group.stored_layout((rows, cols), group, symmetric)
    assert {k: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in stored.items()} == layout
    attrs = {"group": group, **({"transpose": True} if transpose else {})}
    shape = [cols, rows] if transpose else [rows, cols]
    got = materialize(_entry("int4_group", stored, shape, attrs), stored, torch.float32)
    assert list(got.shape) == shape
    got = got.t() if transpose else got
    step = stored["scale"].repeat_interleave(group, dim=1)[:, :cols]  # [R, C]: each element's group scale
    assert ((got - w).abs() <= step / 2 * (1 + 1e-5) + 1e-12).all()
    assert torch.equal(got[0, : cols // 2], torch.zeros(cols // 2))  # zero is exact
    half = materialize(_entry("int4_group", stored, shape, attrs), stored, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and list(half.shape) == shape


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rows=st.integers(1, 40), cols=st.integers(1, 200), transpose=st.booleans())
def test_int8_channel_dequantizes_within_half_a_step(rows, cols, transpose):
    torch.manual_seed(rows * 201 + cols)
    w = torch.randn(rows, cols) * torch.rand(rows, 1) * 10
    w[-1] = 0.0  # a row of zeros
    stored = int8_channel.quantize(w.to(torch.bfloat16))
    assert stored["data"].dtype == torch.int8 and stored["scale"].dtype == torch.float32
    shape = [cols, rows] if transpose else [rows, cols]
    got = materialize(_entry("int8_channel", stored, shape, {"transpose": True} if transpose else {}), stored,
                      torch.float32)
    got = got.t() if transpose else got
    ref = w.to(torch.bfloat16).float()
    assert ((got - ref).abs() <= stored["scale"][:, None] / 2 * (1 + 1e-5)).all()
    assert torch.equal(got[-1], torch.zeros(cols))


@pytest.mark.slow
def test_explain_and_ray_actors_find_the_sidecar_from_the_plan_path(plans, tmp_path):
    """`moecc explain --prompts` and the Ray actors (ShardRunner, run here without Ray) read a
    quantized plan's weights from beside the plan, as exec does."""
    from moecc.views.explain import explain
    from moecc_runtime.job.distributed import ShardRunner

    path, plan, _ = plans["int8"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"custom_id": "a", "prompt": "A class definition", "max_tokens": 4}\n')
    rep = explain(plan, prompts, plan_path=path)
    experts = rep["weight_formats"]["experts"]
    assert rep["eta"]["requests"] == 1 and experts["formats"] == {"int8_channel": 4 * 8 * 3}  # layers x experts x 3
    assert experts["compute_bytes"] / experts["stored_bytes"] > 3.8  # fp32 -> int8 and an fp32 scale per row
    runner = ShardRunner(plan, plan["model"]["dir"], "cpu", None, 1, plan_path=str(path))
    ids = runner.tok.encode_prompt("A class definition")
    out = runner.run([{"key": "a", "prompt_ids": ids, "max_tokens": 4}])
    assert len(out["results"]) == 1 and len(out["results"][0]["token_ids"]) == 4, out


@pytest.mark.slow
def test_deepseek_v3_int4_plans_within_512gb_and_explain_shows_the_formats():
    """DeepSeek-V3 (1.3 TB in bf16) with --quantize int4 plans within --host-mem 512GB;
    explain shows the experts' format and the bytes saved."""
    from moecc.sizes import parse_size
    from moecc.views.explain import explain, format_explain

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "deepseek-v3"
    plan, _ = compile_model(config, gpu_mem=parse_size("24GB"), host_mem=parse_size("512GB"), hardware="a5000",
                            prompt_tokens=512, output_tokens=256, quantize="int4")
    host = plan["memory"]["host"]
    assert host["weights"] + host["kv_pool"] + host["buffers"] + host["reserve"] <= parse_size("512GB")
    assert plan["batch"]["decode"]["B"] >= 64
    text = format_explain(explain(plan))
    assert re.search(r"experts\s+int4_group x\d+ .*\(3\.[5-9]\dx smaller\)", text), text
