"""Configs are validated at compile: every field moecc reads from config.json (and
generation_config.json) is checked for its type, its range and how it relates to others,
and a bad one fails with a CheckpointError naming the file and the field, through
`moecc compile` as an `error:` line with exit status 1 and no traceback. A config.json that
is not JSON, or not an object, names the file and why; what transformers' own parser
refuses is re-raised naming config.json.

The checkpoints here are config-only (no weights): validation runs before anything is traced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from moecc.compiler import compile_model
from moecc.errors import CheckpointError, ConfigError, MoeccError
from moecc.frontend.families import FAMILIES
from moecc.testing.checkpoints import tiny_config

_UNSET = object()  # a case that removes the field


@pytest.fixture(scope="module")
def base_configs() -> dict[str, dict[str, Any]]:
    """family -> a tiny, valid config.json as a dict (as save_pretrained writes it)."""
    out = {}
    for fam in FAMILIES:
        cfg = tiny_config(fam.model_type)
        cfg.architectures = [fam.architecture]
        out[fam.model_type] = json.loads(cfg.to_json_string())
    return out


def _write(d: Path, config: dict[str, Any] | str) -> Path:
    """A config-only checkpoint directory holding `config` (a dict, or raw text)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return d.resolve()


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    cfg = dict(base)
    for k, v in changes.items():
        if v is _UNSET:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


def _compile_error(d: Path) -> MoeccError:
    with pytest.raises(MoeccError) as info:
        compile_model(d)
    return info.value


RANGE = "it must be at least 1"
INT = "it must be an integer of at least 1"
POS = "it must be a finite number greater than 0"
# (family, field as the message names it, changes to config.json, the message after "field '<field>' ")
CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("mixtral", "num_hidden_layers", {"num_hidden_layers": -1}, f"is -1; {RANGE}"),
    ("mixtral", "num_hidden_layers", {"num_hidden_layers": 0}, f"is 0; {RANGE}"),
    ("mixtral", "num_hidden_layers", {"num_hidden_layers": 2.5}, f"is 2.5 (a floating-point number); {INT}"),
    ("mixtral", "num_hidden_layers", {"num_hidden_layers": True}, f"is true (a boolean); {INT}"),
    ("mixtral", "num_hidden_layers", {"num_hidden_layers": None}, f"is null; {INT}"),
    ("mixtral", "hidden_size", {"hidden_size": "64"}, f'is "64" (a string); {INT}'),
    ("mixtral", "hidden_size", {"hidden_size": 0}, f"is 0; {RANGE}"),
    ("mixtral", "hidden_size", {"hidden_size": 66}, "is 66 but num_attention_heads is 4; with no head_dim it must "
                                                    "be a multiple of num_attention_heads"),
    ("mixtral", "vocab_size", {"vocab_size": 0}, f"is 0; {RANGE}"),
    ("mixtral", "num_attention_heads", {"num_attention_heads": 0}, f"is 0; {RANGE}"),
    ("mixtral", "num_key_value_heads", {"num_key_value_heads": 0}, f"is 0; {RANGE}"),
    ("mixtral", "num_key_value_heads", {"num_key_value_heads": 3}, "is 3 but num_attention_heads is 4; it must "
                                                                   "divide num_attention_heads"),
    ("mixtral", "head_dim", {"head_dim": 0}, f"is 0; {RANGE}"),
    ("mixtral", "head_dim", {"head_dim": 15}, "gives a rotary width of 15; rotary embeddings need an even width"),
    ("mixtral", "intermediate_size", {"intermediate_size": 0}, f"is 0; {RANGE}"),
    ("mixtral", "num_local_experts", {"num_local_experts": 0}, f"is 0; {RANGE}"),
    ("mixtral", "num_experts_per_tok", {"num_experts_per_tok": 9},
     "is 9 but the model has 8 experts (num_local_experts); it must be between 1 and 8"),
    ("mixtral", "num_experts_per_tok", {"num_experts_per_tok": 0}, f"is 0; {RANGE}"),
    ("mixtral", "max_position_embeddings", {"max_position_embeddings": 0}, "is 0; it must be at least 2"),
    ("mixtral", "max_position_embeddings", {"max_position_embeddings": 1}, "is 1; it must be at least 2"),
    ("mixtral", "sliding_window", {"sliding_window": 0}, f"is 0; {RANGE}"),
    ("mixtral", "rms_norm_eps", {"rms_norm_eps": 0}, f"is 0; {POS}"),
    ("mixtral", "rms_norm_eps", {"rms_norm_eps": float("nan")}, f"is NaN; {POS}"),
    ("mixtral", "rms_norm_eps", {"rms_norm_eps": "1e-5"}, f'is "1e-5" (a string); {POS}'),
    ("mixtral", "rope_theta", {"rope_theta": -1.0, "rope_parameters": _UNSET}, f"is -1.0; {POS}"),
    ("mixtral", "rope_parameters.rope_theta", {"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     f"is 0; {POS}"),
    ("mixtral", "rope_parameters.factor", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4,
                                                               "factor": -2.0}}, f"is -2.0; {POS}"),
    ("mixtral", "eos_token_id", {"eos_token_id": 384}, "is 384; a token id must be between 0 and 383 "
                                                       "(vocab_size is 384)"),
    ("mixtral", "eos_token_id", {"eos_token_id": [2, 999]}, "is [2, 999]; a token id must be between 0 and 383 "
                                                            "(vocab_size is 384)"),
    ("mixtral", "eos_token_id", {"eos_token_id": "</s>"}, 'is "</s>" (a string); it must be a token id, a list '
                                                          'of token ids or null'),
    ("mixtral", "bos_token_id", {"bos_token_id": -1}, "is -1; a token id must be between 0 and 383 "
                                                      "(vocab_size is 384)"),
    ("mixtral", "pad_token_id", {"pad_token_id": 1000}, "is 1000; a token id must be between 0 and 383 "
                                                        "(vocab_size is 384)"),
    ("mixtral", "architectures", {"architectures": "MixtralForCausalLM"},
     'is "MixtralForCausalLM"; it must be a list of class names such as ["MixtralForCausalLM"]'),
    ("qwen3_moe", "moe_intermediate_size", {"moe_intermediate_size": 0}, f"is 0; {RANGE}"),
    ("qwen3_moe", "intermediate_size", {"intermediate_size": -96}, f"is -96; {RANGE}"),
    ("qwen3_moe", "num_experts", {"num_experts": 0}, f"is 0; {RANGE}"),
    ("qwen3_moe", "num_experts_per_tok", {"num_experts_per_tok": 9},
     "is 9 but the model has 8 experts (num_experts); it must be between 1 and 8"),
    ("qwen3_moe", "head_dim", {"head_dim": -4}, f"is -4; {RANGE}"),
    ("qwen3_moe", "decoder_sparse_step", {"decoder_sparse_step": 0}, f"is 0; {RANGE}"),
    ("deepseek_v2", "kv_lora_rank", {"kv_lora_rank": 0}, f"is 0; {RANGE}"),
    ("deepseek_v2", "qk_rope_head_dim", {"qk_rope_head_dim": 0}, f"is 0; {RANGE}"),
    ("deepseek_v2", "qk_rope_head_dim", {"qk_rope_head_dim": 7}, "gives a rotary width of 7; rotary embeddings "
                                                                 "need an even width"),
    ("deepseek_v2", "qk_nope_head_dim", {"qk_nope_head_dim": 0}, f"is 0; {RANGE}"),
    ("deepseek_v2", "v_head_dim", {"v_head_dim": 0}, f"is 0; {RANGE}"),
    ("deepseek_v2", "q_lora_rank", {"q_lora_rank": 0}, f"is 0; {RANGE}"),
    ("deepseek_v2", "n_routed_experts", {"n_routed_experts": 0}, f"is 0; {RANGE}"),
    ("deepseek_v2", "n_group", {"n_group": 3}, "is 3 but the 8 experts (n_routed_experts) do not split into 3 "
                                               "equal groups; it must divide n_routed_experts"),
    ("deepseek_v2", "topk_group", {"topk_group": 5}, "is 5 but there are 4 expert groups (n_group); it must be "
                                                     "between 1 and 4"),
    ("deepseek_v3", "n_group", {"n_group": 3}, "is 3 but the 8 experts (n_routed_experts) do not split into 3 "
                                               "equal groups; it must divide n_routed_experts"),
    ("deepseek_v3", "n_group", {"n_group": 8}, "is 8, which leaves 1 expert per group; a group is scored by its "
                                               "best two experts, so it must be at most 4"),
    ("deepseek_v3", "topk_group", {"topk_group": 0}, f"is 0; {RANGE}"),
    ("deepseek_v3", "num_experts_per_tok", {"num_experts_per_tok": 5},
     "is 5 but only 4 experts compete (topk_group 2 of n_group 4 groups of 2); it must be at most 4"),
]


@pytest.mark.parametrize("family,field,changes,message", CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_bad_field_is_named(tmp_path, base_configs, family, field, changes, message):
    d = _write(tmp_path / "ckpt", _with(base_configs[family], **changes))
    err = _compile_error(d)
    assert isinstance(err, ConfigError) and isinstance(err, CheckpointError)
    assert (err.field, err.path) == (field, f"{d}/config.json")
    assert str(err) == f"{d}/config.json: field '{field}' {message}"


def test_valid_tiny_configs_pass(base_configs, tmp_path):
    """The untouched configs pass validation (each family's own defaults included)."""
    from moecc.frontend.checkpoint import read_checkpoint
    from moecc.frontend.config import load_config

    for family, cfg in base_configs.items():
        assert load_config(read_checkpoint(_write(tmp_path / family, cfg))).model_type == family


def test_generation_config_eos_is_checked(tmp_path, base_configs):
    d = _write(tmp_path / "ckpt", base_configs["mixtral"])
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4000]}))
    assert str(_compile_error(d)) == (f"{d}/generation_config.json: field 'eos_token_id' is [2, 4000]; a token id "
                                      f"must be between 0 and 383 (vocab_size is 384)")
    (d / "generation_config.json").write_text("{not json")
    assert str(_compile_error(d)).startswith(f"{d}/generation_config.json: not valid JSON: ")


def test_unsupported_activation_is_named(tmp_path, base_configs):
    d = _write(tmp_path / "ckpt", _with(base_configs["mixtral"], hidden_act="tanh"))
    assert str(_compile_error(d)).startswith(f"{d}/config.json: field 'hidden_act' is \"tanh\", which moecc "
                                             f"does not implement yet; supported: silu")


@pytest.mark.parametrize("text,reason", [
    ('{"model_type": "mixtral",', "not valid JSON: Expecting property name enclosed in double quotes"),
    ("[1, 2]", "expected a JSON object ({...}), got a list"),
    ('"mixtral"', "expected a JSON object ({...}), got a string"),
    ("", "not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    ("\udcff", "not valid JSON: not UTF-8 text"),
])
def test_config_json_that_is_not_an_object(tmp_path, text, reason):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    err = _compile_error(d.resolve())
    assert isinstance(err, CheckpointError)
    assert str(err).startswith(f"{d.resolve()}/config.json: {reason}"), str(err)


def test_malformed_shard_index_is_named(tmp_path, base_configs):
    d = _write(tmp_path / "ckpt", base_configs["mixtral"])
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    assert str(_compile_error(d)) == (f"{d}/model.safetensors.index.json: malformed shard index: 'weight_map' is "
                                      f"a list; expected an object of tensor name -> file name")


@pytest.mark.parametrize("changes,fragment", [
    ({"tie_word_embeddings": "yes"}, "Field 'tie_word_embeddings' expected bool, got str"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "Missing required keys in `rope_parameters`"),
])
def test_what_transformers_refuses_names_config_json(tmp_path, base_configs, changes, fragment):
    """A field moecc does not read but transformers' parser refuses: re-raised naming the file."""
    d = _write(tmp_path / "ckpt", _with(base_configs["mixtral"], **changes))
    err = _compile_error(d)
    assert isinstance(err, CheckpointError)
    assert str(err).startswith(f"{d}/config.json: transformers cannot read it: ") and fragment in str(err)


@pytest.mark.slow
def test_cli_compile_prints_the_error_without_traceback(tmp_path, base_configs):
    """The real entry point in a subprocess: exit status 1, one `error:` line, no traceback."""
    d = _write(tmp_path / "ckpt", _with(base_configs["mixtral"], num_experts_per_tok=9))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "moecc.cli", "compile", str(d), "-o", str(tmp_path / "p.pt")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"error: {d}/config.json: field 'num_experts_per_tok' is 9 but the model has 8 "
                                   f"experts (num_local_experts); it must be between 1 and 8")
    assert not (tmp_path / "p.pt").exists()


def test_cli_compile_names_a_config_json_that_is_not_json(tmp_path):
    """In-process (CliRunner): the same path for a file that is not JSON."""
    from typer.testing import CliRunner

    from moecc.cli import app

    d = _write(tmp_path / "ckpt", "{oops")
    res = CliRunner().invoke(app, ["compile", str(d), "-o", str(tmp_path / "p.pt")])
    assert res.exit_code == 1, res.output
    assert f"error: {d}/config.json: not valid JSON: " in res.output
    assert "Traceback" not in res.output
