"""Sidecars that cannot drift (issue 32, item 3): every byte of a plan's quantized weights is
verified before the first step, and the sidecar is bound to the values of the checkpoint
tensors it was made from, not only their headers; a mismatch is refused before any result
file exists, naming the file and the recompile command. A verified pair leaves a stamp that
any later write invalidates. A quantization that makes the weights bigger warns (item 6)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.demo_jobs import DEMO, demo_plan, write_jsonl
from moecc.cli import app
from moecc_runtime.job.exec import run_job
from moecc_runtime.job.integrity import STAMP_SUFFIX, digest_lines, read_metadata, verify_sidecar
from moecc_runtime.memory.safetensors_header import read_header
from moecc_runtime.plan import PlanError, check_checkpoint, load_plan, sidecar_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")
EXPERT = "model.layers.0.block_sparse_moe.experts.0.w1.weight"


@pytest.fixture()
def job(tmp_path) -> tuple[Path, Path]:
    """A private copy of the int8 demo plan and its sidecar, and a one-request prompts file."""
    src = demo_plan("int8")
    plan = tmp_path / "plan.pt"
    shutil.copy(src, plan)
    shutil.copy(sidecar_path(src), sidecar_path(plan))
    return plan, write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": "A class", "max_tokens": 3}])


def flip_low_bits(path: Path, offset: int, count: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = bytes(b ^ 1 for b in f.read(count))
        f.seek(offset)
        f.write(data)


def redo(plan: Path, model: Path = DEMO) -> str:
    return f"recompile with `moecc compile {model} --quantize int8 --quantize-scope experts -o {plan}`"


def test_the_header_records_digests_of_the_data_and_of_its_sources(job):
    plan, _ = job
    meta = read_metadata(sidecar_path(plan))
    names = json.loads(meta["source_tensors"])
    assert EXPERT in names and len(names) == 96 and names == sorted(names)
    ckpt = read_header(DEMO / "model.safetensors").tensors
    from moecc_runtime.job.integrity import tensor_digest

    assert meta["source_sha256"] == digest_lines((n, tensor_digest(DEMO / "model.safetensors", ckpt[n]))
                                                 for n in names)


def test_flipped_bits_in_one_int8_weight_are_refused_before_any_result(job, tmp_path):
    plan, prompts = job
    assert run_job(plan, prompts, tmp_path / "ok.jsonl", log=None, device="cpu").succeeded == 1
    stamp = sidecar_path(plan).with_name(sidecar_path(plan).name + STAMP_SUFFIX)
    assert stamp.is_file()
    loc = read_header(sidecar_path(plan)).tensors[f"{EXPERT}:data"]
    assert loc.dtype == "int8"
    flip_low_bits(sidecar_path(plan), loc.offset, 2000)
    res = CliRunner().invoke(app, ["exec", str(plan), str(prompts), "-o", str(tmp_path / "bad.jsonl"), "-q"])
    assert res.exit_code == 1
    assert res.output == (f"error: {sidecar_path(plan)}: the quantized weights file changed since compile (its bytes "
                          f"differ from the digest its header records); {redo(plan)}\n")
    assert not (tmp_path / "bad.jsonl").exists() and not (tmp_path / "bad.errors.jsonl").exists()
    ppl = CliRunner().invoke(app, ["perplexity", str(plan), str(DEMO / "heldout.txt")])
    assert ppl.exit_code == 1 and ppl.output == res.output


def test_a_fine_tune_with_identical_headers_is_refused(job, tmp_path):
    plan, prompts = job
    tuned = tmp_path / "tuned"
    shutil.copytree(DEMO, tuned)
    loc = read_header(tuned / "model.safetensors").tensors[EXPERT]
    flip_low_bits(tuned / "model.safetensors", loc.offset, 64)  # other values, same header
    check_checkpoint(load_plan(plan), tuned, plan)  # the headers agree: the old check passes
    with pytest.raises(PlanError) as e:
        run_job(plan, prompts, tmp_path / "out.jsonl", model_dir=tuned, log=None, device="cpu")
    assert str(e.value) == (f"{sidecar_path(plan)}: made from other weights than {tuned} holds now (the "
                            f"checkpoint's tensor values differ from those it was quantized from, though their "
                            f"headers match: a fine-tune or an edit); {redo(plan, tuned)}")
    assert not (tmp_path / "out.jsonl").exists()


def test_a_stamp_spares_the_next_run_and_any_write_voids_it(job):
    plan, _ = job
    p = load_plan(plan)
    assert verify_sidecar(p, DEMO, plan) is True  # hashed, stamped
    assert verify_sidecar(p, DEMO, plan) is False  # the stamp holds: nothing hashed
    side = sidecar_path(plan)
    side.write_bytes(side.read_bytes())  # the same bytes, rewritten: a new ctime voids the stamp
    assert verify_sidecar(p, DEMO, plan) is True


def test_a_quantization_that_grows_the_weights_warns(tmp_path):
    res = CliRunner().invoke(app, ["compile", str(DEMO), "-o", str(tmp_path / "p.pt"), "--quantize", "int4",
                                   "--quantize-group-size", "1", "--max-batch", "8"])
    assert res.exit_code == 0, res.output
    warning = [ln for ln in res.output.splitlines() if ln.startswith("warning:")]
    assert warning == ["warning: --quantize int4 --quantize-group-size 1 made the weights bigger: 14.5MiB stored "
                       "against 10.5MiB in the checkpoint (each group's scale and zero point outweigh its values); "
                       "use a larger group (default 128) or no --quantize"]
    ok = CliRunner().invoke(app, ["compile", str(DEMO), "-o", str(tmp_path / "q.pt"), "--quantize", "int4",
                                  "--max-batch", "8"])
    assert ok.exit_code == 0 and "warning:" not in ok.output, ok.output
