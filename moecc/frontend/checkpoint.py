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
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object")
    ckpt = Checkpoint(d.resolve(), config)

    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed shard index: {e}") from e
        files = sorted(set(weight_map.values()))
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
