"""The committed demo model (examples/demo-model) is a trained model: its held-out perplexity,
read through the normal loading paths (transformers' and moecc's own), is the one its trainer
recorded, far below a random model's, and its greedy continuations are the same in moecc and
transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from moecc_runtime.plan import save_plan
from moecc.compiler import compile_model
from moecc_runtime.perplexity import plan_perplexity, text_ids, windows

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo-model"
RECORD = json.loads((DEMO / "training.json").read_text(encoding="utf-8"))
HELDOUT = DEMO / "heldout.txt"
WINDOW = RECORD["window"]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(DEMO), local_files_only=True, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def demo_plan(tmp_path_factory) -> Path:
    plan, _ = compile_model(DEMO, prompt_tokens=WINDOW, output_tokens=16, max_batch=8)
    path = tmp_path_factory.mktemp("demo") / "plan.pt"
    save_plan(plan, path)
    return path


@torch.no_grad()
def _hf_perplexity(model, ids: list[int]) -> float:
    nll, n = 0.0, 0
    for w in windows(ids, WINDOW):
        x = torch.tensor(w)
        logits = model(x[None, :-1]).logits[0].float()  # [T, V]
        nll += torch.nn.functional.cross_entropy(logits, x[1:], reduction="sum").item()
        n += len(w) - 1
    return math.exp(nll / n)


def test_record_is_a_trained_model():
    assert RECORD["heldout_perplexity"] * 20 < RECORD["random_init_heldout_perplexity"]
    assert RECORD["parameters"] < 5_000_000
    size = sum(f.stat().st_size for f in DEMO.iterdir())
    assert size < 20 * 2**20, f"examples/demo-model holds {size} bytes"
    cfg = json.loads((DEMO / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"]
    assert cfg["num_local_experts"] >= 4 and cfg["num_experts_per_tok"] == 2


@pytest.mark.slow
def test_transformers_perplexity_is_the_recorded_one(hf_model):
    ids = text_ids(DEMO, HELDOUT.read_text(encoding="utf-8"))
    assert len(ids) == RECORD["heldout_tokens"]
    ppl = _hf_perplexity(hf_model, ids)
    assert ppl == pytest.approx(RECORD["heldout_perplexity"], rel=0.01)


@pytest.mark.slow
def test_moecc_perplexity_matches_transformers(demo_plan, hf_model):
    res = plan_perplexity(demo_plan, HELDOUT, window=WINDOW, device="cpu")
    assert res.tokens == RECORD["heldout_tokens"] - 1
    assert res.value == pytest.approx(RECORD["heldout_perplexity"], rel=0.01)
    ids = text_ids(DEMO, HELDOUT.read_text(encoding="utf-8"))
    assert res.value == pytest.approx(_hf_perplexity(hf_model, ids), rel=1e-4)


@pytest.mark.slow
def test_perplexity_cli(demo_plan, tmp_path):
    from typer.testing import CliRunner

    from moecc.cli import app

    text = tmp_path / "t.txt"
    text.write_text(HELDOUT.read_text(encoding="utf-8")[:2000], encoding="utf-8")
    out = CliRunner().invoke(app, ["perplexity", str(demo_plan), str(text), "--window", "64", "--json"])
    assert out.exit_code == 0, out.output
    rep = json.loads(out.output.strip().splitlines()[-1])
    assert rep["windows"] == -(-rep["tokens"] // 64) and 1 < rep["perplexity"] < 100
    bad = CliRunner().invoke(app, ["perplexity", str(demo_plan), str(tmp_path / "missing.txt")])
    assert bad.exit_code == 1 and "missing.txt" in bad.output


@pytest.mark.slow
def test_greedy_continuations_match_transformers(demo_plan, hf_model, tmp_path):
    from moecc_runtime.job.exec import run_job

    prompts = ['The "for" statement is used to', "A class definition defines"]
    lines = [json.dumps({"custom_id": f"p{i}", "prompt": p, "max_tokens": 24}) for i, p in enumerate(prompts)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    run_job(demo_plan, tmp_path / "in.jsonl", tmp_path / "out.jsonl", log=None, device="cpu")
    got = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEMO), local_files_only=True)
    for i, p in enumerate(prompts):
        ids = tok(p, return_tensors="pt").input_ids
        ref = hf_model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        n = len(got[f"p{i}"]["token_ids"])
        assert got[f"p{i}"]["token_ids"] == ref[:n]
        words = got[f"p{i}"]["text"].split()
        assert len(words) >= 5  # real words, not byte soup
