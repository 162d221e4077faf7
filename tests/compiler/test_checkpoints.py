"""Tests for the tiny deterministic MoE checkpoints in moecc.testing.checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from moecc.frontend.families import family as family_of
from moecc.testing import checkpoints as ck

REPO_ROOT = Path(__file__).resolve().parents[2]

TEXTS = [
    "Hello world!",
    "The kettle clicked off just as the rain began.",
    "Numbers: 2, 3, 5, 7, 11 and 3.14159; also 32,768.",
    "  leading spaces, tabs\tand\nnew lines  ",
    "A pulley is a wheel with a groove for a rope.",
]


def _reference_model(family: str, seed: int = 0, **overrides: object) -> transformers.PreTrainedModel:
    """The in-memory model write_checkpoint should have saved."""
    config = ck.tiny_config(family, **overrides)
    cls = ck.FAMILY_CLASSES[family][1]
    torch.manual_seed(seed)
    return cls(config).eval()


def _assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name, tensor in sa.items():
        assert sb[name].dtype == tensor.dtype, name
        assert torch.equal(sb[name], tensor), name


def _safetensors_keys(path: Path) -> dict[str, list[int]]:
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    ck.build_tokenizer(out)
    return out


@pytest.mark.parametrize("family", ck.FAMILIES)
@pytest.mark.parametrize("layout", ck.LAYOUTS)
def test_round_trip(tmp_path: Path, family: str, layout: str) -> None:
    out = ck.write_checkpoint(tmp_path / "ckpt", family, layout=layout, seed=3)
    assert out == tmp_path / "ckpt"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name

    reference = _reference_model(family, seed=3)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded) is type(reference)
    _assert_same_parameters(reference, loaded)

    # Weights are bit-identical, but fused tensors loaded straight from the safetensors mmap
    # are not 64-byte aligned, so CPU kernels may round differently in the last bits.
    ids = torch.tensor([[1, 40, 50, 60, 70, 80]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)

    keys = _safetensors_keys(out / "model.safetensors")
    cfg = reference.config
    fam = family_of(family)  # the family's config fields (moecc/frontend/families/)
    experts = getattr(cfg, fam.experts)
    inter = cfg.moe_intermediate_size if "moe_intermediate_size" in fam.required else cfg.intermediate_size
    moe = fam.tiny.get("first_k_dense_replace", 0)  # DeepSeek: layer 0 dense
    if family == "gpt_oss":  # one layout either way: transposed, gate/up interleaved, with biases
        assert keys["model.layers.0.mlp.experts.gate_up_proj"] == [experts, cfg.hidden_size, 2 * inter]
        assert keys["model.layers.0.mlp.experts.gate_up_proj_bias"] == [experts, 2 * inter]
        assert keys["model.layers.0.mlp.experts.down_proj"] == [experts, inter, cfg.hidden_size]
        assert keys["model.layers.0.self_attn.sinks"] == [cfg.num_attention_heads]
    elif layout == "fused":
        assert keys[f"model.layers.{moe}.mlp.experts.gate_up_proj"] == [experts, 2 * inter, cfg.hidden_size]
        assert keys[f"model.layers.{moe}.mlp.experts.down_proj"] == [experts, cfg.hidden_size, inter]
    elif family == "mixtral":
        assert keys["model.layers.0.block_sparse_moe.experts.3.w1.weight"] == [inter, cfg.hidden_size]
        assert keys["model.layers.0.block_sparse_moe.experts.3.w2.weight"] == [cfg.hidden_size, inter]
        assert keys["model.layers.0.block_sparse_moe.gate.weight"] == [experts, cfg.hidden_size]
    else:
        assert keys[f"model.layers.{moe}.mlp.experts.3.gate_proj.weight"] == [inter, cfg.hidden_size]
        assert keys[f"model.layers.{moe}.mlp.experts.3.down_proj.weight"] == [cfg.hidden_size, inter]
        if family in ("qwen3_moe", "qwen2_moe"):  # mlp_only_layers=[1]: layer 1 is a dense MLP.
            assert keys["model.layers.1.mlp.gate_proj.weight"] == [cfg.intermediate_size, cfg.hidden_size]
            assert not any(k.startswith("model.layers.1.mlp.experts") for k in keys)


@pytest.mark.parametrize("layout", ck.LAYOUTS)
def test_bfloat16_round_trip(tmp_path: Path, layout: str) -> None:
    out = ck.write_checkpoint(tmp_path, "mixtral", layout=layout, dtype="bfloat16", num_hidden_layers=1)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    reference = _reference_model("mixtral", num_hidden_layers=1).to(torch.bfloat16)
    _assert_same_parameters(reference, AutoModelForCausalLM.from_pretrained(out))


def test_layouts_share_config(tmp_path: Path) -> None:
    a = ck.write_checkpoint(tmp_path / "a", "qwen3_moe", layout="per_expert")
    b = ck.write_checkpoint(tmp_path / "b", "qwen3_moe", layout="fused")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("layout", ck.LAYOUTS)
def test_deterministic(tmp_path: Path, layout: str) -> None:
    a = ck.write_checkpoint(tmp_path / "a", "mixtral", layout=layout, seed=7)
    b = ck.write_checkpoint(tmp_path / "b", "mixtral", layout=layout, seed=7)
    c = ck.write_checkpoint(tmp_path / "c", "mixtral", layout=layout, seed=8)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_write_checkpoint_preserves_global_rng(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    ck.write_checkpoint(tmp_path, "mixtral", num_hidden_layers=1)
    assert torch.equal(torch.rand(4), expected)


def test_tokenizer_special_tokens(tok_dir: Path) -> None:
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert [raw.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]
    assert 256 + 3 < raw.get_vocab_size() <= 384

    hf = AutoTokenizer.from_pretrained(tok_dir)
    assert isinstance(hf, transformers.PreTrainedTokenizerFast)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert len(hf) == raw.get_vocab_size()
    assert hf.model_max_length == 512


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_equivalence(tok_dir: Path, text: str) -> None:
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(tok_dir)
    raw_ids = raw.encode(text).ids
    hf_ids = hf(text)["input_ids"]
    assert raw_ids == hf_ids
    assert raw_ids[0] == 1 and raw_ids.count(1) == 1
    assert 2 not in raw_ids
    assert raw.decode(raw_ids) == text
    assert hf.decode(hf_ids, skip_special_tokens=True) == text
    assert hf.decode(hf_ids) == "<s>" + text


def test_tokenizer_compresses_corpus_text(tok_dir: Path) -> None:
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    text = TEXTS[1]
    assert len(raw.encode(text).ids) < 0.75 * len(text.encode())


def test_tokenizer_rejects_tiny_vocab(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        ck.build_tokenizer(tmp_path, vocab_size=100)


def test_chat_template(tok_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(tok_dir)
    messages = [{"role": "user", "content": "hi"}]
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|user|>\nhi</s>\n<|assistant|>\n"
    encoded = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding here (return_dict defaults to True).
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    assert ids[0] == 1 and ids.count(1) == 1
    assert ids.count(2) == 1
    assert hf.decode(ids) == text

    dialogue = messages + [{"role": "assistant", "content": "Hello there."}]
    no_prompt = hf.apply_chat_template(dialogue, tokenize=False)
    assert no_prompt == "<s><|user|>\nhi</s>\n<|assistant|>\nHello there.</s>\n"


def test_tiny_config_defaults_and_overrides() -> None:
    mixtral = ck.tiny_config("mixtral")
    assert isinstance(mixtral, transformers.MixtralConfig)
    assert (mixtral.hidden_size, mixtral.intermediate_size, mixtral.num_hidden_layers) == (64, 96, 2)
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (8, 2)
    assert (mixtral.bos_token_id, mixtral.eos_token_id, mixtral.pad_token_id) == (1, 2, 0)
    assert mixtral.initializer_range == 0.1 and mixtral.tie_word_embeddings is False

    qwen = ck.tiny_config("qwen3_moe", num_hidden_layers=4, norm_topk_prob=False, vocab_size=400)
    assert isinstance(qwen, transformers.Qwen3MoeConfig)
    assert (qwen.num_hidden_layers, qwen.norm_topk_prob, qwen.vocab_size) == (4, False, 400)
    assert (qwen.num_experts, qwen.moe_intermediate_size, qwen.head_dim) == (8, 48, 16)
    assert qwen.mlp_only_layers == [1]

    with pytest.raises(ValueError, match="family"):
        ck.tiny_config("llama")
    with pytest.raises(ValueError, match="hiden_size"):
        ck.tiny_config("mixtral", hiden_size=32)
    with pytest.raises(ValueError, match="layout"):
        ck.write_checkpoint("/nonexistent", layout="sharded")


@pytest.mark.slow
def test_cli_writes_loadable_directory(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    result = subprocess.run(
        [
            sys.executable, "-m", "moecc.testing.checkpoints", str(out),
            "--family", "qwen3_moe", "--layout", "fused", "--seed", "5",
            "--set", "num_hidden_layers=2", "--set", "mlp_only_layers=[]",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == str(out)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    reference = _reference_model("qwen3_moe", seed=5, num_hidden_layers=2, mlp_only_layers=[])
    _assert_same_parameters(reference, loaded)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("hello")["input_ids"][0] == 1


def test_cli_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ck.main([str(tmp_path), "--preset", "demo", "--family", "qwen3_moe"])
    with pytest.raises(SystemExit):
        ck.main([str(tmp_path), "--set", "no_equals_sign"])
    with pytest.raises(SystemExit):
        ck.main([str(tmp_path), "--set", "not_a_field=1"])
    assert "not_a_field" in capsys.readouterr().err
