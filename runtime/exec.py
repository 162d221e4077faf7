"""`moecc exec`: run a plan over a JSONL file of prompts and write one result line per
request as it finishes (flushed at once, so a crash never costs finished results).

A bad request fails alone: it becomes an error record (file, line, field) on stderr and in
the errors file, the others run, and the exit status says how many failed.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from moecc_runtime.engine import Engine
from moecc_runtime.generate import GenRequest, GenResult, generate
from moecc_runtime.plan import PlanError, check_checkpoint, load_plan
from moecc_runtime.requests import Request, RequestError, iter_requests
from moecc_runtime.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 256


@dataclass
class JobSummary:
    requests: int = 0
    succeeded: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    errors: list[dict[str, Any]] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineStats as plain data

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


def pick_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def run_job(
    plan_path: str | Path,
    prompts_path: str | Path,
    output: IO[str],
    *,
    errors_path: str | Path | None = None,
    model_dir: str | Path | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    device: str | None = None,
    max_batch: int | None = None,
    log: IO[str] | None = sys.stderr,
    stats_path: str | Path | None = None,
) -> JobSummary:
    """Run every request of `prompts_path` through the plan, writing results to `output` as
    they finish. With `stats_path`, write the job summary and per-step engine records (JSON)."""
    plan = load_plan(plan_path)
    mdir = check_checkpoint(plan, model_dir)
    planned_B = int(plan["batch"]["decode"]["B"])
    if plan.get("arena") and max_batch is not None and max_batch > planned_B:
        raise PlanError(f"--max-batch {max_batch} exceeds the B={planned_B} the plan sized its device arena for "
                        f"(staging for B + prefill rows); recompile with `moecc compile ... --max-batch {max_batch}`")
    tok = Tokenizer(mdir)
    context = int(plan["model"]["info"]["max_position_embeddings"])
    summary = JobSummary()
    err_file: IO[str] | None = None

    def fail(record: dict[str, Any], text: str) -> None:
        nonlocal err_file
        summary.failed += 1
        summary.errors.append(record)
        if log is not None:
            print(f"error: {text}", file=log)
        if errors_path is not None:
            if err_file is None:
                err_file = open(errors_path, "w", encoding="utf-8")
            err_file.write(json.dumps(record, ensure_ascii=False) + "\n")
            err_file.flush()

    gen_requests: list[GenRequest] = []
    lines: dict[str, int] = {}  # custom_id -> input line
    for item in iter_requests(prompts_path):
        summary.requests += 1
        if isinstance(item, RequestError):
            fail(item.to_record(), str(item))
            continue
        try:
            gen_requests.append(_encode(item, tok, context, max_tokens, int(plan["model"]["info"]["vocab_size"])))
            lines[item.custom_id] = item.line
        except ValueError as e:
            rec = {"custom_id": item.custom_id, "error": {"line": item.line, "field": "prompt"
                                                          if item.prompt is not None else "messages",
                                                          "message": str(e)}}
            fail(rec, f"{prompts_path}:{item.line}: {e}")

    start = time.perf_counter()
    engine = Engine(plan, mdir, pick_device(device), record_steps=stats_path is not None)

    def finished(r: GenResult) -> None:
        summary.succeeded += 1
        summary.prompt_tokens += len(r.prompt_ids)
        summary.completion_tokens += len(r.token_ids)
        line = {
            "custom_id": r.key,
            "text": tok.decode(r.token_ids),
            "token_ids": r.token_ids,
            "finish_reason": r.finish_reason,
            "usage": {"prompt_tokens": len(r.prompt_ids), "completion_tokens": len(r.token_ids)},
        }
        output.write(json.dumps(line, ensure_ascii=False) + "\n")
        output.flush()

    def failed(r: GenRequest, message: str) -> None:
        line = lines.get(r.key)
        fail({"custom_id": r.key, "error": {"line": line, "field": "max_tokens", "message": message}},
             f"{prompts_path}:{line}: {message}")

    try:
        generate(engine, gen_requests, finished, max_batch=max_batch, on_error=failed)
    finally:
        summary.seconds = time.perf_counter() - start
        summary.engine = asdict(engine.stats)
        summary.engine["overlap_efficiency"] = engine.stats.overlap_efficiency
        engine.close()
        if err_file is not None:
            err_file.close()
        if stats_path is not None:
            Path(stats_path).write_text(json.dumps(asdict(summary), indent=1) + "\n", encoding="utf-8")
    return summary


def _encode(req: Request, tok: Tokenizer, context: int, default_max: int, vocab: int) -> GenRequest:
    ids = tok.encode_request(req)
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the model's vocabulary of {vocab}")
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    if len(ids) >= context:
        raise ValueError(f"prompt is {len(ids)} tokens, the model's context is {context}; "
                         f"shorten it to at most {context - 1} tokens")
    max_new = min(req.max_tokens or default_max, context - len(ids))
    return GenRequest(req.custom_id, ids, max_new, req.temperature, req.top_p, req.top_k, req.seed)
