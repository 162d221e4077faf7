"""Tiny, deterministic Hugging Face checkpoints of Mixture-of-Experts models.

The checkpoints are built with transformers' own model classes (random
initialisation, fixed seed) and come with a small byte-level BPE tokenizer
trained on the bundled ``corpus.txt``.  Nothing is downloaded, and writing the
same arguments twice produces byte-identical files.

Command line::

    python -m moecc.testing.checkpoints OUT_DIR [--family mixtral|qwen3_moe|...]  (moecc/frontend/families/)
        [--layout per_expert|fused] [--seed N] [--dtype float32] [--keep-fp32 NAME ...]
        [--preset demo] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.utils import logging as hf_logging

from moecc.frontend.families import FAMILIES as REGISTRY, family as family_of, names

__all__ = [
    "DTYPES",
    "FAMILIES",
    "FAMILY_CLASSES",
    "LAYOUTS",
    "PRESETS",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "build_tokenizer",
    "tiny_config",
    "write_checkpoint",
    "main",
]

FAMILIES: tuple[str, ...] = names()  # the registry's: moecc/frontend/families/
LAYOUTS: tuple[str, ...] = ("per_expert", "fused")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
#: Special tokens in id order: ``<pad>`` = 0, ``<s>`` = 1, ``</s>`` = 2.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

#: Smallest usable vocabulary: the 256 byte-level symbols plus the special tokens.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

#: ChatML-like template built from ordinary text plus the existing BOS/EOS tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

CORPUS_PATH = Path(__file__).with_name("corpus.txt")

#: Named presets for the command line: ``name -> (family, config overrides)``.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "demo": (
        "mixtral",
        {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
        },
    ),
    # Mixtral's proportions per layer (GQA 4:1 with head dim 128, I/H = 3.5, top-2 of 8) at
    # 380M parameters in 4 layers: the default model of bench/throughput.py.
    "bench": (
        "mixtral",
        {
            "hidden_size": 1024,
            "intermediate_size": 3584,
            "num_hidden_layers": 4,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "vocab_size": 8192,
            "max_position_embeddings": 1024,
            "initializer_range": 0.02,
        },
    ),
    # The same proportions at hidden 768 over 8 layers (I/H = 1.5, GQA 4:1), 200M parameters:
    # issue 22's decode-heavy model (more layers, smaller GEMMs than "bench").
    "bench768": (
        "mixtral",
        {
            "hidden_size": 768,
            "intermediate_size": 1152,
            "num_hidden_layers": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 96,
            "vocab_size": 8192,
            "max_position_embeddings": 1024,
            "initializer_range": 0.02,
        },
    ),
}

# Accepted by the config constructors although not stored under the same name.
_LEGACY_CONFIG_KEYS = frozenset({"rope_theta", "rope_scaling"})


#: family -> (config class, model class), the transformers classes a family is written with: its
#: config class by model_type, its model class by the architecture its family file names
FAMILY_CLASSES: dict[str, tuple[type[transformers.PretrainedConfig], type[transformers.PreTrainedModel]]] = {
    f.model_type: (CONFIG_MAPPING[f.model_type], getattr(transformers, f.architecture)) for f in REGISTRY
}


def _classes(family: str) -> tuple[type[transformers.PretrainedConfig], type[transformers.PreTrainedModel]]:
    if family not in FAMILY_CLASSES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return FAMILY_CLASSES[family]


def _config_class(family: str) -> type[transformers.PretrainedConfig]:
    return _classes(family)[0]


def _model_class(family: str) -> type[transformers.PreTrainedModel]:
    return _classes(family)[1]


def _train_tokenizer(vocab_size: int, texts: Sequence[str] | None = None) -> Tokenizer:
    """Train the byte-level BPE tokenizer on `texts` (default: the bundled corpus); deterministic."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = list(texts) if texts is not None else [CORPUS_PATH.read_text(encoding="utf-8")]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    ids = [tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS]
    if ids != [PAD_ID, BOS_ID, EOS_ID]:  # pragma: no cover - guarded by the trainer
        raise RuntimeError(f"unexpected special token ids {ids}")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tokenizer


def build_tokenizer(
    out_dir: str | Path, vocab_size: int = 384, *, model_max_length: int = 512,
    texts: Sequence[str] | None = None,
) -> None:
    """Train a byte-level BPE tokenizer on `texts` (default: corpus.txt) and write tokenizer files into out_dir.

    Writes ``tokenizer.json`` and a ``tokenizer_config.json`` that makes
    ``AutoTokenizer.from_pretrained(out_dir)`` load it as a fast tokenizer with
    a chat template.  The trained vocabulary has at most ``vocab_size`` entries.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size, texts)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8"
    )


def tiny_config(
    family: str, *, vocab_size: int = 384, **overrides: Any
) -> transformers.PretrainedConfig:
    """A tiny config for `family` (its family file's `tiny`, then `overrides`) with bos/eos/pad ids
    matching the tokenizer."""
    config_cls = _config_class(family)
    fam = family_of(family)
    assert fam is not None  # _config_class refused an unknown family
    known = (
        set(inspect.signature(config_cls.__init__).parameters)
        | set(vars(config_cls()))
        | _LEGACY_CONFIG_KEYS
    )
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown {config_cls.__name__} field(s): {', '.join(unknown)}")
    kwargs: dict[str, Any] = {
        **fam.tiny,
        "vocab_size": vocab_size,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        **overrides,
    }
    return config_cls(**kwargs)


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' tqdm bars while saving, restoring the previous setting."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _save_fused(model: transformers.PreTrainedModel, out: Path) -> None:
    """Write the module's own state dict (3-D fused expert tensors) plus config files."""
    tensors = {
        name: tensor.detach().contiguous().clone() for name, tensor in model.state_dict().items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    # Mirror what save_pretrained records in config.json.
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)


def _cast_keeping_fp32(model: transformers.PreTrainedModel, dtype: torch.dtype,
                       fp32_params: Sequence[str]) -> None:
    """Cast `model` to `dtype`, except parameters and buffers whose name contains one of
    `fp32_params`: those keep their float32 values (not rounded through `dtype`)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    kept = {n: t.detach().float().clone() for n, t in named if any(f in n for f in fp32_params)}
    model.to(dtype)
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        if n in kept:
            t.data = kept[n]


def write_checkpoint(
    out_dir: str | Path,
    family: str = "mixtral",
    *,
    layout: str = "per_expert",
    seed: int = 0,
    dtype: str = "float32",
    fp32_params: Sequence[str] = (),
    **config_overrides: Any,
) -> Path:
    """Write config.json, model safetensors and tokenizer files for a tiny random-init model; return out_dir.

    ``layout="per_expert"`` uses ``save_pretrained`` (the published layout with
    one tensor per expert projection); ``layout="fused"`` writes the in-memory
    3-D expert tensors (``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``)
    to a single ``model.safetensors``.  Both load with ``AutoModelForCausalLM``.
    ``fp32_params``: tensors whose transformers name contains one of these fragments stay in
    float32 while the rest is `dtype` (a mixed-dtype checkpoint, as bf16 releases with fp32
    norms or routers: e.g. ``("norm", "mlp.gate.weight")``); config.json records the model's
    dtype as save_pretrained does.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {tuple(DTYPES)}")
    config = tiny_config(family, **config_overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    build_tokenizer(out, vocab_size=config.vocab_size, model_max_length=config.max_position_embeddings)
    tokenizer_size = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    if tokenizer_size > config.vocab_size:  # pragma: no cover - trainer respects vocab_size
        raise RuntimeError(f"tokenizer has {tokenizer_size} tokens > vocab_size {config.vocab_size}")

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_class(family)(config)
    _cast_keeping_fp32(model, DTYPES[dtype], fp32_params)
    model.eval()

    with _quiet_progress_bars():
        if layout == "per_expert":
            model.save_pretrained(out)
        else:
            _save_fused(model, out)
    # save_pretrained leaves its weight files owner-only (0600); make them world-readable.
    for weights in out.glob("model*.safetensors"):
        weights.chmod(0o644)
    return out


def _parse_value(text: str) -> Any:
    """Parse a ``--set`` value as JSON when possible, otherwise keep the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_assignment(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key.strip(), _parse_value(value)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; prints the directory written."""
    parser = argparse.ArgumentParser(
        prog="python -m moecc.testing.checkpoints",
        description="Write a tiny random-init Mixture-of-Experts checkpoint with a tokenizer.",
    )
    parser.add_argument("out_dir", type=Path, help="directory to write")
    parser.add_argument("--family", choices=FAMILIES, default=None, help="model family (default: mixtral)")
    parser.add_argument("--layout", choices=LAYOUTS, default="per_expert")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--keep-fp32", dest="fp32_params", metavar="NAME", action="append", default=[],
                        help="keep tensors whose name contains NAME in float32 (repeatable; a mixed-dtype checkpoint)")
    parser.add_argument("--preset", choices=tuple(PRESETS), default=None, help="named larger configuration")
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        type=_parse_assignment,
        action="append",
        default=[],
        help="config override, value parsed as JSON when possible (repeatable)",
    )
    args = parser.parse_args(argv)

    family: str = args.family or "mixtral"
    overrides: dict[str, Any] = {}
    if args.preset is not None:
        preset_family, preset_overrides = PRESETS[args.preset]
        if args.family is not None and args.family != preset_family:
            parser.error(f"--preset {args.preset} is a {preset_family} model, not {args.family}")
        family = preset_family
        overrides.update(preset_overrides)
    overrides.update(dict(args.overrides))

    try:
        out = write_checkpoint(
            args.out_dir, family, layout=args.layout, seed=args.seed, dtype=args.dtype,
            fp32_params=tuple(args.fp32_params), **overrides
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
