"""The options of `moecc serve`, checked before anything starts.

Needs: what the command line gave. Does: parses `NAME=DIR` model specs, the sizes, the
keys. Guarantees: a config that passes `check` names existing checkpoint directories under
unique names, and listens on a non-loopback address only with at least one API key.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MAX_FILE_SIZE = 8 * 2**30  # 8 GiB an upload
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


@dataclass(frozen=True)
class ModelSpec:
    """A served model: the name a line's `body.model` picks it by, and its checkpoint."""

    name: str
    path: Path


@dataclass
class ServeConfig:
    models: list[ModelSpec]
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    keys: list[str] = field(default_factory=list)
    max_file_size: int = DEFAULT_MAX_FILE_SIZE
    gpu_mem: int | None = None
    host_mem: int | None = None
    hardware: str | None = None
    device: str = "auto"
    threads: int | None = None  # the worker's torch threads (None: all cores but one)
    max_tokens: int = 256  # a line's default max_tokens when it sets none
    max_batch: int = 1024  # compile's --max-batch for each model's plan
    max_active_batches: int = 10_000  # batches not yet finished, per key, before create answers 429


def parse_model(spec: str) -> ModelSpec:
    """`DIR` (served under the directory's name) or `NAME=DIR`; ValueError naming the spec."""
    name, sep, rest = spec.partition("=")
    path = Path(rest if sep else spec)
    if not sep:
        name = path.resolve().name
    if not _NAME.match(name):
        raise ValueError(f"model {spec!r}: the name {name!r} must be letters, digits and ._:- (at most 128); "
                         f"give NAME=DIR")
    return ModelSpec(name, path)


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check(cfg: ServeConfig) -> None:
    """Refuse (ValueError naming the option and what to do) a config that cannot serve."""
    if not cfg.models:
        raise ValueError("give at least one MODEL (a checkpoint directory, or NAME=DIR)")
    names = [m.name for m in cfg.models]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"model names {dup} are given twice; serve them as NAME=DIR with distinct names")
    for m in cfg.models:
        if not (m.path / "config.json").is_file():
            raise ValueError(f"model {m.name}: {m.path} is not a checkpoint directory (no config.json)")
    if not is_loopback(cfg.host) and not cfg.keys:
        raise ValueError(f"--host {cfg.host} is not a loopback address: refusing to listen there without "
                         f"an API key; give --api-key KEY or --api-keys FILE")
    if not 0 <= cfg.port <= 65535:
        raise ValueError(f"--port {cfg.port}: must be 0..65535")
    if cfg.max_file_size < 1:
        raise ValueError("--max-file-size must be at least 1 byte")
    if cfg.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    if cfg.threads is not None and cfg.threads < 1:
        raise ValueError("--threads must be at least 1")
