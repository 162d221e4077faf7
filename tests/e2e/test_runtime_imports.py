"""The runtime (`moecc_runtime`, source in runtime/) must never import the compiler
(`moecc`), OR-Tools, networkx or onnx: a plan runs on a machine with only torch,
safetensors and the tokenizer libraries installed. And the other direction: the compiler
imports from the runtime only the contract (moecc_runtime/contract/), plan I/O and what
`moecc/measure/` runs (COMPILER_MAY_IMPORT, an allow-list per compiler package)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
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


# -- the compiler's side: what it may import from the runtime --------------------------------
MOECC_DIR = REPO_ROOT / "moecc"
#: every compiler module may import these (prefixes): the shared rules, and plan I/O (the
#: schema, the op attrs, reading / writing / checking plans, and the safetensors header reader
#: the plan's manifest is checked against)
PLAN_IO = ("moecc_runtime.contract", "moecc_runtime.plan_schema", "moecc_runtime.plan_ops", "moecc_runtime.plan",
           "moecc_runtime.memory.safetensors_header")
#: compiler file or package (path under moecc/) -> what else it may import, and why
COMPILER_MAY_IMPORT: dict[str, tuple[str, ...]] = {
    # measure/ runs the runtime's kernels and copy path to profile this machine
    "measure/": ("moecc_runtime.worker.kernels", "moecc_runtime.memory.copy_engine", "moecc_runtime.memory.streaming"),
    # the front doors: they run jobs (exec, perplexity, serve) and report the runtime's errors
    "cli.py": ("moecc_runtime.job", "moecc_runtime.perplexity", "moecc_runtime.memory.arena",
               "moecc_runtime.memory.copy_engine", "moecc_runtime.memory.weights", "moecc_runtime.scheduler.blocks"),
    "serve/": ("moecc_runtime.job.exec",),
    # quantizing writes the runtime's stored formats with the formats' own quantizers; test
    # checkpoints are written in them too
    "quantize/": ("moecc_runtime.formats",),
    "testing/": ("moecc_runtime.formats",),
    # explain --prompts reads a prompts file as exec does, and predicts the weight path by the runtime's rule
    "views/explain.py": ("moecc_runtime.job.requests", "moecc_runtime.tokenizer", "moecc_runtime.memory.weight_path"),
    # the planner sizes the KV pool by this machine's MemAvailable, read by the runtime's one reader of it
    "planner/host_memory.py": ("moecc_runtime.memory.pinned",),
}


def _runtime_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `moecc_runtime...` import in `path` (statements and literal import_module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "moecc_runtime"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "moecc_runtime":
            names = [a.name for a in node.names]
            out += [(node.lineno, f"{node.module}.{n}" if node.module == "moecc_runtime" else node.module) for n in names]
    return out


def _allowed(rel: str, module: str) -> bool:
    extra = [v for k, v in COMPILER_MAY_IMPORT.items() if rel == k or (k.endswith("/") and rel.startswith(k))]
    prefixes = PLAN_IO + tuple(p for v in extra for p in v)
    private = any(part.startswith("_") for part in module.split("."))
    return not private and any(module == p or module.startswith(p + ".") for p in prefixes)


def _compiler_files() -> list[Path]:
    files = sorted(MOECC_DIR.rglob("*.py"))
    assert files, f"no Python files under {MOECC_DIR}"
    return files


def test_compiler_imports_only_the_contract_plan_io_and_what_measure_runs() -> None:
    """Every runtime import of the compiler is on COMPILER_MAY_IMPORT (never a private module)."""
    bad = [f"moecc/{p.relative_to(MOECC_DIR)}:{line}: {m}" for p in _compiler_files()
           for line, m in _runtime_imports(p) if not _allowed(str(p.relative_to(MOECC_DIR)), m)]
    assert bad == [], ("the compiler imports runtime modules outside the contract and plan I/O; move the shared "
                       "rule into moecc_runtime/contract/ (or, for a reason, add it to COMPILER_MAY_IMPORT):\n"
                       + "\n".join(bad))


@pytest.mark.parametrize(("rel", "module", "ok"), [
    ("planner/solve.py", "moecc_runtime.contract.blocks", True),
    ("planner/solve.py", "moecc_runtime.plan_schema", True),
    ("planner/solve.py", "moecc_runtime.worker.kernels", False),
    ("measure/profile.py", "moecc_runtime.worker.kernels", True),
    ("serve/worker.py", "moecc_runtime.job.exec", True),
    ("serve/worker.py", "moecc_runtime.job.requests", False),
    ("cli.py", "moecc_runtime.formats._packing", False),  # private: never
])
def test_compiler_allow_list_itself(rel: str, module: str, ok: bool) -> None:
    assert _allowed(rel, module) is ok
