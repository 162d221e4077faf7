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
`prompt_tokens`, `completion_tokens` and `error` (None, or why that row failed: a row never
fails the batch). Optional input columns: `max_tokens`, `temperature`, `top_p`, `top_k`,
`seed`, `stop`, `custom_id`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moecc_runtime.engine import generate
from moecc_runtime.scheduler.sequence import GenRequest


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
        self.max_batch, self.max_tokens, self.column = max_batch, max_tokens, prompt_column

    def _request(self, i: int, row: dict[str, Any]) -> GenRequest:
        if row.get(self.column) is not None:
            p = row[self.column]
            if isinstance(p, str) and not p.strip():
                raise ValueError(f"'{self.column}' is empty")
            ids = self.tok.encode_prompt(p) if isinstance(p, str) else [int(t) for t in p]
        elif row.get("messages") is not None:
            ids = self.tok.encode_messages(list(row["messages"]))
        else:
            raise ValueError(f"no '{self.column}' or 'messages' in this row")
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        if len(ids) >= self.context:
            raise ValueError(f"prompt is {len(ids)} tokens, the model's context is {self.context}")
        stop = row.get("stop")
        stop = () if stop is None else ((stop,) if isinstance(stop, str) else tuple(stop))
        mt = row.get("max_tokens")
        return GenRequest(str(i), ids, min(int(mt) if mt is not None else self.max_tokens, self.context - len(ids)),
                          float(row.get("temperature") or 0.0), float(row.get("top_p") or 1.0),
                          int(row.get("top_k") or 0), None if row.get("seed") is None else int(row["seed"]), stop)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        cols = {k: list(v) for k, v in batch.items()}
        n = len(next(iter(cols.values()))) if cols else 0
        rows = [{k: v[i] for k, v in cols.items()} for i in range(n)]
        texts: list[str | None] = [None] * n
        ids: list[list[int]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        prompt_tokens, errors = [0] * n, [None] * n
        reqs = []
        for i, row in enumerate(rows):
            try:
                reqs.append(self._request(i, row))
            except (ValueError, TypeError) as e:
                errors[i] = str(e)

        def finished(r: Any) -> None:
            i = int(r.key)
            texts[i], ids[i], reasons[i] = self.tok.output_text(r.token_ids, reqs_by_key[r.key].stop), \
                r.token_ids, r.finish_reason
            prompt_tokens[i] = len(r.prompt_ids)

        def failed(r: GenRequest, message: str) -> None:
            errors[int(r.key)] = message

        reqs_by_key = {r.key: r for r in reqs}
        generate(self.engine, reqs, finished, max_batch=self.max_batch, on_error=failed, stop_check=self.tok.stop_check)
        out = {k: np.asarray(v, dtype=object) if not isinstance(batch[k], np.ndarray) else batch[k]
               for k, v in cols.items()}
        out.update(text=np.asarray(texts, dtype=object), token_ids=np.asarray(ids + [None], dtype=object)[:-1],
                   finish_reason=np.asarray(reasons, dtype=object), prompt_tokens=np.asarray(prompt_tokens),
                   completion_tokens=np.asarray([len(x) for x in ids]), error=np.asarray(errors, dtype=object))
        return out
