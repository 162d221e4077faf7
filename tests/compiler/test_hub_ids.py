"""Hub model ids (issue 33, B): `moecc compile ORG/NAME[@REVISION]` resolves through
huggingface_hub's cache (HF_HUB_CACHE / HF_HOME) with HF_HUB_OFFLINE=1: no network. The
cache is built by the test in the Hub's layout (models--ORG--NAME/snapshots/<commit>/,
refs/main, files as symlinks into blobs/), and the plan records the snapshot directory, so
exec reads the same files."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moecc.cli import app
from moecc.compiler import compile_model
from moecc.errors import CheckpointError
from moecc.frontend.checkpoint import read_checkpoint
from moecc_runtime.plan import check_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SMALL = dict(prompt_tokens=16, output_tokens=8, max_batch=4)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest


def _fake_cache(home: Path, src: Path, repo: str = "tiny-org/tiny-moe") -> Path:
    """`src`'s files in a Hub cache under `home` (HF_HOME): blobs by sha256, the snapshot's
    files symlinks to them, refs/main naming the commit. Returns the snapshot directory."""
    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / COMMIT
    (root / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch, checkpoints):
    snap = _fake_cache(tmp_path / "hf", checkpoints("qwen3_moe"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snap


def test_an_id_compiles_from_the_cache_and_the_plan_names_the_snapshot(hub):
    for model in ("tiny-org/tiny-moe", "tiny-org/tiny-moe@main", f"tiny-org/tiny-moe@{COMMIT}"):
        plan, _ = compile_model(model, **SMALL)
        assert plan["model"]["dir"] == str(hub.resolve())
        assert check_checkpoint(plan) == hub.resolve()  # exec finds the same files
    assert read_checkpoint("tiny-org/tiny-moe").has_weights


def test_a_missing_id_or_revision_fails_in_one_line_naming_it(hub, tmp_path):
    for model in ("tiny-org/absent-moe", "tiny-org/tiny-moe@v9"):
        with pytest.raises(CheckpointError) as e:
            read_checkpoint(model)
        msg = str(e.value)
        assert msg.startswith(f"{model}: ") and "\n" not in msg and "HF_HUB_OFFLINE" in msg
    out = CliRunner().invoke(app, ["compile", "tiny-org/absent-moe", "-o", str(tmp_path / "p.pt")])
    assert out.exit_code == 1
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: tiny-org/absent-moe: ")
