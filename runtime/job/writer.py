"""A job's results out: each finished request's completions (texts cut at their first stop
string, logprobs with their token texts) written as one result line, each failed one as an
error record (on the log too), and both counted in the summary and on the progress display.
The lines themselves are formatted and made durable by results.ResultWriter."""

from __future__ import annotations

from typing import IO, Any

from moecc_runtime.job.reader import Pending
from moecc_runtime.job.results import Completion, ResultWriter, TokenLogprob
from moecc_runtime.scheduler.sequence import GenRequest, GenResult
from moecc_runtime.structured import Grammars
from moecc_runtime.tokenizer import Tokenizer


class JobWriter:
    """Writes outcomes through `lines` (a ResultWriter) and counts them in `summary`; needs
    each request's Pending record (job/reader.py). `prog`: the progress display, once shown."""

    def __init__(self, lines: ResultWriter, tok: Tokenizer, grammars: Grammars, summary: Any,
                 log: IO[str] | None, prompts_name: str):
        self.lines, self.tok, self.grammars, self.summary = lines, tok, grammars, summary
        self.log, self.prompts_name = log, prompts_name
        self.prog: Any = None

    def fail(self, record: dict[str, Any], text: str, request: str, api: str = "simple",
             cap: int | None = None) -> None:
        """A failed request: counted, on the log, and its error record (with the request
        hash `request`) in the errors file. `cap`: its max_tokens x n when it was read as a
        request and then failed (progress counts it out of those in flight)."""
        self.summary.failed += 1
        self.summary.errors.append(record)
        if self.log is not None:
            if self.prog is not None:
                self.prog.log(f"error: {text}")
            else:
                print(f"error: {text}", file=self.log)
        self.lines.error(record, request, api)
        if self.prog is not None:
            self.prog.request(False, cap=cap)

    def finished(self, r: GenResult, p: Pending) -> None:
        """Write a finished request's result, each completion's text cut at its first stop
        string; a constrained one whose "stop" output breaks its response_format fails instead."""
        texts = [self.tok.output_text(c.token_ids, p.stop) for c in r.completions]
        broken = self._broken_promise(p, r.completions, texts)
        if broken is not None:
            field_ = "response_format" if p.api == "simple" else "body.response_format"
            self._fail(r.key, p, field_, broken)
            return
        self.summary.succeeded += 1
        self.summary.prompt_tokens += len(r.prompt_ids)
        prompt = self._token_logprobs(r.prompt_ids, r.prompt_logprobs)
        completions = [Completion((p.echo or "") + text, c.token_ids, c.finish_reason,
                                  _joined(prompt, self._token_logprobs(c.token_ids, c.logprobs)))
                       for c, text in zip(r.completions, texts)]
        self.summary.completion_tokens += sum(len(c.token_ids) for c in completions)
        self.lines.result(r.key, p.api, completions, len(r.prompt_ids), p.model, request=p.request)
        if self.prog is not None:
            self.prog.request(True, sum(len(c.token_ids) for c in completions), cap=p.cap)

    def failed(self, r: GenRequest, message: str, p: Pending) -> None:
        """A request the engine could not run (it needs more KV than the whole pool; with n > 1
        the scheduler's message says its completions cannot be held at once: field n)."""
        name = "n" if f"asks for n={r.n} completions" in message else "max_tokens"
        self._fail(r.key, p, name if p.api == "simple" else f"body.{name}", message)

    def _fail(self, key: str, p: Pending, field_: str, message: str) -> None:
        """Fail a request that was read (its line and field named)."""
        self.fail({"custom_id": key, "error": {"line": p.line, "field": field_, "message": message}},
                  f"{self.prompts_name}:{p.line}: {message}", p.request, p.api, cap=p.cap)

    def _broken_promise(self, p: Pending, completions: list[GenResult], texts: list[str]) -> str | None:
        """Why a constrained request's completion that says finish_reason "stop" is not a
        document its response_format admits (None: every one is); see structured.output_error."""
        if p.response_format is None:
            return None
        for j, (c, text) in enumerate(zip(completions, texts)):
            if c.finish_reason != "stop":
                continue  # cut at max_tokens: unfinished, and it says so
            why = self.grammars.output_error(text, p.response_format, c.token_ids)
            if why is not None:
                return (f"completion {j} ended with finish_reason \"stop\" but {why}; the result is not written "
                        f"(a stop string that cuts the JSON does this: drop `stop` from a request with a "
                        f"response_format)")
        return None

    def _token_logprobs(self, ids: list[int], entries: list[Any] | None) -> list[TokenLogprob] | None:
        """Tokens and their logprob entries (None for an echoed prompt's first token) as the
        writers report them, each token with its text; None when not asked."""
        if entries is None:
            return None
        ts = self.tok.token_str
        return [TokenLogprob(t, ts(t), None, []) if e is None else
                TokenLogprob(t, ts(t), e[0], [(i, ts(i), v) for i, v in e[1]]) for t, e in zip(ids, entries)]


def _joined(prompt: list[TokenLogprob] | None, completion: list[TokenLogprob] | None) -> list[TokenLogprob] | None:
    """A choice's logprobs: the echoed prompt's (if any) before the completion's."""
    if prompt is None:
        return completion
    return prompt + (completion or [])
