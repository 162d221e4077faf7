"""The runtime (`moecc_runtime`, source in runtime/) must never import the compiler
(`moecc`), OR-Tools, networkx or onnx: a plan runs on a machine with only torch,
safetensors and the tokenizer libraries installed."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
RUNTIME_DIR = REPO_ROOT / "runtime"
FORBIDDEN = ("moecc", "ortools", "networkx", "onnx")
RUNTIME_MODULES = (
    "moecc_runtime",
    "moecc_runtime.job.exec",
    "moecc_runtime.engine",
    "moecc_runtime.scheduler.scheduler",
    "moecc_runtime.worker.worker",
    "moecc_runtime.plan",
    "moecc_runtime.memory.weights",
    "moecc_runtime.tokenizer",
    "moecc_runtime.job.requests",
)


def is_forbidden(module: str) -> bool:
    """`moecc` or `moecc.x` (not `moecc_runtime`), and likewise for the other roots."""
    return any(module == root or module.startswith(root + ".") for root in FORBIDDEN)


@pytest.mark.parametrize(
    ("name", "forbidden"),
    [("moecc", True), ("moecc.compiler", True), ("moecc_runtime", False), ("moecc_runtime.job.exec", False),
     ("onnx", True), ("onnx.helper", True), ("onnxruntime", False), ("networkx.algorithms", True),
     ("ortools.linear_solver", True), ("torch", False)],
)
def test_is_forbidden(name: str, forbidden: bool) -> None:
    assert is_forbidden(name) is forbidden


@pytest.fixture(scope="module")
def tiny_checkpoint_and_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Mixtral checkpoint and a plan for it (both made here, with the compiler)."""
    from moecc.compiler import compile_model
    from moecc.testing.checkpoints import write_checkpoint
    from moecc_runtime.plan import save_plan

    root = tmp_path_factory.mktemp("runtime_imports")
    ckpt = write_checkpoint(root / "tiny", "mixtral", seed=0)
    plan, _ = compile_model(ckpt)
    plan_path = root / "plan.pt"
    save_plan(plan, plan_path)
    return ckpt, plan_path


CHILD = textwrap.dedent(
    """
    import importlib, io, json, sys
    from pathlib import Path

    model_dir, plan_path, prompts_path, modules = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    for name in modules:
        importlib.import_module(name)
    from moecc_runtime.tokenizer import Tokenizer
    tok = Tokenizer(Path(model_dir))
    ids = tok.encode_prompt("Hello world")
    after_import = sorted(sys.modules)

    # run a whole job as well, so lazy (function-level) imports would show up too
    from moecc_runtime.job.exec import run_job
    out = io.StringIO()
    summary = run_job(plan_path, prompts_path, out, device="cpu", log=None)
    print(json.dumps({
        "ids": ids,
        "after_import": after_import,
        "after_run": sorted(sys.modules),
        "succeeded": summary.succeeded,
        "results": out.getvalue(),
    }))
    """
)


def test_runtime_never_imports_the_compiler(tiny_checkpoint_and_plan: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, plan_path = tiny_checkpoint_and_plan
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"custom_id": "a", "prompt": "Hello world", "max_tokens": 3}) + "\n"
        + json.dumps({"custom_id": "b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                      "temperature": 0.7, "top_p": 0.9, "top_k": 10, "seed": 1}) + "\n",
        encoding="utf-8",
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(ckpt), str(plan_path), str(prompts), json.dumps(RUNTIME_MODULES)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ids"] and all(isinstance(i, int) for i in report["ids"])
    for name in RUNTIME_MODULES:
        assert name in report["after_import"]
    assert [m for m in report["after_import"] if is_forbidden(m)] == []
    assert report["succeeded"] == 2, report["results"]
    assert [m for m in report["after_run"] if is_forbidden(m)] == []


def _runtime_files() -> list[Path]:
    files = sorted(RUNTIME_DIR.rglob("*.py"))
    assert files, f"no Python files under {RUNTIME_DIR}"
    return files


def _forbidden_imports(path: Path, root: Path = REPO_ROOT) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call):
            # importlib.import_module("x") / __import__("x") with a literal name
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if fname in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names if is_forbidden(n)]
    return found


@pytest.mark.parametrize("path", _runtime_files(), ids=lambda p: p.name)
def test_no_forbidden_import_statements(path: Path) -> None:
    assert _forbidden_imports(path) == []


def test_static_check_catches_forbidden_imports(tmp_path: Path) -> None:
    """The checker itself: every spelling of a forbidden import is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent(
        """
        import moecc
        import os, networkx as nx
        from moecc.sizes import parse_size
        from onnx import helper
        import moecc_runtime.plan
        from . import sibling

        def lazy():
            import ortools.linear_solver
            import importlib
            importlib.import_module("moecc.compiler")
        """
    ))
    found = _forbidden_imports(bad, root=tmp_path)
    assert sorted(f.split(": ", 1)[1] for f in found) == sorted(
        ["moecc", "networkx", "moecc.sizes", "onnx", "ortools.linear_solver", "moecc.compiler"]
    )
