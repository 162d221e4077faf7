"""Structured outputs (OpenAI `response_format`): the request field's parsing, and the grammar
masks of moecc_runtime.structured (llguidance) over the tiny Mixtral's real tokenizer: sampled
at random among the allowed tokens, every output ends and is JSON that matches its schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moecc_runtime.job.requests import RequestFieldError, iter_request_lines, parse_request
from moecc_runtime.structured import GrammarCompiler, Matcher, fill_bitmask, fill_masks, unpack_bitmask
from moecc_runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {  # every string bounded (enum, maxLength), so random sampling ends
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer"},
        "label": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "count", "label", "ok"],
    "additionalProperties": False,
}
JSON_SCHEMA = ("json_schema", json.dumps(SCHEMA, separators=(",", ":")))
JSON_OBJECT = ("json_object", "")
STEP_CAP = 4000


def chat(body: dict, cid: str = "a") -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}}


def cmpl(body: dict, cid: str = "a") -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", **body}}


def simple(extra: dict) -> dict:
    return {"prompt": "hi", **extra}


def parse(line: dict):
    return parse_request(line, path="p", line=1)


FORMS = [(chat, "body."), (cmpl, "body."), (simple, "")]


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(("form", "prefix"), FORMS)
@pytest.mark.parametrize(("value", "expected"), [
    (None, None),
    ({"type": "text"}, None),
    ({"type": "json_object"}, JSON_OBJECT),
    ({"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}, JSON_SCHEMA),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": False,
                                             "description": "a thing"}}, JSON_SCHEMA),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": None}}, JSON_SCHEMA),
])
def test_accepted_response_formats(form, prefix: str, value, expected) -> None:
    assert parse(form({"response_format": value})).response_format == expected
    assert parse(form({})).response_format is None


def test_the_schema_keeps_its_key_order() -> None:
    """The order of `properties` is the order the output's keys are generated in."""
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"]}
    req = parse(chat({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}))
    assert req.response_format == ("json_schema", '{"type":"object","properties":{"reasoning":{"type":"string"},'
                                   '"answer":{"type":"integer"}},"required":["reasoning","answer"]}')


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4))
def test_any_schema_object_round_trips(schema: dict) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    line = json.dumps(chat({"response_format": rf}))
    (req,) = iter_request_lines([line.encode()], path="p")
    kind, text = req.response_format
    assert kind == "json_schema" and json.loads(text) == schema
    assert list(json.loads(text)) == list(schema)  # key order kept
    assert text == json.dumps(schema, separators=(",", ":"))


def _schema_rf(spec: object) -> dict:
    return {"type": "json_schema", "json_schema": spec}


@pytest.mark.parametrize(("form", "prefix"), FORMS)
@pytest.mark.parametrize(("value", "field", "fragment"), [
    ("json_object", "response_format", 'expected an object like {"type": "json_object"}'),
    ({}, "response_format.type", 'missing required field (accepted: "text", "json_object", "json_schema")'),
    ({"type": "grammar"}, "response_format.type", 'expected one of "text", "json_object", "json_schema"'),
    ({"type": 3}, "response_format.type", "got int 3"),
    ({"type": "json_object", "schema": {}}, "response_format.schema", "unknown field"),
    ({"type": "text", "json_schema": {}}, "response_format.json_schema", "unknown field"),
    ({"type": "json_schema"}, "response_format.json_schema", "missing required field"),
    (_schema_rf([]), "response_format.json_schema", "expected an object"),
    (_schema_rf({"name": "a"}), "response_format.json_schema.schema", "missing required field"),
    (_schema_rf({"name": "a", "schema": "{}"}), "response_format.json_schema.schema", "expected a JSON Schema object"),
    (_schema_rf({"name": "a", "schema": True}), "response_format.json_schema.schema", "expected a JSON Schema object"),
    (_schema_rf({"name": "a", "schema": {}, "strict": "yes"}), "response_format.json_schema.strict",
     "expected true or false"),
    (_schema_rf({"name": 5, "schema": {}}), "response_format.json_schema.name", "expected a string"),
    (_schema_rf({"name": "a", "schema": {}, "description": []}), "response_format.json_schema.description",
     "expected a string"),
    (_schema_rf({"name": "a", "schema": {}, "format": "x"}), "response_format.json_schema.format",
     "unknown field"),
])
def test_each_response_format_refusal_names_its_field(form, prefix: str, value, field: str, fragment: str) -> None:
    with pytest.raises(RequestFieldError) as e:
        parse(form({"response_format": value}))
    assert e.value.field == prefix + field and fragment in e.value.message, (e.value.field, e.value.message)


def test_a_bad_response_format_fails_its_line_alone() -> None:
    lines = [chat({"response_format": {"type": "yaml"}}, "bad"), chat({"response_format": {"type": "json_object"}},
                                                                      "good")]
    items = list(iter_request_lines((json.dumps(x).encode() for x in lines), path="b.jsonl"))
    assert type(items[0]).__name__ == "RequestError" and items[0].field == "body.response_format.type"
    assert type(items[1]).__name__ == "Request" and items[1].response_format == JSON_OBJECT


# --------------------------------------------------------------------------- grammars and masks


@pytest.fixture(scope="module")
def tok(checkpoints) -> Tokenizer:
    return Tokenizer(Path(checkpoints("mixtral", "per_expert")))


@pytest.fixture(scope="module")
def vocab(checkpoints) -> int:
    return json.loads((Path(checkpoints("mixtral", "per_expert")) / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer, vocab: int) -> GrammarCompiler:
    return GrammarCompiler(tok, vocab)


@pytest.fixture(scope="module")
def wide(tok: Tokenizer, vocab: int) -> GrammarCompiler:
    """The model's vocabulary wider than the tokenizer's, and not a multiple of 32."""
    return GrammarCompiler(tok, vocab + 45)


@pytest.mark.parametrize(("schema", "fragment"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"type": "objekt"}', "Invalid type: objekt"),
    ('{"type": "array", "uniqueItems": true}', "uniqueItems"),
    ('{"not": {"type": "string"}}', "not"),
    ('{"type": "string", "minLength": 5, "maxLength": 2}', "Unsatisfiable"),
    ('{"type": "string", "pattern": "("}', "regex parse error"),
    ('{"$ref": "#/definitions/missing"}', "does not exist"),
])
def test_check_refuses_a_bad_schema_clearly(compiler: GrammarCompiler, schema: str, fragment: str) -> None:
    with pytest.raises(ValueError) as e:
        compiler.check(("json_schema", schema))
    assert fragment in str(e.value) and str(e.value).startswith("response_format json_schema"), str(e.value)
    with pytest.raises(ValueError):
        compiler.matcher(("json_schema", schema))


def test_check_accepts_good_formats_and_refuses_unknown_kinds(compiler: GrammarCompiler) -> None:
    compiler.check(JSON_OBJECT)
    compiler.check(JSON_SCHEMA)
    with pytest.raises(ValueError, match="not supported"):
        compiler.check(("yaml", ""))


def test_compiled_grammars_are_cached_and_matchers_independent(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    assert compiler._compiled(JSON_SCHEMA) is compiler._compiled(("json_schema", JSON_SCHEMA[1]))
    a, b = compiler.matcher(JSON_OBJECT), compiler.matcher(JSON_OBJECT)
    for t in tok.tok.encode('{"k": 1}', add_special_tokens=False):
        a.accept(t)
    assert a.done and not b.done and b.error is None


def test_mask_shape_dtype_and_the_tokenizers_vocabulary(wide: GrammarCompiler, tok: Tokenizer) -> None:
    V = wide.vocab_size
    ms = [wide.matcher(JSON_OBJECT), wide.matcher(JSON_SCHEMA)]
    masks = fill_masks(ms, V)  # [S, V]
    assert masks.shape == (2, V) and masks.dtype == torch.bool and masks.device.type == "cpu"
    assert not masks[:, len(tok.tok):].any()  # tokens the tokenizer lacks: never
    for row in masks:  # an object starts with "{" (no leading whitespace)
        assert row.any() and all(tok.tok.decode([t]).startswith("{") for t in row.nonzero().flatten().tolist())
    assert fill_bitmask(ms, V).shape == (2, (V + 31) // 32)


def test_unpack_bitmask_is_bit_t_of_word_t_over_32() -> None:
    gen = torch.Generator().manual_seed(0)
    bm = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=gen)
    V = 150
    want = torch.tensor([[(int(bm[r, t // 32]) >> (t % 32)) & 1 for t in range(V)] for r in range(3)]).bool()
    assert torch.equal(unpack_bitmask(bm, V), want)


def drive(compiler: GrammarCompiler, rf: tuple[str, str], seed: int) -> tuple[list[int], Matcher, int]:
    """Sample like temperature 1 over random logits, among the allowed tokens only, until EOS."""
    gen = torch.Generator().manual_seed(seed)
    m, out = compiler.matcher(rf), []
    eos = set(compiler.eos_ids)
    for step in range(STEP_CAP):
        mask = fill_masks([m], compiler.vocab_size)[0]  # [V]
        if m.accepting:
            assert mask[list(eos)].all()  # a complete document can always end
        logits = torch.randn(compiler.vocab_size, generator=gen).masked_fill(~mask, float("-inf"))
        t = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        m.accept(t)
        if t in eos:
            return out, m, step
        out.append(t)
    raise AssertionError(f"no EOS within {STEP_CAP} steps: {out[-40:]}")


def valid(value: object, schema: dict) -> bool:
    """A validator for the subset of JSON Schema SCHEMA uses."""
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict) or not set(schema.get("required", ())) <= set(value):
            return False
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False and not set(value) <= set(props):
            return False
        return all(valid(v, props[k]) for k, v in value.items() if k in props)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return (isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
                and value in schema.get("enum", [value]))
    raise AssertionError(f"unsupported schema {schema}")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rf", [JSON_OBJECT, JSON_SCHEMA], ids=["json_object", "json_schema"])
def test_sampled_outputs_end_and_match_their_schema(wide: GrammarCompiler, tok: Tokenizer, rf, seed: int) -> None:
    out, m, _ = drive(wide, rf, seed)
    assert m.done and m.error is None
    text = tok.tok.decode(out)
    value = json.loads(text)
    assert valid(value, SCHEMA if rf == JSON_SCHEMA else {"type": "object"}), text
    if rf == JSON_SCHEMA:
        assert list(value) == list(SCHEMA["properties"])  # keys in the schema's order
    m.accept(wide.eos_ids[0])  # EOS again once done is fine
    assert m.done and torch.equal(fill_masks([m], wide.vocab_size)[0].nonzero().flatten(),
                                  torch.tensor(wide.eos_ids))


def test_a_done_matcher_allows_exactly_eos(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    m = compiler.matcher(JSON_SCHEMA)
    for t in tok.tok.encode('{"color": "red", "count": 3, "label": "ab", "ok": true}', add_special_tokens=False):
        assert not m.done
        m.accept(t)
    assert m.done and m.accepting
    mask = fill_masks([m], compiler.vocab_size)[0]
    assert mask.nonzero().flatten().tolist() == list(compiler.eos_ids)


def test_a_refused_token_ends_the_matcher_with_eos_only(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    m = compiler.matcher(JSON_OBJECT)
    m.accept(tok.tok.encode("x", add_special_tokens=False)[0])  # an object cannot start with x
    assert m.done and m.error
    assert fill_masks([m], compiler.vocab_size)[0].nonzero().flatten().tolist() == list(compiler.eos_ids)


def test_batched_masks_equal_each_matchers_own(wide: GrammarCompiler) -> None:
    """Rows at different points of different grammars (one done), filled together or alone."""
    matchers = []
    for i, rf in enumerate([JSON_OBJECT, JSON_SCHEMA] * 4):
        out, _, steps = drive(wide, rf, 100 + i)
        m = wide.matcher(rf)
        for t in out[: (i * len(out)) // 7]:  # a prefix: 0 tokens, ..., the whole document (done)
            m.accept(t)
        matchers.append(m)
    assert matchers[0].done is False and matchers[-1].done is True
    together = fill_masks(matchers, wide.vocab_size)  # [S, V]
    for i, m in enumerate(matchers):
        assert torch.equal(together[i], fill_masks([m], wide.vocab_size)[0]), i
    assert torch.equal(fill_masks([], wide.vocab_size), torch.zeros(0, wide.vocab_size, dtype=torch.bool))
