"""Read a checkpoint directory without loading weights: config.json, the safetensors
headers (names, dtypes, shapes, byte offsets), the shard index, and a fingerprint.

A safetensors file is: 8 bytes little-endian header length N, N bytes of JSON header
({name: {dtype, shape, data_offsets: [begin, end]}}), then the data; offsets are relative
to the end of the header.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from moecc.errors import CheckpointError

SAFETENSORS_DTYPES = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


@dataclass(frozen=True)
class TensorLocation:
    """Where one checkpoint tensor's bytes are: file (relative to the model dir) and the
    absolute byte offset of its first element."""

    file: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Checkpoint:
    directory: Path
    config: dict
    tensors: dict[str, TensorLocation] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)  # weight file -> size in bytes

    @property
    def has_weights(self) -> bool:
        return bool(self.tensors)

    def fingerprint(self) -> dict:
        """What `exec` checks to refuse a plan made for another checkpoint (computed by the
        runtime's own function, so both sides agree by construction)."""
        from moecc_runtime.plan import fingerprint

        return fingerprint(self.directory, list(self.files))


def read_safetensors_header(path: Path) -> dict[str, TensorLocation]:
    """Parse one safetensors file's header into TensorLocations (absolute offsets)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 2**20:
                raise CheckpointError(f"{path}: header length {n} is not plausible; is it a safetensors file?")
            header = json.loads(f.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors header: {e}") from e
    out: dict[str, TensorLocation] = {}
    base = 8 + n
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(meta.get("dtype", ""))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {meta.get('dtype')!r}")
        begin, end = meta["data_offsets"]
        out[name] = TensorLocation(path.name, base + begin, end - begin, dtype, tuple(meta["shape"]))
    return out


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
        path = d / fname
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in the shard index but missing")
        ckpt.files[fname] = path.stat().st_size
        for name, loc in read_safetensors_header(path).items():
            ckpt.tensors[name] = loc
    if not files and any(d.glob("*.bin")):
        raise CheckpointError(
            f"{d}: only PyTorch .bin weights found; moecc reads safetensors only (a .bin file "
            f"can run code when loaded). Convert it with transformers' save_pretrained(safe_serialization=True)"
        )
    return ckpt
