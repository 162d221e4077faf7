"""Train the demo model: a small Mixtral-shaped MoE that writes readable English.

The text is the Python documentation that ships with every CPython installation: the
reference topics of `pydoc_data.topics` (about 465 KB of prose, grammar and examples) and
the docstrings of the standard library's sources (about 1.4 MB, read with `ast`). Topics are split
deterministically: every tenth topic (sorted by name) is held out and written, as the
model sees it, to `heldout.txt` beside the weights; a tenth of the rest is a validation set
(watched with --eval-every, never trained on); the rest and the docstrings, less every
paragraph that also appears in a held-out or validation topic (the topics repeat one
another), train a byte-level BPE
tokenizer and the model. Each training topic is also shown once more as a chat turn
("<|user|> Tell me about <title> ... <|assistant|> <first paragraphs>"), so the chat
template in `tokenizer_config.json` gets answers in the same voice.

Usage::

    python examples/train_demo_model.py [--out examples/demo-model] [--steps N] [--threads 2]

Seeded (torch, the window sampler): on the same Python and torch versions it writes the
same weights. On 2 cores it takes about the time recorded in `training.json` (`seconds`),
with the final training loss and the held-out perplexity of the trained model and of the
same model at its random initialisation.

Legend: B = windows per step, L = tokens per window, V = vocabulary.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from pathlib import Path

import torch

from moecc.testing.checkpoints import BOS_ID, EOS_ID, build_tokenizer, tiny_config
from moecc_runtime.perplexity import text_ids, windows

#: The demo model's shape: Mixtral's layout (GQA 2:1, top-2 of 8 experts) at 3.3M parameters.
DEMO_CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 224,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.02,
    "router_aux_loss_coef": 0.02,
    "tie_word_embeddings": False,
}
VOCAB_SIZE = 2048
SEED = 0
WINDOW = 256  # L
BATCH = 24  # B
HOLDOUT_EVERY = 10
_SKIP_STDLIB = {"test", "tests", "idle_test", "idlelib", "site-packages", "lib2to3", "pydoc_data", "turtledemo"}
_UNDERLINE = re.compile(r"^([*=\-~^\"#])\1{2,}\s*$")


def reflow(text: str) -> str:
    """Join hard-wrapped prose lines into paragraphs; keep indented blocks (code, grammar)
    line by line; drop reST title underlines."""
    out: list[str] = []
    para: list[str] = []

    def flush() -> None:
        if para:
            out.append(" ".join(para))
            para.clear()

    for line in text.splitlines():
        if _UNDERLINE.match(line):
            continue
        if not line.strip():
            flush()
            if out and out[-1] != "":
                out.append("")
        elif line.startswith(" "):
            flush()
            out.append(line.rstrip())
        else:
            para.append(line.strip())
    flush()
    return "\n".join(out).strip() + "\n"


def split_topics() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held-out) lists of (topic name, reflowed text); every tenth topic held out."""
    import pydoc_data.topics as topics

    names = sorted(topics.topics)
    items = [(n, reflow(topics.topics[n])) for n in names]
    held = [it for i, it in enumerate(items) if i % HOLDOUT_EVERY == HOLDOUT_EVERY // 2]
    train = [it for i, it in enumerate(items) if i % HOLDOUT_EVERY != HOLDOUT_EVERY // 2]
    return train, held


def split_validation(train: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, validation): every tenth training topic watched during training (--eval-every), never
    trained on; the held-out topics are scored only once, at the end."""
    val = [it for i, it in enumerate(train) if i % HOLDOUT_EVERY == 0]
    return [it for i, it in enumerate(train) if i % HOLDOUT_EVERY != 0], val


def drop_seen(train: list[tuple[str, str]], *apart: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """`train` without any paragraph that also appears in a held-out or validation topic: the
    topics repeat one another (`specialnames` holds all of `customization`, `compound` holds
    `for`), and a held-out paragraph seen in training is not held out."""
    seen = {p.strip() for items in apart for _, t in items for p in t.split("\n\n") if p.strip()}
    kept = []
    for name, text in train:
        paras = [p for p in text.split("\n\n") if p.strip() and p.strip() not in seen]
        if paras:
            kept.append((name, "\n\n".join(paras).strip() + "\n"))
    return kept


def stdlib_docstrings() -> list[tuple[str, str]]:
    """(module path, reflowed docstring) of every module, class and function docstring of at
    least 120 characters in the standard library's sources (tests, IDLE and pydoc_data left
    out), read with `ast` (nothing is imported or run), in sorted file order."""
    import ast
    import sysconfig

    std = Path(sysconfig.get_paths()["stdlib"])
    out: list[tuple[str, str]] = []
    for path in sorted(std.rglob("*.py")):
        rel = path.relative_to(std)
        if _SKIP_STDLIB & set(rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 120:
                    out.append((str(rel), reflow(doc)))
    return out


def chat_turn(text: str) -> str:
    """A training chat turn for one topic, rendered as the chat template renders it."""
    title, _, body = text.partition("\n")
    answer = "\n\n".join(p for p in body.strip().split("\n\n")[:2] if p.strip())
    return f"<|user|>\nTell me about {title.strip()}.</s>\n<|assistant|>\n{answer}</s>\n"


def encode_stream(tok, docs: list[str]) -> torch.Tensor:
    """BOS + tokens + EOS of every document, concatenated: [N] int64."""
    ids: list[int] = []
    for d in docs:
        ids.append(BOS_ID)
        ids.extend(tok.encode(d, add_special_tokens=False).ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def stream_perplexity(model: torch.nn.Module, ids: list[int]) -> float:
    """exp(mean next-token NLL) of a transformers model over `windows(ids)`, the cut that
    `moecc perplexity` scores (moecc_runtime.perplexity)."""
    nll, count = 0.0, 0
    for w in windows(ids, WINDOW):
        x = torch.tensor(w, dtype=torch.long)
        logits = model(x[None, :-1]).logits[0].float()  # [L, V]
        nll += torch.nn.functional.cross_entropy(logits, x[1:], reduction="sum").item()
        count += x.numel() - 1
    return math.exp(nll / count)


def train(out: Path, steps: int, threads: int, eval_every: int = 0, log=sys.stderr) -> dict:
    """Train and write the checkpoint into `out`; return the training record."""
    from tokenizers import Tokenizer
    from transformers import MixtralForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    train_items, held_items = split_topics()
    train_items, val_items = split_validation(train_items)
    chats = [chat_turn(t) for _, t in drop_seen(train_items, held_items, val_items)]
    train_items = drop_seen(train_items + stdlib_docstrings(), held_items, val_items)
    train_docs = [t for _, t in train_items] + chats
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, vocab_size=VOCAB_SIZE, model_max_length=DEMO_CONFIG["max_position_embeddings"],
                    texts=train_docs)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    heldout_text = "\n".join(t for _, t in held_items)
    (out / "heldout.txt").write_text(heldout_text, encoding="utf-8")
    data = encode_stream(tok, train_docs)  # [N]
    held = text_ids(out, heldout_text)  # as `moecc perplexity` reads heldout.txt
    val = encode_stream(tok, [t for _, t in val_items]).tolist()

    config = tiny_config("mixtral", vocab_size=VOCAB_SIZE, **DEMO_CONFIG)
    model = MixtralForCausalLM(config)
    model.eval()
    random_ppl = stream_perplexity(model, held)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; {data.numel()} training tokens, "
          f"{len(held)} held out; random-init held-out perplexity {random_ppl:.1f}", file=log, flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))) * 0.95 + 0.05)
    gen = torch.Generator().manual_seed(SEED)
    t0 = time.perf_counter()
    losses: list[float] = []
    curve: dict[int, float] = {}  # step -> validation perplexity (--eval-every)
    for step in range(steps):
        model.train()
        starts = torch.randint(0, data.numel() - WINDOW - 1, (BATCH,), generator=gen)
        x = torch.stack([data[s:s + WINDOW + 1] for s in starts.tolist()])  # [B, L+1]
        res = model(x[:, :-1], labels=x[:, :-1].clone(), output_router_logits=True)
        # labels are shifted inside the model; aux is the router load-balancing term
        lm = res.loss - config.router_aux_loss_coef * res.aux_loss
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(lm.item())
        if (step + 1) % 50 == 0 or step + 1 == steps:
            mean = sum(losses[-50:]) / len(losses[-50:])
            watch = ""
            if eval_every and (step + 1) % eval_every == 0:
                model.eval()
                curve[step + 1] = round(stream_perplexity(model, val), 3)
                watch = f"  validation perplexity {curve[step + 1]:.2f}"
            print(f"step {step + 1}/{steps}  loss {mean:.3f}  lr {sched.get_last_lr()[0]:.2e}  "
                  f"{time.perf_counter() - t0:.0f}s{watch}", file=log, flush=True)
    seconds = time.perf_counter() - t0
    model.eval()
    ppl = stream_perplexity(model, held)
    print(f"held-out perplexity {ppl:.2f} (random init {random_ppl:.1f}); {seconds:.0f}s", file=log, flush=True)

    model.save_pretrained(out)
    for weights in out.glob("model*.safetensors"):
        weights.chmod(0o644)
    record = {
        "seed": SEED, "steps": steps, "batch": BATCH, "window": WINDOW, "threads": threads,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": data.numel(), "heldout_tokens": len(held), "validation_tokens": len(val),
        "heldout_topics": [n for n, _ in held_items], "validation_topics": [n for n, _ in val_items],
        "final_train_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
        "heldout_perplexity": round(ppl, 4), "random_init_heldout_perplexity": round(random_ppl, 2),
        "validation_perplexity": curve, "seconds": round(seconds, 1), "python": platform.python_version(), "torch": torch.__version__,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("demo-model"))
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=0, help="print validation perplexity every N steps")
    args = ap.parse_args(argv)
    train(args.out, args.steps, args.threads, args.eval_every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
