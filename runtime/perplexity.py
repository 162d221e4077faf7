"""Perplexity of a plan's model on a text: how output quality is measured where it is not
exact (quantized weights, other formats), with the runtime's own loading and kernels.

The text is encoded whole with the checkpoint's tokenizer (its BOS first, as a prompt is),
cut into non-overlapping windows of `window` next-token predictions, and each window is
scored from its own start: a window of ids [a, a + window] predicts ids a+1 .. a+window
from the ones before it, within the window. `windows()` is the one definition of that cut,
shared with whatever computes a reference (transformers, the demo model's trainer).

Legend: T = rows of a window (its tokens but the last), V = vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from moecc_runtime.engine import Engine
from moecc_runtime.scheduler.scheduler import reserve_step
from moecc_runtime.scheduler.sequence import Sequence

DEFAULT_WINDOW = 256


@dataclass(frozen=True)
class Perplexity:
    """exp(nll / tokens): the mean next-token negative log-likelihood over `tokens` predictions."""

    nll: float  # summed, natural log
    tokens: int
    windows: int

    @property
    def value(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")


def windows(ids: list[int], window: int = DEFAULT_WINDOW) -> list[list[int]]:
    """The scored windows of `ids`: consecutive slices of window + 1 ids overlapping by one
    id (the last, shorter one kept when it predicts anything)."""
    if window < 1:
        raise ValueError(f"window must be at least 1 token, got {window}")
    return [ids[a:a + window + 1] for a in range(0, len(ids) - 1, window)]


def score(engine: Engine, ids: list[int], window: int = DEFAULT_WINDOW) -> Perplexity:
    """Run every window of `ids` through the engine as one prompt (all rows to the head) and
    sum the next-token NLL of its fp32 logits. Needs a plan whose KV pool holds one window
    (KVCacheFull otherwise)."""
    nll, count, cut = 0.0, 0, windows(ids, window)
    for i, w in enumerate(cut):
        seq = Sequence(sid=-1 - i, tokens=list(w[:-1]), prompt_len=len(w) - 1, max_new=0)
        try:
            plan = reserve_step(engine.blocks, [(seq, len(w) - 1)], all_rows=True)
            logits = engine.worker.execute(plan).logits  # [T, V] fp32
        finally:
            engine.blocks.release(seq.sid)
        target = torch.tensor(w[1:], dtype=torch.long, device=logits.device)
        nll += F.cross_entropy(logits, target, reduction="sum").item()
        count += len(w) - 1
    return Perplexity(nll, count, len(cut))


def text_ids(model_dir: str | Path, text: str) -> list[int]:
    """`text` encoded as a prompt is, with the checkpoint's own tokenizer."""
    from moecc_runtime.tokenizer import Tokenizer

    return Tokenizer(Path(model_dir)).encode_prompt(text)


def plan_perplexity(plan_path: str | Path, text_path: str | Path, *, window: int = DEFAULT_WINDOW,
                    model_dir: str | Path | None = None, device: str | None = None) -> Perplexity:
    """The perplexity of the plan's model (its checkpoint checked as `exec` checks it) on the
    UTF-8 text file `text_path`."""
    from moecc_runtime.job.exec import pick_device
    from moecc_runtime.plan import check_checkpoint, load_plan

    plan = load_plan(plan_path)
    mdir = check_checkpoint(plan, model_dir, plan_path)
    try:
        text = Path(text_path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{text_path}: not UTF-8 text (byte {e.start}): {e.reason}") from None
    ids = text_ids(mdir, text)
    if len(ids) < 2:
        raise ValueError(f"{text_path}: holds {len(ids)} token(s); perplexity needs at least 2")
    engine = Engine(plan, mdir, pick_device(device), plan_path=plan_path)
    try:
        return score(engine, ids, window)
    finally:
        engine.close()
