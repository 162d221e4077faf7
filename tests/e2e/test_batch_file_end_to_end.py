"""A batch file as real jobs write them (issue 23, "What it must show"): penalties, user,
metadata, service_tier, content parts, logprobs, n=3, json_schema and json_object in one
file, run by `moecc exec --format openai`: no line fails, every body validates with the
official openai client's response types, and each honours what it asked (n choices,
top_logprobs entries per token, JSON that parses and validates against its schema, also
sampled at temperature > 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from moecc.compiler import compile_model
from moecc_runtime.job.exec import run_job
from moecc_runtime.plan import save_plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["colour", "count"], "additionalProperties": False}
COMMON = {"model": "gpt-4o-mini", "user": "u-1", "metadata": {"job": "eval"}, "service_tier": "auto",
          "store": False, "stream": False, "presence_penalty": 0.5, "frequency_penalty": 0.25}


def chat(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {**COMMON, "messages": [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                                            {"role": "user", "content": [{"type": "text", "text": "a pulley"},
                                                                         {"type": "text", "text": "is a wheel"}]}],
                     "max_completion_tokens": 6, **body}}


def cmpl(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {**COMMON, "prompt": "the kettle clicked off", "max_tokens": 6, **body}}


def json_schema(strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": strict}}


def valid(doc: object) -> bool:
    return (isinstance(doc, dict) and set(doc) == {"colour", "count"} and doc["colour"] in ("red", "green", "blue")
            and type(doc["count"]) is int and 0 <= doc["count"] <= 99)


@pytest.fixture(scope="module")
def plan_path(checkpoints, tmp_path_factory):
    path = checkpoints("mixtral", "per_expert")
    plan, _ = compile_model(path)
    out = tmp_path_factory.mktemp("batchfile") / "plan.pt"
    save_plan(plan, out)
    return out


def test_a_real_batch_file_runs_and_every_body_validates(plan_path: Path, tmp_path: Path) -> None:
    rows = [
        chat("chat-plain"),
        chat("chat-lp-n3", logprobs=True, top_logprobs=2, n=3, temperature=0.9, seed=3),
        chat("chat-schema", response_format=json_schema(), max_completion_tokens=40),
        chat("chat-schema-hot", response_format=json_schema(False), max_completion_tokens=40, temperature=1.2,
             seed=11, n=2),
        chat("chat-object", response_format={"type": "json_object"}, max_completion_tokens=40,
             temperature=0.7, seed=5),
        cmpl("cmpl-lp", logprobs=3, n=2, repetition_penalty=1.2),
        cmpl("cmpl-greedy-n3", n=3, temperature=0),
    ]
    prompts = tmp_path / "batch.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out, errors = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    summary = run_job(plan_path, prompts, out, errors_path=errors, device="cpu", log=None, fmt="openai")
    assert (summary.succeeded, summary.failed) == (len(rows), 0), errors.read_text() if errors.exists() else ""
    bodies = {}
    for line in out.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        assert rec["error"] is None and rec["response"]["status_code"] == 200
        bodies[rec["custom_id"]] = rec["response"]["body"]
    parsed = {cid: (Completion if cid.startswith("cmpl") else ChatCompletion).model_validate(b)
              for cid, b in bodies.items()}
    asked_n = {r["custom_id"]: r["body"].get("n", 1) for r in rows}
    for cid, p in parsed.items():
        assert [c.index for c in p.choices] == list(range(asked_n[cid])), cid
        assert p.usage.total_tokens == p.usage.prompt_tokens + p.usage.completion_tokens
    lp = parsed["chat-lp-n3"]
    for c in lp.choices:
        assert c.logprobs is not None and c.logprobs.content
        assert all(len(e.top_logprobs) == 2 for e in c.logprobs.content)
    assert lp.usage.completion_tokens == sum(len(c.logprobs.content) for c in lp.choices)
    for c in parsed["cmpl-lp"].choices:
        assert c.logprobs is not None and all(1 <= len(t) <= 3 for t in c.logprobs.top_logprobs)
    greedy = [c.text for c in parsed["cmpl-greedy-n3"].choices]
    assert greedy[0] == greedy[1] == greedy[2], "n greedy completions are the same completion"
    for cid in ("chat-schema", "chat-schema-hot"):
        for c in parsed[cid].choices:
            # greedy ends its document; sampled hot on random weights may use up max_tokens on
            # the whitespace the grammar allows: whatever ended with "stop" must validate
            if cid == "chat-schema" or c.finish_reason == "stop":
                assert c.finish_reason == "stop", (cid, c.message.content)
                assert valid(json.loads(c.message.content)), (cid, c.message.content)
    obj = parsed["chat-object"].choices[0]
    # random weights write one endless string inside the object: cut at max_tokens, the text so far
    # is still an object's start; ended (EOS, which the grammar allows only at the end), it parses
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict), obj.message.content
    else:
        assert obj.finish_reason == "length" and obj.message.content.lstrip().startswith("{")


def test_a_bad_schema_fails_its_line_alone_naming_the_field(plan_path: Path, tmp_path: Path) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}
    rows = [chat("bad", response_format=bad), chat("good", max_completion_tokens=2)]
    prompts = tmp_path / "batch.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    errors = tmp_path / "err.jsonl"
    s = run_job(plan_path, prompts, tmp_path / "out.jsonl", errors_path=errors, device="cpu", log=None)
    assert (s.succeeded, s.failed) == (1, 1)
    rec = json.loads(errors.read_text().splitlines()[0])
    assert rec["custom_id"] == "bad" and rec["error"]["field"] == "body.response_format.json_schema.schema"
    assert rec["error"]["line"] == 1
