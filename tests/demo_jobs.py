"""Shared by the issue-32 tests (test_pipes, test_no_traceback, test_sidecar_integrity,
test_big_n, test_output_promises): one compiled plan of the demo model per test session."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo-model"


@functools.lru_cache(maxsize=None)
def demo_plan(quantize: str | None = None) -> Path:
    """A plan of the demo model (small batch), compiled once per session; with `quantize`,
    its sidecar beside it. Callers copy it before changing anything."""
    from moecc.compiler import compile_model
    from moecc_runtime.plan import save_plan

    d = Path(tempfile.mkdtemp(prefix="moecc32-"))
    atexit.register(shutil.rmtree, d, True)
    p = d / ("plan.pt" if quantize is None else f"plan-{quantize}.pt")
    plan, _ = compile_model(DEMO, prompt_tokens=16, output_tokens=4, max_batch=8, quantize=quantize, output=p)
    save_plan(plan, p)
    return p


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
