"""A job's requests in, encoded: the input read lazily as the scheduler admits requests,
each line validated (job/requests.py), tokenized and checked against the model
(`encode_request`), what a resumed job already did skipped, and each request yielded with
what its result will need (`Pending`) kept until it is written. A bad line fails alone, as it
is reached: the reader hands it to the job's writer at once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from moecc_runtime.job.requests import Request, RequestError, iter_identified
from moecc_runtime.job.results import Done, error_key
from moecc_runtime.job.source import PromptSource
from moecc_runtime.scheduler.sequence import GenRequest
from moecc_runtime.structured import Grammars
from moecc_runtime.tokenizer import Tokenizer


class EncodeError(ValueError):
    """A request that parsed but cannot run, naming its field (relative to the body)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def encode_request(req: Request, tok: Tokenizer, context: int, default_max: int, vocab: int,
                   grammars: Grammars | None = None) -> GenRequest:
    """The GenRequest of a validated request: its prompt tokenized and checked against the
    model (context, vocabulary), its response_format checked enforceable (`grammars`: needed
    when it has one), its SamplingParams carried over whole with max_tokens resolved. Raises
    ValueError (EncodeError naming the field when not the prompt)."""
    # the longest prompt: one position left to generate into, or with echo the whole context (the
    # prompt alone comes back, scored; nothing is generated past the context)
    limit = context if req.echo else context - 1
    least = tok.min_tokens(req)  # checked before tokenizing: a huge line fails fast and small
    if least > limit:
        raise ValueError(f"prompt is at least {least} tokens (judged from its length, before tokenizing), "
                         f"the model's context is {context}; shorten it to at most {limit} tokens")
    ids = tok.encode_request(req)
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the model's vocabulary of {vocab}")
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    if len(ids) > limit:
        raise ValueError(f"prompt is {len(ids)} tokens, the model's context is {context}; "
                         f"shorten it to at most {limit} tokens")
    bad = next((t for t, _ in req.logit_bias if t >= vocab), None)
    if bad is not None:
        raise EncodeError("logit_bias", f"logit_bias names token id {bad}, outside the model's vocabulary of {vocab}")
    if req.response_format is not None:
        assert grammars is not None, "a request with a response_format needs the job's grammars"
        try:
            grammars.check(req.response_format)
        except ValueError as e:
            kind = req.response_format[0]
            raise EncodeError("response_format.json_schema.schema" if kind == "json_schema" else "response_format",
                              str(e)) from None
    max_new = min(default_max if req.max_tokens is None else req.max_tokens, context - len(ids))
    return GenRequest(key=req.custom_id, prompt_ids=ids, **req.sampling(
        max_tokens=max_new, prompt_logprobs=req.logprobs if req.echo else None))


def count_request_lines(path: str | Path, chunk: int = 1 << 20) -> int:
    """The lines of a prompts file that hold a request (or a bad line): the non-blank ones, as
    requests.iter_request_lines counts them (a UTF-8 BOM before line 1 ignored). One buffered
    pass over the bytes, holding one line at a time: about 0.1 s per 100 MB."""
    with open(path, "rb", buffering=chunk) as f:
        first = f.readline()
        if first.startswith(b"\xef\xbb\xbf"):
            first = first[3:]
        return int(bool(first.strip())) + sum(map(bool, map(bytes.strip, f)))


@dataclass(frozen=True)
class Pending:
    """A request read and not yet written: what its result or error line needs."""

    line: int  # its input line
    request: str  # its request hash (results.py's identity)
    api: str  # the line's form ("simple", "chat", "completions")
    model: str | None  # the Batch API body's model, echoed
    stop: tuple[str, ...]  # its stop strings (its texts are cut at the first)
    echo: str | None  # the prompt's text when it is echoed
    cap: int  # the tokens it may generate (max_tokens x n), for the ETA
    response_format: tuple[str, str] | None  # its structured output's promise, checked when it ends


#: how the reader fails a line: (error record, the log's text, request hash, api)
Fail = Callable[[dict[str, Any], str, str, str], None]


class RequestReader:
    """Reads a job's input (a regular file by its path, a stream once: `source`) into encoded
    requests; `pending` holds the requests yielded and not yet written (`forget` drops one),
    never the file. Counts every line into `summary` (requests, skipped); bad lines go to `fail`."""

    def __init__(self, plan: dict[str, Any], source: PromptSource, prompts_path: str | Path, tok: Tokenizer,
                 grammars: Grammars, summary: Any, done: Done, max_tokens: int, fail: Fail):
        self.source, self.prompts_path, self.tok, self.grammars = source, prompts_path, tok, grammars
        self.context = int(plan["model"]["info"]["max_position_embeddings"])
        self.vocab = int(plan["model"]["info"]["vocab_size"])
        self.summary, self.done, self.max_tokens, self.fail = summary, done, max_tokens, fail
        self.pending: dict[str, Pending] = {}  # custom_id -> its bookkeeping, while in flight
        self.prog: Any = None  # the job's Progress, once shown (job/exec.py Job.start_progress)
        self.lines_total: int | None = None  # the input's request lines (`expected` counts them)
        self.read_all = False  # read() reached the end of the input

    def read(self) -> Iterator[GenRequest]:
        """The requests still to run, encoded, read lazily from the file as the runner pulls
        them (a million-line file is never held whole); bad lines and unencodable prompts
        fail alone as they are reached (their error record written at once). Skipped (a
        resumed job): a request whose result stands with the same request hash, and a line
        whose error stands under the same error_key (custom_id, request hash). Custom_ids
        yielded are unique: a repeated one is a bad line (requests.iter_request_lines)."""
        where = self.source.open_stream() if self.source.stream else self.prompts_path
        for item, request in iter_identified(where, self.max_tokens):
            self.summary.requests += 1
            if isinstance(item, RequestError):
                if error_key(item.custom_id, request) in self.done.errors:
                    self.summary.skipped += 1
                    continue
                self.fail(item.to_record(), str(item), request, item.api)
                continue
            if (self.done.results.get(item.custom_id) == request
                    or error_key(item.custom_id, request) in self.done.errors):
                self.summary.skipped += 1
                continue
            gen = self._encoded(item, request)
            if gen is not None:
                yield gen
        self.read_all = True
        if self.prog is not None:  # the exact figure, now that every line was read
            self.prog.set_total(self.summary.requests - self.summary.skipped)

    def _encoded(self, item: Request, request: str) -> GenRequest | None:
        """`item` encoded and its bookkeeping kept, or None when it failed (written at once)."""
        try:
            gen = encode_request(item, self.tok, self.context, self.max_tokens, self.vocab,
                                 self.grammars if item.response_format is not None else None)
        except ValueError as e:
            field_ = getattr(e, "field", None) or ("prompt" if item.prompt is not None else "messages")
            if item.api != "simple":
                field_ = "body." + field_
            rec = {"custom_id": item.custom_id, "error": {"line": item.line, "field": field_, "message": str(e)}}
            self.fail(rec, f"{self.source.name}:{item.line}: {e}", request, item.api)
            return None
        self.pending[item.custom_id] = Pending(item.line, request, item.api, item.model, item.stop,
                                               self._echo(item, gen), gen.max_tokens * gen.n, gen.response_format)
        if self.prog is not None:
            self.prog.expect(gen.max_tokens * gen.n)
        return gen

    def _echo(self, item: Request, gen: GenRequest) -> str | None:
        """The text an echoed prompt comes back as: as given, or its token ids decoded."""
        if not item.echo:
            return None
        return item.prompt if isinstance(item.prompt, str) else self.tok.decode(gen.prompt_ids)

    def forget(self, key: str) -> None:
        """Drop a written (or failed) request's bookkeeping, so it never grows with the file."""
        self.pending.pop(key, None)

    def expected(self) -> int | None:
        """The requests this run will read and not skip, before the first is read: the input's
        request lines (a byte scan, count_request_lines) less those a resumed job skips; None
        for a stream (not known until it ends)."""
        if self.source.stream:
            return None
        self.lines_total = count_request_lines(self.prompts_path)
        return max(0, self.lines_total - int(getattr(self.done, "standing", 0)))

    def settle_counts(self) -> None:
        """An interrupted run did not read the whole input: count its unread request lines
        (`requests`) and, for a resumed job, the skips among them (`skipped`), as a run that
        read everything first counts them. Unread bad lines are not failed here: like the
        unread requests they are not run (a resumed job reaches them)."""
        if self.read_all or self.lines_total is None:
            return
        self.summary.requests = max(self.summary.requests, self.lines_total)
        self.summary.skipped = max(self.summary.skipped, int(getattr(self.done, "standing", 0)))
