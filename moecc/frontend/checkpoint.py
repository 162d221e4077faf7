"""Read a checkpoint directory without loading weights: config.json, the safetensors
headers (names, dtypes, shapes, byte offsets; read and validated by the runtime's
moecc_runtime/memory/safetensors_header.py), the shard index, and a fingerprint.

A Hugging Face model id `ORG/NAME[@REVISION]` that is no local directory resolves to its
snapshot directory through huggingface_hub (`resolve_model`): the local cache first
(HF_HUB_CACHE, or HF_HOME/hub), then, unless HF_HUB_OFFLINE is set, a download of the
safetensors, config and tokenizer files only. The snapshot directory is the checkpoint
directory from then on (the plan records it; exec reads the same files).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from moecc_runtime.memory.safetensors_header import Header, HeaderError, TensorLocation, read_header

from moecc.errors import CheckpointError


@dataclass
class Checkpoint:
    directory: Path
    config: dict
    tensors: dict[str, TensorLocation] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)  # weight file -> size in bytes
    headers: dict[str, Header] = field(default_factory=dict)  # weight file -> its validated header

    @property
    def has_weights(self) -> bool:
        return bool(self.tensors)

    def fingerprint(self) -> dict:
        """What `exec` checks to refuse a plan made for another checkpoint (computed by the
        runtime's own function, so both sides agree by construction)."""
        from moecc_runtime.plan import fingerprint

        return fingerprint(self.directory, list(self.files), self.headers)


def read_safetensors_header(path: Path) -> Header:
    """One safetensors file's header (tensors at absolute offsets), validated as the
    safetensors library validates it (the runtime's reader: exec checks plans against it)."""
    try:
        return read_header(path)
    except HeaderError as e:
        raise CheckpointError(str(e)) from None


def _json_kind(v: object) -> str:
    """What a JSON value is, in words (for messages)."""
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return kinds.get(type(v), type(v).__name__)


def read_json_object(path: Path) -> dict:
    """needs: a file that should hold one JSON object. guarantees: that object, or a
    CheckpointError naming the file and why (unreadable, not UTF-8, not JSON, not an object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except (json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object ({{...}}), got {_json_kind(data)}")
    return data


def with_modelopt_config(d: Path, config: dict) -> dict:
    """config.json's object, with ModelOpt's hf_quant_config.json (the NVFP4 releases that
    keep their quantization there: {"quantization": {"quant_algo", "exclude_modules", ...}})
    as its quantization_config (quant_method "modelopt") when config.json names none."""
    hf = d / "hf_quant_config.json"
    if config.get("quantization_config") is not None or not hf.is_file():
        return config
    q = read_json_object(hf).get("quantization")
    if not isinstance(q, dict):
        raise CheckpointError(f"{hf}: expected {{\"quantization\": {{\"quant_algo\": ...}}}} as ModelOpt writes it")
    return {**config, "quantization_config": {"quant_method": "modelopt", **q}}


#: ORG/NAME[@REVISION], as the Hub spells repository ids (no path of more than two parts)
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")
#: what a compile or an exec reads of a repository: weights, configs, tokenizer files
HUB_FILES = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
             "hf_quant_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json"]
_TRUE = ("1", "true", "yes", "on")


def hub_cache_dir() -> Path:
    """The Hub cache as huggingface_hub finds it: HF_HUB_CACHE, else HF_HOME/hub (read now)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    return Path(os.environ.get("HF_HOME") or "~/.cache/huggingface").expanduser() / "hub"


def resolve_model(model: str | Path) -> Path:
    """needs: a checkpoint directory or a Hub id ORG/NAME[@REVISION]. guarantees: the
    directory (a local path as given; an id: its snapshot directory, from the cache, or
    downloaded when HF_HUB_OFFLINE is unset), or a one-line CheckpointError naming the id."""
    text = str(model)
    m = _HUB_ID.match(text)
    if Path(text).exists() or m is None or text.startswith((".", "/", "~")):
        return Path(text)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    repo, rev = m["repo"], m["rev"] or "main"
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE
    cache = hub_cache_dir()
    try:
        found = Path(snapshot_download(repo, revision=rev, cache_dir=cache, local_files_only=True,
                                       allow_patterns=HUB_FILES))
        if (found / "config.json").is_file():
            return found
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        pass
    if offline:
        raise CheckpointError(f"{text}: not a directory, and not in the Hugging Face cache {cache} "
                              f"(HF_HUB_OFFLINE is set, so nothing is downloaded); pass a checkpoint directory, "
                              f"or unset HF_HUB_OFFLINE to download it")
    try:
        return Path(snapshot_download(repo, revision=rev, cache_dir=cache, allow_patterns=HUB_FILES))
    except (OfflineModeIsEnabled, HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        why = " ".join(str(e).split())[:200]
        raise CheckpointError(f"{text}: not a directory, not in the Hugging Face cache {cache}, and the "
                              f"download failed ({type(e).__name__}: {why}); pass a checkpoint directory") from None


def read_checkpoint(directory: str | Path) -> Checkpoint:
    """Read config.json and every safetensors header in `directory` (no weights loaded); a
    Hub id is resolved first (resolve_model)."""
    d = resolve_model(directory)
    if not d.exists():
        raise CheckpointError(f"{d}: no such directory; pass a Hugging Face checkpoint directory")
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a directory; pass the checkpoint directory, not a file in it")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(
            f"{d}: not a checkpoint directory (no config.json); expected a Hugging Face model "
            f"directory with config.json and *.safetensors"
        )
    config = with_modelopt_config(d, read_json_object(cfg_path))
    ckpt = Checkpoint(d.resolve(), config)

    index = d / "model.safetensors.index.json"
    if index.is_file():
        data = read_json_object(index)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict):
            what = _json_kind(weight_map) if "weight_map" in data else "missing"
            raise CheckpointError(f"{index}: malformed shard index: 'weight_map' is {what}; expected an "
                                  f"object of tensor name -> file name")
        files = sorted(set(weight_map.values()), key=str)
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    for fname in files:
        if not isinstance(fname, str) or fname != Path(fname).name or fname in ("", ".", ".."):
            raise CheckpointError(f"{index}: shard {fname!r} is not a file name in the checkpoint directory")
        path = d / fname
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in the shard index but missing")
        ckpt.files[fname] = path.stat().st_size
        ckpt.headers[fname] = read_safetensors_header(path)
        ckpt.tensors.update(ckpt.headers[fname].tensors)
    if not files and any(d.glob("*.bin")):
        raise CheckpointError(
            f"{d}: only PyTorch .bin weights found; moecc reads safetensors only (a .bin file "
            f"can run code when loaded). Convert it with transformers' save_pretrained(safe_serialization=True)"
        )
    return ckpt
