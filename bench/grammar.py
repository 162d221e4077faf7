"""What a structured-output grammar costs per decode step: llguidance's token masks for S
constrained rows (moecc_runtime.structured.fill_masks) and feeding back the chosen tokens.

    python bench/grammar.py                              # bench768's tokenizer, S = 1, 64, 256
    python bench/grammar.py --model DIR --rows 1,64,256 --steps 200 --out out.json
    python bench/grammar.py --steps 3 --rows 1,4 --out /tmp/grammar.json   # a smoke run

For each response_format (a strict json_schema of a few bounded properties, and json_object)
and each S, S matchers start at the grammar's start; each step fills all S masks at once,
samples a token per row (random logits, temperature 1, among the allowed tokens: not timed)
and accepts it; a row whose document ended starts over with a fresh matcher (not timed), so
every step has S live rows at mixed points of the document. Medians over --steps (after
--warmup) of: fill_masks (the bool [S, V] mask), timed as its two parts (fill_bitmask:
llguidance's packed bitmask, computed in parallel by its executor; unpack_bitmask), and
accept (S calls). A table is printed and JSON written (--out, default
bench/results/DATE-grammar.json). The tokenizer comes from --model (default
bench/out/model-bench768 when it exists, else a tiny checkpoint written to a temporary
directory, whose 384-token vocabulary makes masks far cheaper than a real model's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "bench" / "out" / "model-bench768"
SCHEMA = {  # a typical extraction schema; every string bounded, so documents end under random sampling
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"type": "string", "enum": ["happy", "sad", "neutral", "angry"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c", "d"]}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "verified": {"type": "boolean"},
    },
    "required": ["name", "age", "mood", "tags", "address", "verified"],
    "additionalProperties": False,
}
FORMATS: dict[str, tuple[str, str]] = {
    "json_schema": ("json_schema", json.dumps(SCHEMA, separators=(",", ":"))),
    "json_object": ("json_object", ""),
}


def model_dir(arg: Path | None, tmp: Path) -> Path:
    """--model, else bench768 when it exists, else a tiny checkpoint written under `tmp`."""
    if arg is not None:
        return arg
    if (DEFAULT_MODEL / "tokenizer.json").exists():
        return DEFAULT_MODEL
    from moecc.testing.checkpoints import write_checkpoint

    return Path(write_checkpoint(tmp / "tiny-mixtral", "mixtral", layout="per_expert"))


def time_format(compiler: Any, rf: tuple[str, str], rows: int, steps: int, warmup: int,
                gen: torch.Generator) -> dict[str, Any]:
    """Median milliseconds per step of fill_masks, fill_bitmask, unpack_bitmask and accept over S rows."""
    from moecc_runtime.structured import fill_bitmask, unpack_bitmask

    V = compiler.vocab_size
    eos = torch.tensor(compiler.eos_ids)
    matchers = [compiler.matcher(rf) for _ in range(rows)]
    t_fill, t_bits, t_unpack, t_accept, allowed, ended = [], [], [], [], [], 0
    for step in range(warmup + steps):
        t1 = time.perf_counter()
        bits = fill_bitmask(matchers, V)  # [S, W]: packed; fill_masks is exactly these two calls
        t2 = time.perf_counter()
        masks = unpack_bitmask(bits, V)  # [S, V]
        t3 = time.perf_counter()
        logits = torch.randn(rows, V, generator=gen).masked_fill_(~masks, float("-inf"))  # [S, V]
        chosen = torch.multinomial(logits.softmax(-1), 1, generator=gen).flatten().tolist()
        t4 = time.perf_counter()
        for m, t in zip(matchers, chosen):
            m.accept(t)
        t5 = time.perf_counter()
        if step >= warmup:
            t_fill.append(t3 - t1), t_bits.append(t2 - t1), t_unpack.append(t3 - t2), t_accept.append(t5 - t4)
            allowed.append(masks.sum(dim=1).float().mean().item())
        for i, (m, t) in enumerate(zip(matchers, chosen)):
            if m.done or bool((eos == t).any()):
                matchers[i] = compiler.matcher(rf)
                ended += 1
    ms = lambda xs: median(xs) * 1e3  # noqa: E731
    fill, acc = ms(t_fill), ms(t_accept)
    return {"rows": rows, "steps": steps, "fill_masks_ms": fill, "fill_bitmask_ms": ms(t_bits),
            "unpack_ms": ms(t_unpack), "accept_ms": acc, "total_ms": fill + acc,
            "per_row_us": (fill + acc) * 1e3 / rows, "mean_allowed_tokens": median(allowed),
            "documents_ended": ended}


def engine_cost(model: Path, rows: int, new_tokens: int, formats: list[str], seed: int) -> list[dict[str, Any]]:
    """The whole decode step with and without a grammar, measured in one run: `rows` requests
    (16 random prompt tokens, `new_tokens` each, min_tokens as many) through generate on a plan
    compiled for `model`, once free and once per format; the median seconds of the decode steps
    (no prefill rows) with every row in flight. The masks, the masked sampler path and the
    accepts are all inside the step time here."""
    import random

    from moecc.compiler import compile_model
    from moecc_runtime.engine import Engine, generate
    from moecc_runtime.scheduler.sequence import GenRequest
    from moecc_runtime.structured import GrammarCompiler
    from moecc_runtime.tokenizer import Tokenizer

    plan, _ = compile_model(model, max_batch=rows)
    vocab = int(plan["model"]["info"]["vocab_size"])
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(rows)]
    compiler = GrammarCompiler(Tokenizer(model), vocab)
    out = []
    for name in ["none", *formats]:
        rf = None if name == "none" else FORMATS[name]
        reqs = [GenRequest(f"r{i}", p, new_tokens, min_tokens=new_tokens, response_format=rf)
                for i, p in enumerate(prompts)]
        engine = Engine(plan, model, "cpu", record_steps=True)
        try:
            generate(engine, reqs, lambda r: None, max_batch=rows, grammar=lambda r: compiler.matcher(r.response_format))
            recs = engine.stats.records or []
        finally:
            engine.close()
        steady = [r.seconds for r in recs if r.prefill_tokens == 0 and r.sequences == rows]
        out.append({"format": name, "rows": rows, "decode_steps": len(steady),
                    "decode_step_ms_median": median(steady) * 1e3 if steady else None})
    base = out[0]["decode_step_ms_median"]
    for r in out:
        r["over_free_step"] = r["decode_step_ms_median"] / base if base and r["decode_step_ms_median"] else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a checkpoint directory (its tokenizer and vocab_size)")
    ap.add_argument("--rows", default="1,64,256", help="constrained rows per step (S), comma-separated")
    ap.add_argument("--formats", default="json_schema,json_object")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None,
                    help="llguidance executor threads (MOECC_GRAMMAR_THREADS; default: llguidance's, 80%% of CPUs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-rows", type=int, default=0,
                    help="also time whole decode steps of this many constrained requests against free ones (0: no)")
    ap.add_argument("--engine-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / f"{datetime.date.today()}-grammar.json")
    args = ap.parse_args(argv)
    if args.threads is not None:
        os.environ["MOECC_GRAMMAR_THREADS"] = str(args.threads)

    from moecc_runtime.structured import GrammarCompiler
    from moecc_runtime.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(args.model, Path(tmp))
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        tok = Tokenizer(model)
        t0 = time.perf_counter()
        compiler = GrammarCompiler(tok, vocab)
        setup_s = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(args.seed)
        results = []
        print(f"model {model}: vocab {vocab} (tokenizer {len(tok.tok)}), tokenizer setup {setup_s * 1e3:.0f} ms")
        print(f"{'format':12s} {'S':>5s} {'fill_masks':>11s} {'bitmask':>9s} {'unpack':>8s} {'accept':>8s} "
              f"{'total':>8s} {'per row':>9s} {'allowed':>8s}")
        for name in args.formats.split(","):
            rf = FORMATS[name]
            t0 = time.perf_counter()
            compiler.check(rf)
            compile_ms = (time.perf_counter() - t0) * 1e3
            for rows in (int(r) for r in args.rows.split(",")):
                r = {"format": name, "compile_ms": compile_ms,
                     **time_format(compiler, rf, rows, args.steps, args.warmup, gen)}
                results.append(r)
                print(f"{name:12s} {rows:5d} {r['fill_masks_ms']:8.3f} ms {r['fill_bitmask_ms']:6.3f} ms "
                      f"{r['unpack_ms']:5.3f} ms {r['accept_ms']:5.3f} ms {r['total_ms']:5.3f} ms "
                      f"{r['per_row_us']:6.1f} us {r['mean_allowed_tokens']:8.1f}")
        engine = []
        if args.engine_rows:
            engine = engine_cost(model, args.engine_rows, args.engine_tokens, args.formats.split(","), args.seed)
            print(f"whole decode step, {args.engine_rows} rows:")
            for r in engine:
                print(f"  {r['format']:12s} {r['decode_step_ms_median']:8.1f} ms median over {r['decode_steps']} "
                      f"steps, {r['over_free_step']:.3f}x the free step")
    import llguidance

    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "torch_threads": torch.get_num_threads(),
                          "grammar_threads": os.environ.get("MOECC_GRAMMAR_THREADS") or "llguidance default"},
              "llguidance": llguidance.__version__, "model": str(model), "vocab_size": vocab,
              "tokenizer_vocab": len(tok.tok), "tokenizer_setup_ms": setup_s * 1e3, "schema": SCHEMA,
              "per_step": results, "engine": engine}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
