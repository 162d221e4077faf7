"""moecc inside a Ray Data pipeline: a callable class for `Dataset.map_batches`.

    import ray
    from moecc_runtime.job.ray_data import MoeccPredictor

    ds = ray.data.read_json("prompts.jsonl")            # a "prompt" column (or "messages")
    out = ds.map_batches(MoeccPredictor, fn_constructor_kwargs={"plan": "plan.pt"},
                         concurrency=2, batch_size=256, num_gpus=1)   # one actor per GPU
    out.write_json("results/")

Each actor builds one engine on the plan (the checkpoint at a path every node sees) and
runs each batch it is given with the same continuous batching as `moecc exec`; a batch of
rows comes back with the input columns plus `text`, `token_ids`, `finish_reason`,
`prompt_tokens`, `completion_tokens`, `choices` (a request with n > 1: each completion's
text, token_ids and finish_reason; else None), `logprobs` (when the row asked: one
{token_id, logprob, top} per token; else None) and `error` (None, or why that row failed: a
row never fails the batch). A row holds the fields of a simple `moecc exec` line
(job/requests.py, validated the same way): optional `max_tokens`, `temperature`, `top_p`,
`top_k`, `seed`, `stop`, the penalties, `logit_bias`, `min_tokens`, `logprobs` /
`top_logprobs`, `n`, `response_format`, `custom_id`; other columns pass through untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moecc_runtime.engine import generate
from moecc_runtime.scheduler.sequence import GenRequest
from moecc_runtime.structured import Grammars


class MoeccPredictor:
    def __init__(self, plan: str | Path, model_dir: str | Path | None = None, device: str = "auto",
                 max_batch: int | None = None, max_tokens: int = 256, prompt_column: str = "prompt"):
        from moecc_runtime.engine import Engine
        from moecc_runtime.job.exec import pick_device
        from moecc_runtime.plan import check_checkpoint, load_plan
        from moecc_runtime.tokenizer import Tokenizer

        self.plan = load_plan(plan)
        mdir = check_checkpoint(self.plan, model_dir, plan)
        self.engine = Engine(self.plan, mdir, pick_device(device), plan_path=plan)
        self.tok = Tokenizer(mdir)
        self.context = int(self.plan["model"]["info"]["max_position_embeddings"])
        self.vocab = int(self.plan["model"]["info"]["vocab_size"])
        self.max_batch, self.max_tokens, self.column = max_batch, max_tokens, prompt_column
        self.grammars = Grammars(self.tok, self.plan)  # this actor's structured outputs (built on first use)

    def _request(self, i: int, row: dict[str, Any]) -> GenRequest:
        """Row i as a request: its known fields (nulls dropped) validated as a simple line,
        then encoded as `moecc exec` does (its key is `i`). Raises ValueError naming the field."""
        from moecc_runtime.job.reader import encode_request
        from moecc_runtime.job.requests import KNOWN_FIELDS, RequestFieldError, parse_request

        obj = {k: _plain(v) for k, v in row.items() if k in KNOWN_FIELDS and k != "custom_id" and _present(v)}
        if self.column != "prompt" and _present(row.get(self.column)):
            obj["prompt"] = _plain(row[self.column])
        if "prompt" in obj and "messages" in obj:
            del obj["messages"]
        if "prompt" not in obj and "messages" not in obj:
            raise ValueError(f"no '{self.column}' or 'messages' in this row")
        try:
            req = parse_request({**obj, "custom_id": str(i)}, path="<ray batch>", line=i + 1)
        except RequestFieldError as e:
            raise ValueError(f"field '{e.field}': {e.message}" if e.field else e.message) from None
        if isinstance(req.prompt, str) and not req.prompt.strip():
            raise ValueError(f"'{self.column}' is empty")
        return encode_request(req, self.tok, self.context, self.max_tokens, self.vocab,
                              self.grammars if req.response_format is not None else None)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        cols = {k: list(v) for k, v in batch.items()}
        n = len(next(iter(cols.values()))) if cols else 0
        rows = [{k: v[i] for k, v in cols.items()} for i in range(n)]
        texts: list[str | None] = [None] * n
        ids: list[list[int]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        choices: list[list[dict[str, Any]] | None] = [None] * n
        logprobs: list[list[dict[str, Any]] | None] = [None] * n
        prompt_tokens, completion_tokens, errors = [0] * n, [0] * n, [None] * n
        reqs = []
        for i, row in enumerate(rows):
            try:
                reqs.append(self._request(i, row))
            except (ValueError, TypeError) as e:
                errors[i] = str(e)

        def finished(r: Any) -> None:
            i, stop = int(r.key), reqs_by_key[r.key].stop
            texts[i], ids[i], reasons[i] = self.tok.output_text(r.token_ids, stop), r.token_ids, r.finish_reason
            prompt_tokens[i] = len(r.prompt_ids)
            completion_tokens[i] = sum(len(c.token_ids) for c in r.completions)
            logprobs[i] = _logprobs(r)
            if r.choices:
                choices[i] = [{"text": self.tok.output_text(c.token_ids, stop), "token_ids": c.token_ids,
                               "finish_reason": c.finish_reason, "logprobs": _logprobs(c)} for c in r.choices]

        def failed(r: GenRequest, message: str) -> None:
            errors[int(r.key)] = message

        reqs_by_key = {r.key: r for r in reqs}
        generate(self.engine, reqs, finished, max_batch=self.max_batch, on_error=failed,
                 stop_check=self.tok.stop_check, grammar=self.grammars)
        out = {k: np.asarray(v, dtype=object) if not isinstance(batch[k], np.ndarray) else batch[k]
               for k, v in cols.items()}
        out.update(text=np.asarray(texts, dtype=object), token_ids=_objects(ids),
                   finish_reason=np.asarray(reasons, dtype=object), prompt_tokens=np.asarray(prompt_tokens),
                   completion_tokens=np.asarray(completion_tokens), choices=_objects(choices),
                   logprobs=_objects(logprobs), error=np.asarray(errors, dtype=object))
        return out


def _objects(values: list[Any]) -> np.ndarray:
    """A 1-d object array of `values` (lists kept whole, not turned into a 2-d array)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _logprobs(r: Any) -> list[dict[str, Any]] | None:
    if r.logprobs is None:
        return None
    return [{"token_id": t, "logprob": lp, "top": [[i, v] for i, v in top]} for t, (lp, top) in zip(r.token_ids, r.logprobs)]


def _present(v: Any) -> bool:
    """A value a column holds (not a null, nor pandas' NaN for one)."""
    return v is not None and not (isinstance(v, float) and v != v)


def _plain(v: Any) -> Any:
    """A column value as plain JSON data: numpy arrays as lists, numpy scalars as numbers."""
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()]
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items() if _present(x)}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v
