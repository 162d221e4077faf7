"""Every promise the output makes, checked where it is made (issue 32, item 2): a schema no
finite document satisfies fails its line naming response_format; a constrained completion
about to be written with finish_reason "stop" that does not parse and validate fails its
request instead of being written. And the context bound of an echoed prompt (item 6): the
prompt alone may fill the context."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.demo_jobs import demo_plan, read_jsonl, write_jsonl
from moecc_runtime.job.exec import run_job
from moecc_runtime.structured import output_error

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LOOP = {"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}


def _run(tmp_path: Path, rows: list[dict]):
    prompts = write_jsonl(tmp_path / "in.jsonl", rows)
    s = run_job(demo_plan(), prompts, tmp_path / "out.jsonl", errors_path=tmp_path / "err.jsonl", log=None,
                device="cpu")
    errors = read_jsonl(tmp_path / "err.jsonl") if (tmp_path / "err.jsonl").exists() else []
    return s, read_jsonl(tmp_path / "out.jsonl"), {e["custom_id"]: e["error"] for e in errors}


def test_unsatisfiable_schema_and_a_cut_document_fail_their_lines(tmp_path):
    s, out, err = _run(tmp_path, [
        {"custom_id": "loop", "prompt": "x", "max_tokens": 8,
         "response_format": {"type": "json_schema", "json_schema": {"name": "l", "schema": LOOP}}},
        {"custom_id": "cut", "prompt": "x", "max_tokens": 30, "stop": ["\""],  # greedy: '{\n"' comes first
         "response_format": {"type": "json_object"}},
        {"custom_id": "ok", "prompt": "x", "max_tokens": 4}])
    assert (s.succeeded, s.failed) == (1, 2) and [r["custom_id"] for r in out] == ["ok"]
    assert err["loop"] == {"line": 1, "field": "response_format.json_schema.schema", "message": (
        "response_format json_schema: no finite JSON document satisfies the schema (it can only be completed by an "
        "infinite one, e.g. a $ref that refers only to itself); give a schema some document can satisfy")}
    assert err["cut"]["line"] == 2 and err["cut"]["field"] == "response_format"
    assert err["cut"]["message"].startswith('completion 0 ended with finish_reason "stop" but its text is not '
                                            'valid JSON (')
    assert err["cut"]["message"].endswith("); the result is not written (a stop string that cuts the JSON does "
                                          "this: drop `stop` from a request with a response_format)")


def test_output_error_parses_and_validates():
    obj = ("json_object", "")
    schema = ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                         "required": ["a"]}))
    assert output_error('{"a": 1}', obj) is None and output_error('{"a": 1}', schema) is None
    assert output_error("[1]", obj) == "its text is JSON but not an object (list)"
    assert output_error('{"a": NaN}', obj) == "its text is not valid JSON (NaN is not JSON)"
    assert output_error('{"a": "1"}', schema) == ("it does not validate against the schema at a: '1' is not of "
                                                  "type 'integer'")
    assert output_error("{}", schema) == ("it does not validate against the schema at (the document): 'a' is a "
                                          "required property")


def test_an_echoed_prompt_may_fill_the_context(tmp_path):
    ids = [(i * 7) % 2000 + 5 for i in range(512)]  # the demo model's context: 512
    s, out, err = _run(tmp_path, [
        {"custom_id": "full", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 1}},
        {"custom_id": "over", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": ids + [5], "echo": True, "max_tokens": 0}},
        {"custom_id": "plain", "prompt": ids}])
    assert [(r["custom_id"], r["finish_reason"], r["usage"]) for r in out] == [
        ("full", "length", {"prompt_tokens": 512, "completion_tokens": 0})]
    assert len(out[0]["logprobs"]) == 512
    assert err["over"]["message"].endswith("the model's context is 512; shorten it to at most 512 tokens")
    assert err["plain"]["message"].endswith("the model's context is 512; shorten it to at most 511 tokens")
