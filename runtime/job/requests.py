"""Reading and validating JSONL request files for ``moecc exec``.

Each non-blank line of the file is one JSON object, in the simple form::

    {"custom_id": "a", "prompt": "Hello", "max_tokens": 32, "stop": ["\n\n"]}
    {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0.7, "seed": 1}

or in OpenAI's Batch API form (the two may be mixed)::

    {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [...], "max_completion_tokens": 64, "stop": "END"}}
    {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi"}}

A bad line never stops the others: it becomes a :class:`RequestError` naming the
file, the 1-based line number and the offending field, while every other line is
still parsed into a :class:`Request` (its sampling fields: runtime/sampling/params.py).
Only the standard library (and that dataclass) is used here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from moecc_runtime.sampling.params import SamplingParams

__all__ = [
    "KNOWN_FIELDS",
    "Request",
    "RequestError",
    "RequestFieldError",
    "iter_identified",
    "iter_request_lines",
    "iter_requests",
    "parse_request",
    "read_requests",
]

#: the sampler's penalties, biases and floors (runtime/sampling/penalties.py), in both line forms
PENALTY_FIELDS: tuple[str, ...] = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                                   "min_tokens")
KNOWN_FIELDS: tuple[str, ...] = (
    "custom_id", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
) + PENALTY_FIELDS + ("logprobs", "top_logprobs", "response_format", "n")
MAX_N = 128  # completions per request, as OpenAI's chat completions allow
MAX_TOP_LOGPROBS = 20  # chat completions' (and simple lines') top_logprobs: 0..20, as OpenAI allows
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's logprobs: 0..5
#: OpenAI Batch API lines: these top-level fields, and a body with these parameters
BATCH_FIELDS: tuple[str, ...] = ("custom_id", "method", "url", "body")
BATCH_URLS: dict[str, str] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
#: body fields that do not change what is generated: accepted and ignored (`model` is echoed)
IGNORED_BODY_FIELDS: tuple[str, ...] = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
#: body fields accepted only with a neutral value (see _NEUTRAL); any other value fails the line
_NEUTRAL: dict[str, tuple[Callable[[object], bool], str, str]] = {
    # field: (is this value neutral?, the neutral values, why another value fails)
    "stream": (lambda v: v is None or v is False, "false",
               "streaming is not supported by moecc (a batch job writes whole results)"),
    "stream_options": (lambda v: v is None, "null", "streaming is not supported by moecc"),
    "best_of": (lambda v: v is None or (type(v) is int and v == 1), "1", "best_of > 1 is not supported yet"),
    "suffix": (lambda v: v is None, "null", "suffix (insertion) is not supported yet"),
}
#: body fields that always fail the line: what moecc does not do
_REFUSED: dict[str, str] = {
    "tools": "tool calling is not supported by moecc",
    "tool_choice": "tool calling is not supported by moecc",
    "functions": "function calling is not supported by moecc",
    "function_call": "function calling is not supported by moecc",
}
_BODY_SAMPLING: tuple[str, ...] = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                   "n") + PENALTY_FIELDS
BODY_FIELDS: dict[str, tuple[str, ...]] = {
    "chat": ("model", "messages", "max_completion_tokens", *_BODY_SAMPLING, *IGNORED_BODY_FIELDS,
             *(k for k in _NEUTRAL if k not in ("best_of", "suffix")), "logprobs", "top_logprobs",
             "response_format", *_REFUSED),
    "completions": ("model", "prompt", "echo", *_BODY_SAMPLING, *IGNORED_BODY_FIELDS, *_NEUTRAL, "logprobs",
                    "top_logprobs",
                    "response_format", *_REFUSED),
}
MAX_STOP_SEQUENCES = 4  # as OpenAI's API allows
_MESSAGE_FIELDS: tuple[str, ...] = ("role", "content")
_NOT_YET_SUPPORTED = frozenset({"stream", "tools", "tool_choice", "functions", "best_of", "suffix"})
#: response_format types: "text" (free text), "json_object" (any JSON object), "json_schema" (OpenAI's
#: structured outputs: {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}})
RESPONSE_FORMAT_TYPES: tuple[str, ...] = ("text", "json_object", "json_schema")
_JSON_SCHEMA_FIELDS: tuple[str, ...] = ("name", "schema", "strict", "description")
_PENALTY_LIMIT = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
_BIAS_LIMIT = 100.0  # and for logit_bias values: [-100, 100]
_SEED_LIMIT = 2**64  # torch.manual_seed accepts seeds in [0, 2**64)
_UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Request(SamplingParams):
    """One validated request: where it came from, its prompt (exactly one of ``prompt`` /
    ``messages`` is set) and its sampling parameters (the SamplingParams fields, keyword-only;
    ``max_tokens`` None means the job's default)."""

    line: int  # 1-based line number in the file
    custom_id: str
    prompt: str | tuple[int, ...] | None  # text, or token ids (as OpenAI's completions API accepts)
    messages: tuple[dict[str, str], ...] | None
    api: str = "simple"  # the line's form: "simple", or the Batch API's "chat" / "completions"
    model: str | None = None  # the Batch API body's "model" (echoed in the output)
    echo: bool = False  # /v1/completions: the prompt comes back before the completion (and in its logprobs)


@dataclass(frozen=True)
class RequestError:
    """A line that could not be turned into a :class:`Request`."""

    path: str
    line: int
    field: str | None  # e.g. "max_tokens", "messages[2].content"; None for whole-line problems
    message: str
    custom_id: str | None  # when it could be read
    api: str = "simple"  # the line's form, when it could be told (for the error's output format)

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}"
        return f"{where}: field '{self.field}': {self.message}" if self.field else f"{where}: {self.message}"

    def to_record(self) -> dict[str, Any]:
        """A JSON-serialisable record for an errors file."""
        return {
            "custom_id": self.custom_id,
            "error": {"line": self.line, "field": self.field, "message": self.message},
        }


class RequestFieldError(Exception):
    """Raised by :func:`parse_request` for an invalid object; ``field`` is None for whole-object problems."""

    def __init__(self, field: str | None, message: str, custom_id: str | None = None) -> None:
        super().__init__(f"field '{field}': {message}" if field else message)
        self.field = field
        self.message = message
        self.custom_id = custom_id
        self.api = "simple"


# --------------------------------------------------------------------------- helpers


def _describe(value: object) -> str:
    """A short human description of a JSON value, e.g. ``int 5``, ``'ten'``, ``null``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"bool {'true' if value else 'false'}"
    if isinstance(value, int):
        return f"int {value}" if value.bit_length() <= 128 else f"int with {value.bit_length()} bits"
    if isinstance(value, float):
        return f"float {value!r}"
    if isinstance(value, str):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    if isinstance(value, list):
        return f"array of {len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _check_str(value: object, field: str, *, allow_empty: bool = True) -> str:
    """Return ``value`` if it is a (non-empty, when required) string encodable as UTF-8."""
    if not isinstance(value, str):
        raise RequestFieldError(field, f"expected a string, got {_describe(value)}")
    if not allow_empty and not value:
        raise RequestFieldError(field, "must not be empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestFieldError(
            field, f"contains an unpaired surrogate escape at character {exc.start}"
        ) from None
    return value


def _check_prompt(value: object) -> str | tuple[int, ...]:
    """A prompt is a non-empty string or a non-empty list of token ids (ints >= 0)."""
    if isinstance(value, list):
        if not value:
            raise RequestFieldError("prompt", "must not be empty")
        for i, t in enumerate(value):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise RequestFieldError("prompt", f"token list item {i}: expected a token id >= 0, got {_describe(t)}")
        return tuple(value)
    if not isinstance(value, str):
        raise RequestFieldError("prompt", f"expected a string or a list of token ids, got {_describe(value)}")
    return _check_str(value, "prompt", allow_empty=False)


def _check_int(value: object, field: str, *, lo: int | None, hi: int | None, expected: str) -> int:
    """Return ``value`` if it is an int (not a bool) with ``lo <= value < hi``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestFieldError(field, f"expected {expected}, got {_describe(value)}")
    if (lo is not None and value < lo) or (hi is not None and value >= hi):
        raise RequestFieldError(field, f"expected {expected}, got {_describe(value)}")
    return value


def _check_float(value: object, field: str, *, expected: str, ok: Callable[[float], bool]) -> float:
    """Return ``value`` as a finite float if it is a number (not a bool) satisfying ``ok``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestFieldError(field, f"expected {expected}, got {_describe(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or not ok(number):
        raise RequestFieldError(field, f"expected {expected}, got {_describe(value)}")
    return number


def _check_messages(value: object) -> tuple[dict[str, str], ...]:
    """Validate a chat ``messages`` list; returns fresh ``{"role", "content"}`` dicts."""
    if not isinstance(value, list):
        raise RequestFieldError(
            "messages", f"expected an array of {{\"role\", \"content\"}} objects, got {_describe(value)}"
        )
    if not value:
        raise RequestFieldError("messages", "must not be empty")
    messages = []
    for i, item in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(item, dict):
            raise RequestFieldError(where, f"expected an object with 'role' and 'content', got {_describe(item)}")
        for key in item:
            if key not in _MESSAGE_FIELDS:
                raise RequestFieldError(f"{where}.{key}", f"unknown field '{key}' (known: role, content)")
        for key in _MESSAGE_FIELDS:
            if key not in item:
                raise RequestFieldError(f"{where}.{key}", "missing required field")
        role = _check_str(item["role"], f"{where}.role", allow_empty=False)
        content = _check_content(item["content"], f"{where}.content")
        messages.append({"role": role, "content": content})
    return tuple(messages)


def _check_content(value: object, field: str) -> str:
    """A message's content: a string, or a list of text parts (``[{"type": "text", "text": ...}]``,
    as the OpenAI API allows), joined in order with newlines (as vLLM joins them)."""
    if not isinstance(value, list):
        if not isinstance(value, str):
            raise RequestFieldError(field, f"expected a string or an array of text parts, got {_describe(value)}")
        return _check_str(value, field)
    texts = []
    for j, part in enumerate(value):
        where = f"{field}[{j}]"
        if not isinstance(part, dict):
            raise RequestFieldError(where, f"expected a content part object {{\"type\": \"text\", \"text\": ...}}, "
                                    f"got {_describe(part)}")
        if "type" not in part:
            raise RequestFieldError(f"{where}.type", "missing required field")
        kind = _check_str(part["type"], f"{where}.type")
        if kind != "text":
            raise RequestFieldError(f"{where}.type", f"content part type {kind!r} is not supported by moecc "
                                    "(text only: a text model reads no images, audio or files)")
        for key in part:
            if key not in ("type", "text"):
                raise RequestFieldError(f"{where}.{key}", f"unknown field '{key}' (known: type, text)")
        if "text" not in part:
            raise RequestFieldError(f"{where}.text", "missing required field")
        texts.append(_check_str(part["text"], f"{where}.text"))
    return "\n".join(texts)


def _check_logit_bias(value: object, field: str) -> tuple[tuple[int, float], ...]:
    """{"<token id>": bias in [-100, 100], ...} -> sorted ((token id, bias), ...)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise RequestFieldError(field, f"expected an object of token id -> bias, got {_describe(value)}")
    out = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise RequestFieldError(f"{field}.{key}", f"expected a token id (a decimal integer >= 0) as the key, "
                                    f"got {_describe(key)}")
        out.append((int(key), _check_float(bias, f"{field}.{key}", expected="a number in [-100, 100]",
                                           ok=lambda b: -_BIAS_LIMIT <= b <= _BIAS_LIMIT)))
    return tuple(sorted(out))


def _check_stop(value: object, field: str) -> tuple[str, ...]:
    """A stop sequence (non-empty string) or a list of at most MAX_STOP_SEQUENCES of them."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise RequestFieldError(field, f"expected a string or an array of strings, got {_describe(value)}")
    if len(items) > MAX_STOP_SEQUENCES:
        raise RequestFieldError(field, f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(items)}")
    where = (lambda i: field) if isinstance(value, str) else (lambda i: f"{field}[{i}]")
    return tuple(_check_str(s, where(i), allow_empty=False) for i, s in enumerate(items))


def _check_response_format(value: object, field: str) -> tuple[str, str] | None:
    """OpenAI's response_format -> None (text), ("json_object", "") or ("json_schema", the schema
    as compact JSON, its keys in the request's order: the order of `properties` is the order
    the output's keys are generated in). Only the shape is checked here: whether the schema can
    be enforced is checked when the job reads it (moecc_runtime.structured.Grammars.check)."""
    if value is None:
        return None
    accepted = ", ".join(f'"{t}"' for t in RESPONSE_FORMAT_TYPES)
    if not isinstance(value, dict):
        raise RequestFieldError(field, f'expected an object like {{"type": "json_object"}} (type one of '
                                f"{accepted}), got {_describe(value)}")
    if "type" not in value:
        raise RequestFieldError(f"{field}.type", f"missing required field (accepted: {accepted})")
    kind = value["type"]
    if not isinstance(kind, str) or kind not in RESPONSE_FORMAT_TYPES:
        raise RequestFieldError(f"{field}.type", f"expected one of {accepted}, got {_describe(kind)}")
    _unknown(value, ("type", "json_schema") if kind == "json_schema" else ("type",), field + ".")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", "")
    where = f"{field}.json_schema"
    if "json_schema" not in value:
        raise RequestFieldError(where, 'missing required field for type "json_schema" '
                                '(an object {"name": ..., "schema": {...}, "strict": true})')
    spec = value["json_schema"]
    if not isinstance(spec, dict):
        raise RequestFieldError(where, 'expected an object {"name": ..., "schema": {...}, "strict": true}, '
                                f"got {_describe(spec)}")
    _unknown(spec, _JSON_SCHEMA_FIELDS, where + ".")
    if spec.get("name") is not None:
        _check_str(spec["name"], f"{where}.name")
    if spec.get("description") is not None:
        _check_str(spec["description"], f"{where}.description")
    _check_bool(spec.get("strict"), f"{where}.strict")
    if "schema" not in spec:
        raise RequestFieldError(f"{where}.schema", "missing required field (the JSON Schema the output must match)")
    schema = spec["schema"]
    if not isinstance(schema, dict):
        raise RequestFieldError(f"{where}.schema", f"expected a JSON Schema object, got {_describe(schema)}")
    return ("json_schema", json.dumps(schema, separators=(",", ":")))


def _check_bool(value: object, field: str) -> bool | None:
    """`value` if it is true, false or null (None)."""
    if value is not None and not isinstance(value, bool):
        raise RequestFieldError(field, f"expected true or false, got {_describe(value)}")
    return value


def _sampling(obj: dict, prefix: str = "", max_tokens_floor: int = 1) -> dict[str, Any]:
    """max_tokens, temperature, top_p, top_k, seed, stop, n, response_format and the penalties of a
    simple line or a Batch API body (where, as in vLLM, top_k -1 also means off). max_tokens may
    be 0 only with `max_tokens_floor` 0 (completions with echo: the prompt alone, scored)."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        if obj.get(name) is not None:
            out[name] = _check_float(obj[name], prefix + name, expected="a number in [-2, 2]",
                                     ok=lambda v: -_PENALTY_LIMIT <= v <= _PENALTY_LIMIT)
    if obj.get("repetition_penalty") is not None:
        out["repetition_penalty"] = _check_float(obj["repetition_penalty"], prefix + "repetition_penalty",
                                                 expected="a number > 0 (1 means off)", ok=lambda v: v > 0)
    if "logit_bias" in obj:
        out["logit_bias"] = _check_logit_bias(obj["logit_bias"], prefix + "logit_bias")
    if obj.get("min_tokens") is not None:
        out["min_tokens"] = _check_int(obj["min_tokens"], prefix + "min_tokens", lo=0, hi=None,
                                       expected="an integer >= 0")
    if obj.get("n") is not None:
        out["n"] = _check_int(obj["n"], prefix + "n", lo=1, hi=MAX_N + 1, expected=f"an integer in [1, {MAX_N}]")
    if obj.get("response_format") is not None:
        out["response_format"] = _check_response_format(obj["response_format"], prefix + "response_format")
    if "max_tokens" in obj:
        out["max_tokens"] = _check_int(obj["max_tokens"], prefix + "max_tokens", lo=max_tokens_floor, hi=None,
                                       expected=f"an integer >= {max_tokens_floor}")
    if "max_completion_tokens" in obj:
        out["max_tokens"] = _check_int(obj["max_completion_tokens"], prefix + "max_completion_tokens", lo=1,
                                       hi=None, expected="an integer >= 1")
    if "temperature" in obj:
        out["temperature"] = _check_float(obj["temperature"], prefix + "temperature",
                                          expected="a number >= 0 (0 means greedy)", ok=lambda t: t >= 0)
    if "top_p" in obj:
        out["top_p"] = _check_float(obj["top_p"], prefix + "top_p", expected="a number in (0, 1]",
                                    ok=lambda p: 0 < p <= 1)
    if "top_k" in obj:
        if prefix and obj["top_k"] == -1 and type(obj["top_k"]) is int:
            out["top_k"] = 0  # vLLM's "off"
        else:
            out["top_k"] = _check_int(obj["top_k"], prefix + "top_k", lo=0, hi=None,
                                      expected="an integer >= 0 (0 means off)")
    if "min_p" in obj:
        out["min_p"] = _check_float(obj["min_p"], prefix + "min_p", expected="a number in [0, 1] (0 means off)",
                                    ok=lambda p: 0 <= p <= 1)
    if "seed" in obj:
        out["seed"] = _check_int(obj["seed"], prefix + "seed", lo=0, hi=_SEED_LIMIT,
                                 expected="an integer in [0, 2**64)")
    if "stop" in obj and obj["stop"] is not None:
        out["stop"] = _check_stop(obj["stop"], prefix + "stop")
    if out.get("min_tokens", 0) > out.get("max_tokens", math.inf):
        raise RequestFieldError(prefix + "min_tokens", f"must be at most max_tokens ({out['max_tokens']}), "
                                f"got {_describe(out['min_tokens'])}")
    return out


def _chat_logprobs(obj: dict, prefix: str = "") -> dict[str, Any]:
    """`logprobs` (true / false / null) and `top_logprobs` (0..20 / null, only with logprobs
    true) of a chat body or a simple line -> {"logprobs": N} when asked, else {}."""
    want = _check_bool(obj.get("logprobs"), prefix + "logprobs")
    top = obj.get("top_logprobs")
    if top is not None:
        top = _check_int(top, prefix + "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS + 1,
                         expected=f"an integer in [0, {MAX_TOP_LOGPROBS}]")
        if top > 0 and not want:
            raise RequestFieldError(prefix + "top_logprobs", f"needs {prefix}logprobs: true, got "
                                    f"{_describe(top)} without it")
    return {"logprobs": top or 0} if want else {}


def _completion_logprobs(body: dict) -> dict[str, Any]:
    """The legacy completions API's `logprobs`: null / false (off) or an integer 0..5 (each
    token's logprob and that many most likely) -> {"logprobs": N} when asked, else {}."""
    top = body.get("top_logprobs")
    if top is not None and not (type(top) is int and top == 0):
        raise RequestFieldError("body.top_logprobs", "is a chat completions field; /v1/completions asks for the "
                                f"top tokens with logprobs: N (0..{MAX_COMPLETION_LOGPROBS}) (accepted: 0 or null), "
                                f"got {_describe(top)}")
    value = body.get("logprobs")
    if value is None or value is False:
        return {}
    n = _check_int(value, "body.logprobs", lo=0, hi=MAX_COMPLETION_LOGPROBS + 1,
                   expected=f"an integer in [0, {MAX_COMPLETION_LOGPROBS}] (or null)")
    return {"logprobs": n}


def _unknown(obj: dict, known: tuple[str, ...], prefix: str = "") -> None:
    unknown = [key for key in obj if key not in known]
    if unknown:
        names = ", ".join(f"'{prefix}{k}'" for k in unknown)
        hint = " (not supported by moecc)" if unknown[0] in _NOT_YET_SUPPORTED else ""
        plural = "s" if len(unknown) > 1 else ""
        raise RequestFieldError(prefix + unknown[0], f"unknown field{plural} {names}{hint} "
                                f"(known: {', '.join(known)})")


def _prefixed(prefix: str, check: Callable[[], Any]) -> Any:
    """Run a field check whose errors name fields relative to `prefix` (e.g. "body.")."""
    try:
        return check()
    except RequestFieldError as exc:
        raise RequestFieldError(prefix + exc.field if exc.field else prefix.rstrip("."), exc.message) from None


def _parse_batch_line(obj: dict, line: int, custom_id: str) -> Request:
    """An OpenAI Batch API line: method POST, a supported url, a body of its parameters."""
    _unknown(obj, BATCH_FIELDS)
    if "custom_id" not in obj:
        raise RequestFieldError("custom_id", "missing required field (every Batch API line has one)")
    if obj.get("method") != "POST":
        raise RequestFieldError("method", f"expected \"POST\", got {_describe(obj.get('method'))}")
    url = obj.get("url")
    if not isinstance(url, str) or url not in BATCH_URLS:
        raise RequestFieldError("url", f"expected one of {', '.join(BATCH_URLS)}, got {_describe(url)}")
    api = BATCH_URLS[url]
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RequestFieldError("body", f"expected an object of request parameters, got {_describe(body)}")
    _unknown(body, BODY_FIELDS[api], "body.")
    for key in body:
        if key in _REFUSED:
            raise RequestFieldError(f"body.{key}", f"{_REFUSED[key]}; remove '{key}' from the request")
        if key in _NEUTRAL:
            neutral, accepted, why = _NEUTRAL[key]
            if not neutral(body[key]):
                raise RequestFieldError(f"body.{key}", f"{why} (accepted: {accepted}), got {_describe(body[key])}")
    model = _check_str(body["model"], "body.model") if body.get("model") is not None else None
    if api == "chat":
        if "messages" not in body:
            raise RequestFieldError("body.messages", "missing required field for /v1/chat/completions")
        messages, prompt = _prefixed("body.", lambda: _check_messages(body["messages"])), None
    else:
        if "prompt" not in body:
            raise RequestFieldError("body.prompt", "missing required field for /v1/completions")
        prompt, messages = _prefixed("body.", lambda: _check_prompt(body["prompt"])), None
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise RequestFieldError("body.max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    echo = api == "completions" and bool(_check_bool(body.get("echo"), "body.echo"))
    knobs = _sampling(body, "body.", max_tokens_floor=0 if echo else 1)
    knobs.update(_chat_logprobs(body, "body.") if api == "chat" else _completion_logprobs(body))
    if echo:
        knobs["echo"] = True
    return Request(line=line, custom_id=custom_id, prompt=prompt, messages=messages, api=api, model=model, **knobs)


# --------------------------------------------------------------------------- parsing


def parse_request(obj: object, *, path: str, line: int) -> Request:
    """Validate one decoded JSON value into a :class:`Request`.

    Raises :class:`RequestFieldError` (with the ``custom_id`` when it could be read).
    ``path`` is accepted for symmetry with the file readers; errors carry no path.
    """
    del path  # errors are located by the caller, which knows the file
    if not isinstance(obj, dict):
        raise RequestFieldError(None, f"expected a JSON object, got {_describe(obj)}")

    custom_id: str | None = None
    try:
        if "custom_id" in obj:
            custom_id = _check_str(obj["custom_id"], "custom_id", allow_empty=False)
        else:
            custom_id = f"request-{line}"
        if any(key in obj for key in ("method", "url", "body")):
            try:
                return _parse_batch_line(obj, line, custom_id)
            except RequestFieldError as exc:
                url = obj.get("url")
                exc.api = BATCH_URLS.get(url, "chat") if isinstance(url, str) else "chat"
                raise
        _unknown(obj, KNOWN_FIELDS)
        has_prompt, has_messages = "prompt" in obj, "messages" in obj
        if has_prompt and has_messages:
            raise RequestFieldError("messages", "give exactly one of 'prompt' or 'messages', not both")
        if not (has_prompt or has_messages):
            raise RequestFieldError(None, "missing 'prompt' or 'messages' (exactly one is required)")
        prompt = _check_prompt(obj["prompt"]) if has_prompt else None
        messages = _check_messages(obj["messages"]) if has_messages else None
        knobs = _sampling(obj)
        knobs.update(_chat_logprobs(obj))
    except RequestFieldError as exc:
        exc.custom_id = custom_id
        raise

    return Request(line=line, custom_id=custom_id, prompt=prompt, messages=messages, **knobs)


class _BadJson(ValueError):
    """Raised from json hooks for valid-but-unwanted JSON (NaN, duplicate keys)."""


def _reject_constant(name: str) -> object:
    raise _BadJson(f"{name} is not allowed (only finite numbers)")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _BadJson(f"duplicate key '{key}' in a JSON object")
        obj[key] = value
    return obj


def _decode_line(raw: bytes) -> object:
    """Decode one line's bytes into a JSON value, raising RequestFieldError(None, ...) on failure."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestFieldError(None, f"invalid UTF-8 at byte {exc.start + 1} of the line") from None
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise RequestFieldError(None, f"malformed JSON: {exc.msg} at column {exc.colno}") from None
    except _BadJson as exc:
        raise RequestFieldError(None, f"malformed JSON: {exc}") from None
    except RecursionError:
        raise RequestFieldError(None, "malformed JSON: nested too deeply") from None
    except ValueError as exc:  # e.g. integers longer than Python's int/str digit limit
        raise RequestFieldError(None, f"malformed JSON: {exc}") from None


def iter_request_lines(lines: Iterable[bytes], *, path: str = "<input>",
                       seen: dict[str, int] | None = None) -> Iterator[Request | RequestError]:
    """Parse JSONL from an iterable of byte lines (as from a binary file), in order.

    Lines may end in ``\\n`` or ``\\r\\n``; blank lines are skipped; a UTF-8 BOM on
    line 1 is ignored. Never raises for bad content: bad lines yield RequestError.
    `seen` (filled as lines are read): each readable custom_id -> the line it first came on,
    the one record of the file kept (duplicates are found with it).
    """
    seen = {} if seen is None else seen
    for number, raw in enumerate(lines, start=1):
        raw = raw.rstrip(b"\n").rstrip(b"\r")
        if number == 1 and raw.startswith(_UTF8_BOM):
            raw = raw[len(_UTF8_BOM):]
        if not raw.strip():
            continue
        try:
            request = parse_request(_decode_line(raw), path=path, line=number)
        except RequestFieldError as exc:
            if exc.custom_id is not None and exc.custom_id not in seen:
                seen[exc.custom_id] = number  # its outputs would also be keyed by this id
            yield RequestError(path, number, exc.field, exc.message, exc.custom_id, exc.api)
            continue
        first = seen.setdefault(request.custom_id, number)
        if first != number:
            yield RequestError(
                path, number, "custom_id",
                f"duplicate custom_id '{request.custom_id}' (first seen on line {first})", request.custom_id,
                request.api,
            )
        else:
            yield request


def iter_requests(path: str | os.PathLike[str]) -> Iterator[Request | RequestError]:
    """Stream requests and errors from a JSONL file, reading bytes line by line.

    The file is opened eagerly, so a missing file or a directory raises its
    ``OSError`` (FileNotFoundError, IsADirectoryError, ...) here, naming the path.
    """
    name = os.fspath(path)
    with open(name, "rb"):
        pass  # surface OSErrors now rather than on the first next()

    def generate() -> Iterator[Request | RequestError]:
        with open(name, "rb") as f:
            yield from iter_request_lines(f, path=name)

    return generate()


def read_requests(path: str | os.PathLike[str]) -> tuple[list[Request], list[RequestError]]:
    """Read a whole JSONL file into (valid requests, errors), each in file order."""
    requests: list[Request] = []
    errors: list[RequestError] = []
    for item in iter_requests(path):
        (requests if isinstance(item, Request) else errors).append(item)
    return requests, errors


# --------------------------------------------------------------------------- request identity


def canonical_line(raw: bytes, first: bool = False) -> bytes:
    """A line's content as hashed for its identity: its JSON re-serialised (sorted keys,
    compact, ASCII) when it parses, else its stripped bytes. Needs: one line's bytes (line 1
    may carry a UTF-8 BOM, `first`). Guarantees: reformatting or reordering a line's keys
    never changes it; any change of a value does."""
    raw = raw.rstrip(b"\n").rstrip(b"\r")
    if first and raw.startswith(_UTF8_BOM):
        raw = raw[len(_UTF8_BOM):]
    raw = raw.strip()
    try:
        return json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode("ascii")
    except (ValueError, RecursionError):  # not JSON (or not text): the bytes themselves
        return raw


def request_hash(canonical: bytes, occurrence: int, default_max_tokens: int | None) -> str:
    """16 hex digits naming one request of a job: its canonical line, the how-manieth line
    with its custom_id it is (0: the first; a duplicate's error never stands for the first,
    valid request, even with identical contents), and the job's default max_tokens when it
    can change the result (None: the line sets its own, or is a bad line, which fails anyway)."""
    h = hashlib.sha256(b"moecc.request\x00" + canonical)
    h.update(f"\x00{occurrence}\x00{default_max_tokens if default_max_tokens is not None else '-'}".encode())
    return h.hexdigest()[:16]


def iter_identified(path: str | os.PathLike[str] | IO[bytes], default_max_tokens: int) -> Iterator[
        tuple[Request | RequestError, str]]:
    """Each item of :func:`iter_requests` with its request hash (:func:`request_hash`).
    Lines whose custom_id cannot be read count occurrences by their content instead. Raises
    the file's OSError here, as iter_requests does; never raises for bad content. `path` may
    be a binary stream already open (stdin, a pipe: source.PromptSource.open_stream), read
    once as it comes and named in errors by its `name` ("<stdin>" for stdin)."""
    stream = path if hasattr(path, "read") else None
    name = _stream_name(stream) if stream is not None else os.fspath(path)  # type: ignore[arg-type]
    if stream is None:
        with open(name, "rb"):
            pass

    def generate() -> Iterator[tuple[Request | RequestError, str]]:
        tapped: list[tuple[int, bytes]] = [(0, b"")]  # the line iter_request_lines read last

        def tap(lines: Iterable[bytes]) -> Iterator[bytes]:
            for number, raw in enumerate(lines, start=1):
                tapped[0] = (number, raw)
                yield raw

        first: dict[str, int] = {}  # custom_id -> its first line (iter_request_lines fills it)
        again: dict[str, int] = {}  # occurrences counted so far of repeated ids and of unreadable ones
        with (open(name, "rb") if stream is None else contextlib.nullcontext(stream)) as f:
            for item in iter_request_lines(tap(f), path=name, seen=first):
                number, raw = tapped[0]
                if number != item.line:  # iter_request_lines yields each line's item before reading on
                    raise AssertionError(f"request line {item.line} read as line {number}")
                canonical = canonical_line(raw, first=number == 1)
                if item.custom_id is not None and first.get(item.custom_id) == number:
                    occurrence = 0  # the common case: no second record per line
                else:
                    who = item.custom_id if item.custom_id is not None else "\x00" + canonical.hex()
                    occurrence = again.get(who, 0 if item.custom_id is None else 1)
                    again[who] = occurrence + 1
                default = default_max_tokens if isinstance(item, Request) and item.max_tokens is None else None
                yield item, request_hash(canonical, occurrence, default)

    return generate()


def _stream_name(f: object) -> str:
    """How errors name an open stream: "<stdin>" for standard input, else its path."""
    name = getattr(f, "name", None)
    if name in (0, "<stdin>") or f is getattr(sys.stdin, "buffer", None):
        return "<stdin>"
    return str(name) if isinstance(name, str) else "<input>"
