"""The Ray Data callable (job/ray_data.py) reads a row as `moecc exec` reads a simple line
(the same validation: penalties, logprobs, n, response_format) and returns what exec writes
for it; called directly here, so Ray itself is not needed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moecc.compiler import compile_model
from moecc_runtime.job.exec import run_job
from moecc_runtime.job.ray_data import MoeccPredictor
from moecc_runtime.plan import save_plan

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
ROWS = [
    {"custom_id": "plain", "prompt": "the kettle clicked off", "max_tokens": 5},
    {"custom_id": "pen", "prompt": "the kettle clicked off", "max_tokens": 5, "frequency_penalty": 1.5,
     "logprobs": True, "top_logprobs": 2},
    {"custom_id": "n", "prompt": "a pulley is", "max_tokens": 4, "n": 3, "temperature": 0.8, "seed": 1},
    {"custom_id": "schema", "prompt": "a pulley is", "max_tokens": 80,
     "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
    {"custom_id": "bad", "prompt": "x", "top_p": 7},
]


@pytest.fixture(scope="module")
def plan_path(checkpoints, tmp_path_factory) -> Path:
    plan, _ = compile_model(checkpoints("mixtral", "per_expert"))
    out = tmp_path_factory.mktemp("raydata") / "plan.pt"
    save_plan(plan, out)
    return out


def test_rows_run_as_exec_lines(plan_path: Path, tmp_path: Path) -> None:
    cols = {k: [r.get(k) for r in ROWS] for k in sorted({k for r in ROWS for k in r})}
    out = MoeccPredictor(plan_path, device="cpu")(cols)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:-1]), encoding="utf-8")
    run_job(plan_path, prompts, tmp_path / "o.jsonl", device="cpu", log=None)
    ref = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "o.jsonl").read_text().splitlines())}
    for i, row in enumerate(ROWS[:-1]):
        want = ref[row["custom_id"]]
        assert out["error"][i] is None, out["error"][i]
        assert list(out["token_ids"][i]) == want["token_ids"] and out["text"][i] == want["text"]
        assert out["completion_tokens"][i] == want["usage"]["completion_tokens"]
    assert [c["token_ids"] for c in out["choices"][2]] == [c["token_ids"] for c in ref["n"]["choices"]]
    assert out["logprobs"][1] == ref["pen"]["logprobs"] and out["logprobs"][0] is None
    assert out["finish_reason"][3] == "stop" and json.loads(out["text"][3]) in ({"ok": True}, {"ok": False})
    assert "top_p" in out["error"][4] and out["text"][4] is None
    assert isinstance(out["choices"], np.ndarray) and out["choices"][0] is None
