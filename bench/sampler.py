"""What the sampler costs per decode step: one step of S rows at a V-token vocabulary through
moecc_runtime.sampling.sample (all rows at once), greedy against sampled, on this machine.

    python bench/sampler.py                          # S = 1024, V = 151,936 (Qwen's vocabulary)
    python bench/sampler.py --rows 256 --vocab 32000 --repeats 3 --out /tmp/sampler.json

Cases, each one step over the same logits (medians of --repeats, after one warm-up):
  greedy                 temperature 0: argmax (the baseline every other case is a ratio of);
  t0.8 top-p 0.95        temperature 0.8 with a 0.95 nucleus;
  t1.0                   temperature 1, no truncation (the tail path: the whole distribution);
  t0.8 top-p 0.95 + pen  the same with presence 0.5, frequency 0.3 and repetition 1.1 over
                         each row's 256 earlier tokens (prompt 128 + generated 128).
The logits are fp32 and shaped like a trained model's: Zipf-like (logit of the token at rank r
= -1.2 * ln r, ranks shuffled per row, plus N(0, 0.5) noise); their mean entropy and nucleus size
are printed with the table so the reader can judge. `per-row (before)`: the sampler this one
replaced (a sort, a softmax and a multinomial per row) timed on --old-rows rows and scaled to S.
A table is printed and JSON written (--out, default bench/results/DATE-sampler.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path
from statistics import median
from typing import Any, Callable

import torch

from moecc_runtime.sampling import SamplingParams, request_generator, sample

ROOT = Path(__file__).resolve().parent.parent


def zipf_logits(S: int, V: int, seed: int) -> torch.Tensor:
    """[S, V] fp32: -1.2 ln(rank) over a random permutation per row, plus N(0, 0.5)."""
    g = torch.Generator().manual_seed(seed)
    base = -1.2 * torch.log(torch.arange(1, V + 1, dtype=torch.float32))  # [V]
    out = torch.empty(S, V)
    for r in range(S):
        out[r] = base[torch.randperm(V, generator=g)]
    return out + 0.5 * torch.randn(S, V, generator=g)


def describe(logits: torch.Tensor, t: float, top_p: float) -> dict[str, float]:
    """Mean entropy (nats) at temperature t and mean nucleus size at top_p, over 64 rows."""
    p = torch.softmax(logits[:64] / t, dim=-1)
    ent = float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean())
    ps = p.sort(dim=-1, descending=True).values
    nucleus = float(((ps.cumsum(-1) - ps) < top_p).sum(-1).float().mean())
    return {"entropy_nats": round(ent, 2), "nucleus_tokens": round(nucleus, 1)}


def old_next_token(row: torch.Tensor, t: float, top_p: float, g: torch.Generator) -> int:
    """The sampler before this one, per row: scale, sort, softmax, cumsum, scatter, multinomial."""
    scores = (row.float() - row.max()) / t
    ss, si = torch.sort(scores, descending=True)
    cum = torch.softmax(ss, dim=-1).cumsum(dim=-1)
    remove = cum > top_p
    remove[1:] = remove[:-1].clone()
    remove[0] = False
    scores = scores.scatter(0, si, ss.masked_fill(remove, float("-inf")))
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=g))


def timed(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return median(ts)


def cases(S: int, V: int) -> dict[str, tuple[list[Any], list[list[int]] | None]]:
    g = torch.Generator().manual_seed(1)
    history = [torch.randint(0, V, (256,), generator=g).tolist() for _ in range(S)]
    mk = lambda **kw: [SamplingParams(**kw) for _ in range(S)]  # noqa: E731
    return {"greedy": (mk(), None), "t0.8 top-p 0.95": (mk(temperature=0.8, top_p=0.95), None),
            "t1.0": (mk(temperature=1.0), None),
            "t0.8 top-p 0.95 + pen": (mk(temperature=0.8, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3,
                                         repetition_penalty=1.1), history)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--old-rows", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    S, V = a.rows, a.vocab
    logits = zipf_logits(S, V, 0)
    rows: list[dict[str, Any]] = []
    for name, (params, hist) in cases(S, V).items():
        gens = [request_generator(i, str(i)) for i in range(S)]
        sec = timed(lambda: sample(logits, params, gens, hist, [128] * S if hist else None), a.repeats)
        rows.append({"case": name, "seconds": sec})
    g = request_generator(0, "old")
    n = min(a.old_rows, S)
    old = timed(lambda: [old_next_token(logits[r], 0.8, 0.95, g) for r in range(n)], 1) * S / n
    rows.append({"case": "per-row (before), t0.8 top-p 0.95", "seconds": old, "scaled_from_rows": n})
    base = rows[0]["seconds"]
    for r in rows:
        r["x_greedy"] = round(r["seconds"] / base, 2)
    shape = describe(logits, 0.8, 0.95)
    print(f"sampler, one step of {S} rows at V = {V:,} (fp32 logits; entropy {shape['entropy_nats']} nats at "
          f"t 0.8, nucleus {shape['nucleus_tokens']} tokens at top-p 0.95), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'case':38s} {'ms':>9s} {'x greedy':>9s}")
    for r in rows:
        print(f"{r['case']:38s} {r['seconds'] * 1e3:9.1f} {r['x_greedy']:9.2f}")
    out = a.out or ROOT / "bench" / "results" / f"{datetime.date.today()}-sampler.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": S, "vocab": V, "logits": shape, "cases": rows, "machine": platform.machine(),
                               "cpus": os.cpu_count(), "torch": torch.__version__}, indent=2) + "\n")
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
