"""Tests for moecc_runtime.job.requests (JSONL request files for `moecc exec`)."""

from __future__ import annotations

import ast
import io
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moecc_runtime.job import requests as requests_module
from moecc_runtime.job.requests import (
    KNOWN_FIELDS,
    Request,
    RequestError,
    RequestFieldError,
    iter_request_lines,
    iter_requests,
    parse_request,
    read_requests,
)


def write(tmp_path: Path, data: bytes | str, name: str = "prompts.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def parse_bytes(data: bytes, path: str = "p.jsonl") -> list[Request | RequestError]:
    """Parse bytes split into lines exactly as a binary file would be."""
    return list(iter_request_lines(io.BytesIO(data), path=path))


def only_error(line: str) -> RequestError:
    """Parse a file of one line and return its single error."""
    (item,) = parse_bytes(line.encode("utf-8"))
    assert isinstance(item, RequestError), item
    return item


# --------------------------------------------------------------------------- valid input


def test_prompt_request_defaults(tmp_path: Path) -> None:
    reqs, errs = read_requests(write(tmp_path, '{"prompt": "Hello"}\n'))
    assert errs == []
    assert reqs == [
        Request(line=1, custom_id="request-1", prompt="Hello", messages=None, max_tokens=None,
                temperature=0.0, top_p=1.0, top_k=0, seed=None)
    ]


def test_messages_request_all_fields(tmp_path: Path) -> None:
    line = json.dumps({
        "custom_id": "chat-1",
        "messages": [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}],
        "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 123,
    })
    reqs, errs = read_requests(str(write(tmp_path, line)))
    assert errs == []
    (req,) = reqs
    assert req.custom_id == "chat-1" and req.prompt is None
    assert req.messages == ({"role": "system", "content": ""}, {"role": "user", "content": "Hi"})
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed) == (16, 0.7, 0.9, 40, 123)


def test_int_sampling_values_become_floats() -> None:
    req = parse_request({"prompt": "x", "temperature": 1, "top_p": 1}, path="p", line=1)
    assert isinstance(req.temperature, float) and isinstance(req.top_p, float)
    assert (req.temperature, req.top_p) == (1.0, 1.0)


def test_crlf_blank_lines_and_final_line_without_newline(tmp_path: Path) -> None:
    data = b'\r\n{"prompt": "a"}\r\n   \r\n\n{"prompt": "b"}\r\n\t\n{"prompt": "c"}'
    reqs, errs = read_requests(write(tmp_path, data))
    assert errs == []
    assert [(r.line, r.prompt, r.custom_id) for r in reqs] == [
        (2, "a", "request-2"), (5, "b", "request-5"), (7, "c", "request-7"),
    ]


def test_utf8_bom_and_non_ascii(tmp_path: Path) -> None:
    data = b"\xef\xbb\xbf" + json.dumps({"prompt": "h\u00e9llo \u2603"}, ensure_ascii=False).encode()
    reqs, errs = read_requests(write(tmp_path, data))
    assert errs == [] and reqs[0].prompt == "h\u00e9llo \u2603"


def test_empty_file(tmp_path: Path) -> None:
    assert read_requests(write(tmp_path, b"")) == ([], [])
    assert read_requests(write(tmp_path, b"\n\r\n  \n", "blank.jsonl")) == ([], [])


def test_iter_requests_streams_in_file_order(tmp_path: Path) -> None:
    path = write(tmp_path, '{"prompt": "a"}\nnope\n{"prompt": "b"}\n')
    items = list(iter_requests(path))
    assert [type(i).__name__ for i in items] == ["Request", "RequestError", "Request"]
    assert [i.line for i in items] == [1, 2, 3]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("line", "field", "fragment"),
    [
        ("{not json", None, "malformed JSON"),
        ('{"prompt": "a"} {"prompt": "b"}', None, "malformed JSON"),
        ('{"prompt": "a", "temperature": NaN}', None, "NaN is not allowed"),
        ('{"prompt": "a", "prompt": "b"}', None, "duplicate key 'prompt'"),
        ("[1, 2]", None, "expected a JSON object, got array of 2 items"),
        ('"just a string"', None, "expected a JSON object, got 'just a string'"),
        ("42", None, "expected a JSON object, got int 42"),
        ("null", None, "expected a JSON object, got null"),
        ("{}", None, "missing 'prompt' or 'messages'"),
        ('{"custom_id": "x"}', None, "missing 'prompt' or 'messages'"),
        ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "messages", "not both"),
        ('{"prompt": ""}', "prompt", "must not be empty"),
        ('{"prompt": 5}', "prompt", "expected a string or a list of token ids, got int 5"),
        ('{"prompt": []}', "prompt", "must not be empty"),
        ('{"prompt": [1, -2]}', "prompt", "token list item 1: expected a token id >= 0"),
        ('{"prompt": [1, true]}', "prompt", "token list item 1"),
        ('{"prompt": null}', "prompt", "expected a string or a list of token ids, got null"),
        ('{"prompt": "\\ud800"}', "prompt", "unpaired surrogate"),
        ('{"custom_id": 5, "prompt": "a"}', "custom_id", "expected a string, got int 5"),
        ('{"custom_id": "", "prompt": "a"}', "custom_id", "must not be empty"),
        ('{"messages": []}', "messages", "must not be empty"),
        ('{"messages": "hi"}', "messages", "expected an array"),
        ('{"messages": ["hi"]}', "messages[0]", "expected an object with 'role' and 'content', got 'hi'"),
        ('{"messages": [{"role": "user"}]}', "messages[0].content", "missing required field"),
        ('{"messages": [{"content": "x"}]}', "messages[0].role", "missing required field"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},'
         ' {"role": "user", "content": 7}]}', "messages[2].content", "expected a string or an array of text parts, got int 7"),
        ('{"messages": [{"role": 1, "content": "a"}]}', "messages[0].role", "expected a string, got int 1"),
        ('{"messages": [{"role": "", "content": "a"}]}', "messages[0].role", "must not be empty"),
        ('{"messages": [{"role": "user", "content": "a", "name": "bob"}]}', "messages[0].name",
         "unknown field 'name'"),
        ('{"prompt": "a", "max_tokens": "ten"}', "max_tokens", "expected an integer >= 1, got 'ten'"),
        ('{"prompt": "a", "max_tokens": true}', "max_tokens", "got bool true"),
        ('{"prompt": "a", "max_tokens": 0}', "max_tokens", "expected an integer >= 1, got int 0"),
        ('{"prompt": "a", "max_tokens": 10.0}', "max_tokens", "got float 10.0"),
        ('{"prompt": "a", "max_tokens": null}', "max_tokens", "got null"),
        ('{"prompt": "a", "temperature": -0.5}', "temperature", "expected a number >= 0"),
        ('{"prompt": "a", "temperature": false}', "temperature", "got bool false"),
        ('{"prompt": "a", "temperature": "0.7"}', "temperature", "got '0.7'"),
        ('{"prompt": "a", "temperature": 1e999}', "temperature", "expected a number >= 0"),
        ('{"prompt": "a", "temperature": ' + "9" * 400 + "}", "temperature", "int with"),
        ('{"prompt": "a", "top_p": 0}', "top_p", "expected a number in (0, 1]"),
        ('{"prompt": "a", "top_p": 1.5}', "top_p", "expected a number in (0, 1]"),
        ('{"prompt": "a", "top_p": true}', "top_p", "got bool true"),
        ('{"prompt": "a", "top_k": -1}', "top_k", "expected an integer >= 0"),
        ('{"prompt": "a", "top_k": 2.5}', "top_k", "got float 2.5"),
        ('{"prompt": "a", "seed": "1"}', "seed", "got '1'"),
        ('{"prompt": "a", "seed": false}', "seed", "got bool false"),
        ('{"prompt": "a", "seed": -1}', "seed", "expected an integer in [0, 2**64)"),
        ('{"prompt": "a", "seed": 18446744073709551616}', "seed", "expected an integer in [0, 2**64)"),
        ('{"prompt": "a", "max_new_tokens": 5}', "max_new_tokens",
         "unknown field 'max_new_tokens' (known: custom_id, prompt, messages, max_tokens, temperature,"
         " top_p, top_k, min_p, seed, stop, presence_penalty, frequency_penalty, repetition_penalty, logit_bias,"
         " min_tokens, logprobs, top_logprobs, response_format, n)"),
        ('{"prompt": "a", "logprobs": true, "top_logprobs": 30}', "top_logprobs", "an integer in [0, 20]"),
        ('{"prompt": "a", "stream": true}', "stream", "unknown field 'stream' (not supported by moecc)"),
        ('{"prompt": "a", "x": 1, "y": 2}', "x", "unknown fields 'x', 'y'"),
    ],
)
def test_error_kinds(line: str, field: str | None, fragment: str) -> None:
    err = only_error(line)
    assert err.line == 1 and err.path == "p.jsonl"
    assert err.field == field
    assert fragment in err.message, err.message


def test_invalid_utf8_is_a_line_error() -> None:
    items = parse_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff\xfe"}\n{"prompt": "fine"}\n')
    assert [type(i) for i in items] == [Request, RequestError, Request]
    err = items[1]
    assert isinstance(err, RequestError)
    assert (err.line, err.field, err.custom_id) == (2, None, None)
    assert "invalid UTF-8 at byte 13" in err.message


def test_custom_id_is_kept_on_errors_when_readable() -> None:
    assert only_error('{"custom_id": "a", "prompt": 1}').custom_id == "a"
    assert only_error('{"prompt": 1}').custom_id == "request-1"  # the id its output would have had
    assert only_error('{"custom_id": 3, "prompt": "x"}').custom_id is None
    assert only_error("nope").custom_id is None


def test_duplicate_custom_id_fails_the_later_line() -> None:
    data = (
        b'{"custom_id": "z", "prompt": "0"}\n'
        b'\n'
        b'{"custom_id": "a", "prompt": "1"}\n'
        b'{"custom_id": "a", "prompt": "2"}\n'
        b'{"prompt": "3"}\n'
        b'{"custom_id": "request-5", "prompt": "4"}\n'
    )
    items = parse_bytes(data)
    assert [type(i) for i in items] == [Request, Request, RequestError, Request, RequestError]
    dup = items[2]
    assert isinstance(dup, RequestError)
    assert (dup.line, dup.field, dup.custom_id) == (4, "custom_id", "a")
    assert dup.message == "duplicate custom_id 'a' (first seen on line 3)"
    clash = items[4]
    assert isinstance(clash, RequestError)
    assert clash.message == "duplicate custom_id 'request-5' (first seen on line 5)"


def test_duplicate_of_a_failed_line_still_counts() -> None:
    items = parse_bytes(b'{"custom_id": "a", "prompt": ""}\n{"custom_id": "a", "prompt": "x"}\n')
    assert [(type(i), i.line) for i in items] == [(RequestError, 1), (RequestError, 2)]
    assert "first seen on line 1" in items[1].message  # type: ignore[union-attr]


def test_good_lines_around_bad_ones(tmp_path: Path) -> None:
    lines = [
        '{"custom_id": "a", "prompt": "x"}',
        '{"custom_id": "b", "prompt": "x", "max_tokens": "ten"}',
        "",
        '{"custom_id": "c", "messages": [{"role": "user", "content": "hi"}]}',
        "[]",
        '{"custom_id": "d", "prompt": "x", "seed": 7}',
    ]
    reqs, errs = read_requests(write(tmp_path, "\n".join(lines) + "\n"))
    assert [(r.custom_id, r.line) for r in reqs] == [("a", 1), ("c", 4), ("d", 6)]
    assert [(e.line, e.field, e.custom_id) for e in errs] == [(2, "max_tokens", "b"), (5, None, None)]


def test_error_str_and_record() -> None:
    err = RequestError("prompts.jsonl", 7, "max_tokens", "expected an integer >= 1, got 'ten'", "a")
    assert str(err) == "prompts.jsonl:7: field 'max_tokens': expected an integer >= 1, got 'ten'"
    assert err.to_record() == {
        "custom_id": "a",
        "error": {"line": 7, "field": "max_tokens", "message": "expected an integer >= 1, got 'ten'"},
    }
    whole = RequestError("prompts.jsonl", 2, None, "malformed JSON: x", None)
    assert str(whole) == "prompts.jsonl:2: malformed JSON: x"
    json.dumps(whole.to_record())


def test_errors_name_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '{"prompt": "a"}\n{"prompt": 1}\n')
    _, (err,) = read_requests(path)
    assert err.path == str(path)
    assert str(err).startswith(f"{path}:2: field 'prompt': ")


def test_parse_request_raises_field_error() -> None:
    with pytest.raises(RequestFieldError) as info:
        parse_request({"custom_id": "q", "prompt": "a", "top_k": "5"}, path="p", line=3)
    assert (info.value.field, info.value.custom_id) == ("top_k", "q")
    assert "expected an integer >= 0" in info.value.message
    assert str(info.value).startswith("field 'top_k': ")
    with pytest.raises(RequestFieldError):
        parse_request(["not", "an", "object"], path="p", line=1)


def test_missing_file_and_directory_raise_os_errors(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_requests(missing)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        iter_requests(missing)  # raised eagerly, before iteration
    with pytest.raises(IsADirectoryError, match=str(tmp_path)):
        read_requests(tmp_path)


def _imports(path: str) -> set[str]:
    tree = ast.parse(Path(path).read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return modules | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_runtime_module_imports_only_the_standard_library() -> None:
    """The parser uses the standard library and its fields' one class (sampling/params.py),
    which itself uses only the standard library."""
    import moecc_runtime.sampling.params as params_module

    modules = _imports(requests_module.__file__) - {"moecc_runtime.sampling.params"}
    top = {m.split(".")[0] for m in modules}
    assert top <= set(sys.stdlib_module_names) | {"__future__"}, top
    top = {m.split(".")[0] for m in _imports(params_module.__file__)}
    assert top <= set(sys.stdlib_module_names) | {"__future__"}, top


# --------------------------------------------------------------------------- property tests

texts = st.text(min_size=1, max_size=30)
message = st.fixed_dictionaries({"role": texts, "content": st.text(max_size=30)})
optional_fields = {
    "custom_id": texts,
    "max_tokens": st.integers(1, 2**40),
    "temperature": st.floats(min_value=0, max_value=1e6) | st.integers(0, 100),
    "top_p": st.floats(min_value=0, max_value=1, exclude_min=True),
    "top_k": st.integers(0, 2**31),
    "seed": st.integers(0, 2**64 - 1),
}
valid_request = st.one_of(
    st.fixed_dictionaries({"prompt": texts}, optional=optional_fields),
    st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=4)}, optional=optional_fields),
)


def expected_request(d: dict, line: int) -> Request:
    return Request(
        line=line,
        custom_id=d.get("custom_id", f"request-{line}"),
        prompt=d.get("prompt"),
        messages=tuple(d["messages"]) if "messages" in d else None,
        max_tokens=d.get("max_tokens"),
        temperature=float(d.get("temperature", 0.0)),
        top_p=float(d.get("top_p", 1.0)),
        top_k=d.get("top_k", 0),
        seed=d.get("seed"),
    )


@settings(max_examples=150, deadline=None)
@given(valid_request, st.booleans(), st.integers(1, 10**6))
def test_valid_requests_round_trip(d: dict, ascii_only: bool, line: int) -> None:
    text = json.dumps(d, ensure_ascii=ascii_only)
    assert parse_request(json.loads(text), path="p", line=line) == expected_request(d, line)
    (item,) = parse_bytes(text.encode("utf-8") + b"\r\n")
    assert item == expected_request(d, 1)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=10), children, max_size=3),
    max_leaves=10,
)
near_valid = st.dictionaries(
    st.sampled_from([*KNOWN_FIELDS, "stop", "role", "content"]), json_values, max_size=5
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40) | near_valid.map(lambda o: json.dumps(o).encode()), max_size=8))
def test_arbitrary_lines_never_crash(chunks: list[bytes]) -> None:
    data = b"\n".join(chunks)
    items = parse_bytes(data)  # must not raise
    line_count = len(data.split(b"\n"))
    for item in items:
        assert isinstance(item, (Request, RequestError))
        assert 1 <= item.line <= line_count
        if isinstance(item, RequestError):
            assert item.message and str(item).startswith(f"p.jsonl:{item.line}: ")
            json.dumps(item.to_record())
    assert len({i.line for i in items}) == len(items)


@settings(max_examples=300, deadline=None)
@given(near_valid | json_values)
def test_parse_request_only_raises_field_errors(obj: object) -> None:
    try:
        req = parse_request(obj, path="p", line=1)
    except RequestFieldError as exc:
        assert exc.message
    else:
        assert (req.prompt is None) != (req.messages is None)


bad_lines = st.sampled_from([
    b"{", b"[]", b'{"prompt": ""}', b'{"prompt": "a", "max_tokens": true}', b"\xff",
    b'{"messages": [{"role": "user"}]}', b'{"prompt": "a", "stop": 5}', b"null",
    b'{"custom_id": "z", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a", "n": 200}}',
])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(
    valid_request.map(lambda d: ("good", d)),
    bad_lines.map(lambda b: ("bad", b)),
    st.sampled_from([b"", b"  ", b"\r"]).map(lambda b: ("blank", b)),
), max_size=12), st.booleans())
def test_error_line_numbers_with_mixed_lines(rows: list[tuple[str, object]], crlf: bool) -> None:
    lines = []
    for i, (kind, value) in enumerate(rows, start=1):
        if kind == "good":
            value = {**value, "custom_id": f"id-{i}"}  # type: ignore[dict-item]
            lines.append(json.dumps(value).encode())
        else:
            lines.append(value)  # type: ignore[arg-type]
    items = parse_bytes((b"\r\n" if crlf else b"\n").join(lines))
    good = [i for i, (kind, _) in enumerate(rows, start=1) if kind == "good"]
    bad = [i for i, (kind, _) in enumerate(rows, start=1) if kind == "bad"]
    assert [i.line for i in items if isinstance(i, Request)] == good
    assert [i.line for i in items if isinstance(i, RequestError)] == bad
    for item in items:
        if isinstance(item, Request):
            assert item.custom_id == f"id-{item.line}"


# ----------------------------------------------------------------------------- OpenAI Batch API lines

chat_body = st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=1, max_size=3)},
    optional={"model": texts, "max_completion_tokens": st.integers(1, 10**6), "temperature": st.floats(0, 2),
              "top_p": st.floats(min_value=0, max_value=1, exclude_min=True), "seed": st.integers(0, 2**63),
              "stop": texts | st.lists(texts, min_size=1, max_size=4), "n": st.just(1)})
completion_body = st.fixed_dictionaries(
    {"prompt": texts},
    optional={"model": texts, "max_tokens": st.integers(1, 10**6), "temperature": st.floats(0, 2),
              "stop": texts | st.lists(texts, min_size=1, max_size=4)})
batch_line = st.one_of(
    st.fixed_dictionaries({"custom_id": texts, "method": st.just("POST"), "url": st.just("/v1/chat/completions"),
                           "body": chat_body}),
    st.fixed_dictionaries({"custom_id": texts, "method": st.just("POST"), "url": st.just("/v1/completions"),
                           "body": completion_body}))


@settings(max_examples=150, deadline=None)
@given(batch_line)
def test_batch_lines_parse_to_their_request(d: dict) -> None:
    req = parse_request(json.loads(json.dumps(d)), path="p", line=3)
    body = d["body"]
    assert req.custom_id == d["custom_id"] and req.api == ("chat" if "messages" in body else "completions")
    assert req.model == body.get("model")
    assert req.max_tokens == body.get("max_tokens", body.get("max_completion_tokens"))
    assert req.temperature == float(body.get("temperature", 0.0))
    stop = body.get("stop", ())
    assert req.stop == ((stop,) if isinstance(stop, str) else tuple(stop))
    assert (req.messages == tuple(body["messages"])) if "messages" in body else (req.prompt == body["prompt"])


batchish = st.fixed_dictionaries({}, optional={
    "custom_id": json_values, "method": st.sampled_from(["POST", "GET"]) | json_values,
    "url": st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]) | json_values,
    "body": st.dictionaries(st.sampled_from(["model", "messages", "prompt", "max_tokens", "max_completion_tokens",
                                             "n", "stop", "seed", "logprobs", "tools"]), json_values, max_size=5)
    | json_values})


@settings(max_examples=300, deadline=None)
@given(st.lists(batchish.map(lambda o: json.dumps(o).encode()) | st.binary(max_size=30), max_size=8))
def test_arbitrary_batch_lines_never_crash_and_each_bad_one_is_one_error(chunks: list[bytes]) -> None:
    data = b"\n".join(chunks)
    items = parse_bytes(data)
    assert len({i.line for i in items}) == len(items)  # one item (request or error) per non-blank line
    for item in items:
        if isinstance(item, RequestError):
            assert item.message and item.api in ("simple", "chat", "completions")
            if item.field is not None and item.field.startswith("body."):
                assert item.api in ("chat", "completions")
        else:
            assert item.api in ("simple", "chat", "completions")


@pytest.mark.parametrize("line,field,fragment", [
    ({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}, "method", "POST"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}, "url",
     "/v1/chat/completions"),
    ({"custom_id": "0", "method": "POST", "url": []}, "url", "got array of 0 items"),  # found by hypothesis: unhashable
    ({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}, "custom_id", "missing"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "x"}, "body", "object"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"prompt": "x"}}, "body.prompt",
     "unknown field"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}, "body.messages", "missing"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
      "body": {"messages": [{"role": "user", "content": 5}]}}, "body.messages[0].content", "expected a string"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "stop": ["a"] * 5}},
     "body.stop", "at most 4"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "stop": [""]}},
     "body.stop[0]", "empty"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "tools": []}},
     "body.tools", "not supported by moecc"),
    ({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}, "extra": 1}, "extra",
     "unknown field"),
])
def test_batch_line_errors_name_the_field(line: dict, field: str, fragment: str) -> None:
    with pytest.raises(RequestFieldError) as e:
        parse_request(line, path="p", line=1)
    assert e.value.field == field and fragment in e.value.message, (e.value.field, e.value.message)
