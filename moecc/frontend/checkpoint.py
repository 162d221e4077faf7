"""Read a checkpoint directory without loading weights: config.json, the safetensors
headers (names, dtypes, shapes, byte offsets; read and validated by the runtime's
moecc_runtime/memory/safetensors_header.py), the shard index, and a fingerprint.
"""

from __future__ import annotations

import json
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


def read_checkpoint(directory: str | Path) -> Checkpoint:
    """Read config.json and every safetensors header in `directory` (no weights loaded)."""
    d = Path(directory)
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
    config = read_json_object(cfg_path)
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
