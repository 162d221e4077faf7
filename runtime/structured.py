"""Structured outputs (OpenAI ``response_format``): token masks from the llguidance grammar engine.

A request's ``response_format`` (parsed by :mod:`moecc_runtime.job.requests`) is one of

* ``("json_object", "")``: any JSON object (the JSON schema ``{"type": "object"}``);
* ``("json_schema", text)``: the JSON schema ``text`` (JSON, its keys in the request's order:
  the order of ``properties`` is the order the output's keys are generated in).

:class:`GrammarCompiler` is built once per job from the checkpoint's tokenizer, by the job's
:class:`Grammars` (its one owner, the only place a job builds one); it compiles
each distinct response_format once (cached) and hands out a fresh :class:`Matcher` per
sequence. Each decode step, :func:`fill_masks` computes every constrained row's allowed
tokens at once (llguidance's executor, in parallel threads, outside the GIL), the sampler
keeps only those, and the chosen token is fed back with :meth:`Matcher.accept`.

Guarantees: a mask always allows at least one token, and EOS whenever the grammar is
complete (accepting), so generation can always end; a finished (``done``) matcher allows
exactly the EOS ids; tokens the tokenizer does not know (model vocabulary larger than the
tokenizer's) are never allowed. Whitespace between JSON tokens is bounded (at most one line
break and 32 spaces/tabs per gap), so sampling cannot run away in whitespace.

llguidance is imported inside functions only: importing this module is cheap.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["GrammarCompiler", "Grammars", "Matcher", "fill_bitmask", "fill_masks", "output_error", "unpack_bitmask",
           "WHITESPACE"]

#: whitespace allowed between JSON tokens (llguidance's whitespace_pattern): bounded, so a
#: sampled output cannot loop in whitespace; covers compact and pretty-printed JSON
WHITESPACE = r"(\x0D?\x0A)?[\x20\x09]{0,32}"
_KINDS = ("json_object", "json_schema")
_CACHE_SIZE = 256  # compiled grammars kept per compiler (100k requests share a few schemas)
_executor_lock = threading.Lock()
_executor: Any = None


def _get_executor() -> Any:
    """The process's llguidance executor (created on first use). Threads: MOECC_GRAMMAR_THREADS
    if set, else llguidance's default (80% of the CPUs, at most 32)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            n = os.environ.get("MOECC_GRAMMAR_THREADS")
            _executor = llguidance.LLExecutor(num_threads=int(n) if n else None)
        return _executor


class Matcher:
    """One sequence's position in its grammar. Made by :meth:`GrammarCompiler.matcher`."""

    __slots__ = ("_m", "vocab_size", "eos_ids")

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self._m = matcher  # llguidance.LLMatcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    def accept(self, token: int) -> None:
        """Advance by the sampled token. Needs: a token its last mask allowed (EOS once the
        grammar is complete or done is fine). A token the grammar refuses puts the matcher
        in an error state (see :attr:`error`), which is ``done``: only EOS follows. Never raises."""
        if self._m.is_stopped() and int(token) in self.eos_ids:
            return
        self._m.consume_token(int(token))

    @property
    def done(self) -> bool:
        """True when the grammar is complete and nothing but EOS can follow (or in error)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """True when the output so far is a complete document (EOS is allowed now)."""
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a refused token, a grammar limit hit), or None."""
        return self._m.get_error() or None if self._m.is_error() else None


class GrammarCompiler:
    """Compiles response_formats into matchers for one tokenizer; built once per job.

    Needs: a :class:`moecc_runtime.tokenizer.Tokenizer` (its fast HF tokenizer ``.tok``) and the
    model's vocabulary size V (logit width, >= the tokenizer's vocabulary). EOS ids: ``eos_ids``
    if given, else the tokenizer's ``eos_token_id``. Guarantees: each distinct response_format
    is compiled once (an LRU of the last 256); matchers are cheap copies of the compiled one.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, eos_ids: list[int] | None = None) -> None:
        import llguidance.hf

        hf = tokenizer.tok if hasattr(tokenizer, "tok") else tokenizer
        n_tok = len(hf)
        if vocab_size < n_tok:
            raise ValueError(f"the model's vocabulary ({vocab_size}) is smaller than the tokenizer's ({n_tok})")
        if eos_ids is None:
            eos = hf.eos_token_id
            eos_ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
        eos_ids = sorted({int(e) for e in eos_ids})
        if not eos_ids:
            raise ValueError("the tokenizer has no eos_token_id; pass eos_ids")
        bad = [e for e in eos_ids if not 0 <= e < vocab_size]
        if bad:
            raise ValueError(f"EOS ids {bad} are outside the model's vocabulary [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self._lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos_ids)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_plan(cls, tokenizer: Any, plan: dict[str, Any]) -> "GrammarCompiler":
        """The compiler of a plan's model: its vocabulary (logit width) and EOS ids."""
        info = plan["model"]["info"]
        return cls(tokenizer, int(info["vocab_size"]), eos_ids=[int(t) for t in info["eos_token_ids"]])

    def _grammar(self, response_format: tuple[str, str]) -> str:
        """The llguidance grammar text of a response_format; raises ValueError."""
        import llguidance

        kind, text = response_format
        if kind == "json_object":
            schema: Any = {"type": "object"}
        elif kind == "json_schema":
            try:
                schema = json.loads(text)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"response_format json_schema: the schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("response_format json_schema: the schema must be a JSON object")
        else:
            raise ValueError(f"response_format type {kind!r} is not supported (accepted: {', '.join(_KINDS)})")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, overrides={"whitespace_pattern": WHITESPACE, "lenient": False})
        except ValueError as exc:
            raise ValueError(f"response_format {kind}: {exc}") from None

    def _compiled(self, response_format: tuple[str, str]) -> Any:
        """The pristine compiled LLMatcher of a response_format (cached); raises ValueError."""
        import llguidance

        key = (str(response_format[0]), str(response_format[1]))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        matcher = llguidance.LLMatcher(self._lltok, self._grammar(key), log_level=0)
        what = "json_object" if key[0] == "json_object" else "json_schema"
        if matcher.is_error():
            raise ValueError(f"response_format {what}: the schema cannot be used: {matcher.get_error()}")
        probe = matcher.deep_copy()
        probe.compute_bitmask()  # the first mask: a grammar with no finite document stops here, in error
        if probe.is_stopped() and not probe.is_accepting():
            raise ValueError(f"response_format {what}: no finite JSON document satisfies the schema (it can only "
                             f"be completed by an infinite one, e.g. a $ref that refers only to itself); give a "
                             f"schema some document can satisfy")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def check(self, response_format: tuple[str, str]) -> None:
        """Raise ValueError naming the problem if the response_format's grammar cannot be built
        (not JSON, unsatisfiable, unsupported keywords such as ``not`` or ``uniqueItems``, ...).
        A successful check compiles and caches the grammar."""
        self._compiled(response_format)

    def matcher(self, response_format: tuple[str, str]) -> Matcher:
        """A fresh matcher at the grammar's start; raises ValueError as :meth:`check` does."""
        return Matcher(self._compiled(response_format).deep_copy(), self.vocab_size, self.eos_ids)


def fill_bitmask(matchers: list[Matcher], vocab_size: int) -> torch.Tensor:
    """int32 [S, ceil(V/32)] on the CPU: bit t%32 of word t//32 of row i is set where token t is
    allowed for matchers[i] (llguidance's packed layout; 32x smaller than a bool mask, so
    cheaper to copy to a device, then :func:`unpack_bitmask` there). Rows computed in
    parallel by llguidance's executor; a done matcher's row allows exactly its EOS ids."""
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros(len(matchers), words, dtype=torch.int32)  # [S, W]
    live = []
    for i, m in enumerate(matchers):
        if m.vocab_size != vocab_size:
            raise ValueError(f"matcher {i} was built for a vocabulary of {m.vocab_size}, not {vocab_size}")
        if m.done:
            for e in m.eos_ids:
                bitmask[i, e // 32] |= _bit(e % 32)
        else:
            live.append((m._m, i))
    if live:
        if len(live) == 1:
            live[0][0].unsafe_compute_mask_ptr(bitmask[live[0][1]].data_ptr(), words * 4)
        else:
            _get_executor().unsafe_compute_mask_ptr(live, bitmask.data_ptr(), words * 4, len(matchers))
        rows = torch.tensor([i for _, i in live])
        empty = rows[(bitmask[rows] == 0).all(dim=1)].tolist()  # a grammar limit hit this step: end it
        for i in empty:
            for e in matchers[i].eos_ids:
                bitmask[i, e // 32] |= _bit(e % 32)
    return bitmask


def _bit(k: int) -> int:
    """Bit k of an int32 word as a (signed) Python int."""
    return -(1 << 31) if k == 31 else 1 << k


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [S, V] from a packed int32 [S, ceil(V/32)] bitmask, on the bitmask's device
    (little-endian byte order, as on x86 and ARM)."""
    bytes_ = bitmask.contiguous().view(torch.uint8)  # [S, 4W]: byte b of word w is tokens 32w+8b..
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = (bytes_.unsqueeze(-1) >> shifts) & 1  # [S, 4W, 8]
    return bits.view(bitmask.shape[0], bytes_.shape[1] * 8)[:, :vocab_size].bool()  # [S, V]


class Grammars:
    """A job's (or a Ray actor's) structured outputs: the one owner of its
    :class:`GrammarCompiler`, built on first use (llguidance is loaded only once a request has
    a response_format) for the plan's model (vocabulary, EOS ids) and the checkpoint's
    tokenizer. The reader checks formats with it, generate takes it as its ``grammar``
    callback (a fresh matcher per sequence), the writer checks outputs with it."""

    def __init__(self, tokenizer: Any, plan: dict[str, Any]) -> None:
        self._tokenizer, self._plan = tokenizer, plan
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        """The compiler (built once, on first use)."""
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler.for_plan(self._tokenizer, self._plan)
            return self._compiler

    def check(self, response_format: tuple[str, str]) -> None:
        """Raise ValueError (saying why) when `response_format` cannot be enforced."""
        self.compiler.check(response_format)

    def __call__(self, request: Any) -> Matcher:
        """A fresh matcher for a request with a response_format (generate's ``grammar``)."""
        assert request.response_format is not None, f"request {request.key!r} has no response_format"
        return self.compiler.matcher(request.response_format)

    def output_error(self, text: str, response_format: tuple[str, str], token_ids: list[int]) -> str | None:
        """:func:`output_error` with this job's compiler (for the grammar replay)."""
        return output_error(text, response_format, token_ids, self.compiler)


def fill_masks(matchers: list[Matcher], vocab_size: int) -> torch.Tensor:
    """bool [S, V] on the CPU: True where a token is allowed, one row per matcher, all rows
    computed at once (in parallel, in llguidance). Guarantees: tokens >= the tokenizer's
    vocabulary are False; EOS is True whenever the matcher is accepting; a done matcher
    allows exactly its EOS ids; every row has at least one True."""
    return unpack_bitmask(fill_bitmask(matchers, vocab_size), vocab_size)


def output_error(text: str, response_format: tuple[str, str], token_ids: list[int] | None = None,
                 compiler: GrammarCompiler | None = None) -> str | None:
    """Why a completion that ended with finish_reason "stop" breaks its response_format's
    promise (None: it keeps it): its text must parse as JSON (no NaN or Infinity), be an
    object for json_object, and validate against the schema for json_schema (with the
    jsonschema package when installed, else by replaying `token_ids` through a fresh matcher
    of `compiler`, which must end accepting). The last line of defence before a result is
    written; the masks make a failure here a bug, never a normal outcome."""
    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        value = json.loads(text, parse_constant=no_constant)
    except (ValueError, RecursionError) as e:
        return f"its text is not valid JSON ({e})"
    kind, schema_text = response_format
    if kind == "json_object":
        return None if isinstance(value, dict) else f"its text is JSON but not an object ({type(value).__name__})"
    return _schema_error(value, schema_text, token_ids, compiler)


def _schema_error(value: Any, schema_text: str, token_ids: list[int] | None,
                  compiler: GrammarCompiler | None) -> str | None:
    """Why `value` does not validate against the JSON schema `schema_text` (None: it does)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        schema = json.loads(schema_text)
        try:
            cls = jsonschema.validators.validator_for(schema)
            error = jsonschema.exceptions.best_match(cls(schema).iter_errors(value))
        except jsonschema.exceptions.SchemaError:
            error = None  # a schema jsonschema itself cannot read: the grammar replay below decides
        else:
            if error is None:
                return None
            where = "/".join(str(p) for p in error.absolute_path) or "(the document)"
            return f"it does not validate against the schema at {where}: {error.message}"
    if token_ids is None or compiler is None:
        return None
    m = compiler.matcher(("json_schema", schema_text))
    for t in token_ids:
        if int(t) in m.eos_ids:
            break
        m.accept(int(t))
    return None if m.accepting else "its tokens do not complete the schema's grammar"
