"""A checkpoint changed after compile, a plan naming files outside its checkpoint, and
malformed safetensors headers: each refused with a message naming what and where, never
run on the wrong bytes (issue 20, items 1, 6 and 7)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from moecc.compiler import compile_model
from moecc.errors import MoeccError
from moecc_runtime.job.exec import run_job
from moecc_runtime.plan import PlanError, check_checkpoint, save_plan


def _read(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path: Path, header: dict, data: bytes, size: int | None = None) -> None:
    """Write a safetensors file, padding the header to `size` bytes when given (so the file
    keeps its length and the fingerprint's sizes still match)."""
    text = json.dumps(header, separators=(",", ":")).encode()
    if size is not None:
        assert len(text) <= size
        text += b" " * (size - len(text))
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.fixture()
def job(checkpoints, tmp_path) -> tuple[Path, Path, Path]:
    """(checkpoint copy, its plan, prompts)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints("mixtral"), ckpt)
    plan, _ = compile_model(ckpt, prompt_tokens=16, output_tokens=4, max_batch=4)
    save_plan(plan, tmp_path / "plan.pt")
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "prompt": "The kettle", "max_tokens": 3}\n')
    return ckpt, tmp_path / "plan.pt", tmp_path / "in.jsonl"


def _header_size(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_relaid_out_tensors_are_refused(job):
    ckpt, plan, prompts = job
    f = ckpt / "model.safetensors"
    header, data = _read(f)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: -header[k]["data_offsets"][0])
    at, chunks = 0, []
    for k in names:  # the same tensors, their bytes in reverse order
        b, e = header[k]["data_offsets"]
        chunks.append(data[b:e])
        header[k]["data_offsets"] = [at, at + e - b]
        at += e - b
    size = f.stat().st_size
    _write(f, header, b"".join(chunks), _header_size(f))
    assert f.stat().st_size == size
    with pytest.raises(PlanError, match="tensor layout"):
        run_job(plan, prompts, plan.parent / "out.jsonl", log=None)
    assert not (plan.parent / "out.jsonl").exists() or (plan.parent / "out.jsonl").read_text() == ""


def test_swapped_tensor_names_are_refused(job):
    ckpt, plan, prompts = job
    f = ckpt / "model.safetensors"
    header, data = _read(f)
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert header[q]["shape"] == header[o]["shape"]
    header[q], header[o] = header[o], header[q]
    _write(f, header, data, _header_size(f))
    with pytest.raises(PlanError, match="tensor layout"):
        check_checkpoint(__import__("torch").load(plan, weights_only=True))


@pytest.mark.parametrize("name", ["/etc/passwd", "../../../../bin/bash", "sub/model.safetensors", ".."])
def test_manifest_files_outside_the_checkpoint_are_refused(job, name):
    import torch

    ckpt, plan_path, _ = job
    plan = torch.load(plan_path, weights_only=True)
    key = next(iter(plan["weights"]))
    plan["weights"][key]["file"] = name
    with pytest.raises(PlanError, match=r"not a file name inside the checkpoint directory") as e:
        check_checkpoint(plan)
    assert key in str(e.value)


def test_manifest_offset_that_is_not_the_slice_is_refused(job):
    import torch

    _, plan_path, _ = job
    plan = torch.load(plan_path, weights_only=True)
    key = next(k for k, e in plan["weights"].items() if e["file"])
    plan["weights"][key]["offset"] += 4
    with pytest.raises(PlanError, match=rf"plan.weights\['{key}'\]: names bytes at"):
        check_checkpoint(plan)


def _corrupt(path: Path, how) -> None:
    header, data = _read(path)
    name = next(k for k in header if k != "__metadata__" and header[k]["shape"])
    how(header, name)
    _write(path, header, data)


@pytest.mark.parametrize(("how", "message"), [
    (lambda h, n: h[n].update(data_offsets=[-8, h[n]["data_offsets"][1]]), "0 <= begin <= end"),
    (lambda h, n: h[n].update(data_offsets=h[n]["data_offsets"][::-1]), "0 <= begin <= end"),
    (lambda h, n: h[n].update(data_offsets=[h[n]["data_offsets"][0], h[n]["data_offsets"][0] + 4]), "needs"),
    (lambda h, n: h[n].update(data_offsets=[float(x) for x in h[n]["data_offsets"]]), "two integers"),
    (lambda h, n: h[n].update(shape=[-1]), "non-negative integers"),
    (lambda h, n: h[n].update(dtype="Q4"), "unsupported dtype"),
])
def test_malformed_headers_fail_compile_naming_file_and_tensor(checkpoints, tmp_path, how, message):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints("mixtral"), ckpt)
    _corrupt(ckpt / "model.safetensors", how)
    with pytest.raises(MoeccError, match=message) as e:
        compile_model(ckpt, prompt_tokens=16, output_tokens=4, max_batch=4)
    assert "model.safetensors" in str(e.value)


def test_header_that_is_a_list_or_overlapping_fails_compile(checkpoints, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints("mixtral"), ckpt)
    f = ckpt / "model.safetensors"
    header, data = _read(f)
    _write(f, [1, 2], data)  # type: ignore[arg-type]
    with pytest.raises(MoeccError, match="header is a JSON list"):
        compile_model(ckpt)
    names = [k for k in header if k != "__metadata__"]
    a, b = sorted(names, key=lambda k: header[k]["data_offsets"][0])[:2]
    header[b]["data_offsets"] = [x - 4 for x in header[b]["data_offsets"]]  # into the tensor before it
    _write(f, header, data)
    with pytest.raises(MoeccError, match="overlaps|gap"):
        compile_model(ckpt)
