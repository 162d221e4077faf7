"""Plan files: writing and reading a plan (plain data, `torch.load(weights_only=True)`), and
checking it against the checkpoint it names. What a plan holds, and the check of every
field on load, is the schema's: moecc_runtime/plan_schema.py.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import torch

from moecc_runtime.memory.safetensors_header import ITEMSIZE, Header, HeaderError, TensorLocation, read_header, slice_of
from moecc_runtime.plan_schema import SCHEMA, SCHEMA_VERSION, SchemaError, validate


class PlanError(Exception):
    """The plan file is unreadable, of another schema version, or made for another checkpoint."""


def save_plan(plan: dict[str, Any], path: str | Path) -> None:
    torch.save(plan, str(path))


def load_plan(path: str | Path) -> dict[str, Any]:
    """The plan at `path`, validated field by field against this runtime's schema; a plan of
    another version, or one that holds anything beyond plain data, is refused (PlanError)."""
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"{p}: no such plan file; make one with `moecc compile MODEL_DIR -o {p}`")
    try:
        plan = torch.load(str(p), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refused an object it would have had to construct
        first = str(e).strip().splitlines()
        detail = next((ln.strip() for ln in first if "GLOBAL" in ln or "Unsupported" in ln), first[-1] if first else "")
        raise PlanError(f"{p}: refused to load: the file holds Python objects beyond plain data, which could run "
                        f"code when unpickled ({detail}). moecc plans are plain data; do not use this file, "
                        f"recompile the plan with `moecc compile`") from None
    except Exception as e:
        raise PlanError(f"{p}: not a moecc plan (cannot be read as plain data: {e})") from e
    if not isinstance(plan, dict) or plan.get("schema") != SCHEMA:
        raise PlanError(f"{p}: not a moecc plan (schema {plan.get('schema') if isinstance(plan, dict) else None!r})")
    if plan.get("version") != SCHEMA_VERSION:
        raise PlanError(
            f"{p}: plan schema version {plan.get('version')} but this runtime reads version "
            f"{SCHEMA_VERSION}; recompile with `moecc compile`"
        )
    try:
        validate(plan)
    except SchemaError as e:
        raise PlanError(f"{p}: not a valid moecc plan: {e}; recompile it with `moecc compile`") from None
    return plan


def fingerprint(model_dir: str | Path, weight_files: list[str],
                headers: dict[str, Header] | None = None) -> dict[str, Any]:
    """config.json's hash, and the size and header hash (the tensor layout) of each weight
    file: what compile records and exec checks. `headers`: the files' headers when already
    read (otherwise read here)."""
    d = Path(model_dir)
    files = sorted(weight_files)
    if headers is None:
        headers = {f: read_header(d / f) for f in files}
    return {
        "config_sha256": hashlib.sha256((d / "config.json").read_bytes()).hexdigest(),
        "weight_files": {f: (d / f).stat().st_size for f in files},
        "weight_headers": {f: headers[f].sha256 for f in files},
    }


def check_checkpoint(plan: dict[str, Any], model_dir: str | Path | None = None) -> Path:
    """Refuse a plan whose checkpoint is gone, changed (config, file sizes, tensor layout), or
    lacks weights, or whose manifest names a file outside the checkpoint directory or bytes
    that are not the tensor slice it says; return the checkpoint directory. Reads headers
    only, each once."""
    d = Path(model_dir or plan["model"]["dir"])
    want = plan["model"]["fingerprint"]
    if not (d / "config.json").is_file():
        raise PlanError(f"{d}: the plan's checkpoint directory has no config.json (moved or deleted?); "
                        f"pass --model DIR or recompile")
    if not want["weight_files"]:
        raise PlanError(
            f"the plan was compiled from {d} without weight files (a config-only plan, for "
            f"inspection); compile it from a directory that holds the *.safetensors to run it"
        )
    files = sorted(want["weight_files"])
    for f in files:
        _plain_name(f, "model.fingerprint.weight_files")
    missing = [f for f in files if not (d / f).is_file()]
    if missing:
        raise PlanError(f"{d}: weight files {missing} named in the plan are missing")
    _agree(d, "config.json", want["config_sha256"], hashlib.sha256((d / "config.json").read_bytes()).hexdigest())
    _agree(d, "weight file sizes", want["weight_files"], {f: (d / f).stat().st_size for f in files})
    try:  # read only once config and sizes agree (a grown file fails as "sizes", not as a bad header)
        headers = {f: read_header(d / f) for f in files}
    except HeaderError as e:
        raise PlanError(f"{e}; the checkpoint is damaged or changed since compile") from None
    _agree(d, "the tensor layout (a safetensors header)", want["weight_headers"],
           {f: h.sha256 for f, h in headers.items()})
    _check_manifest(plan, {f: h.tensors for f, h in headers.items()})
    return d


def _agree(d: Path, what: str, want: Any, have: Any) -> None:
    if have != want:
        raise PlanError(f"plan was made for another checkpoint: {what} of {d} differ from what the plan "
                        f"recorded; recompile with `moecc compile {d}`")


def _plain_name(name: Any, where: str) -> None:
    """A weight file is named by a plain file name inside the checkpoint directory."""
    if not isinstance(name, str) or name != Path(name).name or name in ("", ".", "..") or "\\" in name:
        raise PlanError(f"{where}: {name!r} is not a file name inside the checkpoint directory; "
                        f"this plan is not one moecc wrote: recompile it")


def _check_manifest(plan: dict[str, Any], headers: dict[str, dict[str, TensorLocation]]) -> None:
    """Every manifest entry is the slice of its tensor it says: same file, dtype, shape, offset."""
    for key, entry in plan["weights"].items():
        for part, e in {"data": entry, **entry.get("parts", {})}.items():
            _check_stored(f"plan.weights[{key!r}]" + ("" if part == "data" else f".parts[{part!r}]"), e, headers)


def _check_stored(where: str, e: dict[str, Any], headers: dict[str, dict[str, TensorLocation]]) -> None:
    """One stored tensor slice of the manifest is what it says, in its file's header."""
    if e["file"] is None:
        return
    _plain_name(e["file"], f"{where}.file")
    loc = headers.get(e["file"], {}).get(e["tensor"])
    if loc is None or loc.dtype != e["dtype"]:
        found = "absent" if loc is None else f"of dtype {loc.dtype}"
        raise PlanError(f"{where}: tensor {e['tensor']} ({e['dtype']}) is {found} in {e['file']}; "
                        f"recompile the plan for this checkpoint")
    try:
        offset, shape = slice_of(loc, e["index"], e["rows"], ITEMSIZE[loc.dtype])
    except HeaderError as err:
        raise PlanError(f"{where}: {err}; recompile the plan for this checkpoint") from None
    if (offset, list(shape)) != (e["offset"], list(e["shape"])):
        raise PlanError(f"{where}: names bytes at {e['offset']} of shape {e['shape']} but tensor "
                        f"{e['tensor']}'s slice is at {offset} of shape {list(shape)} in {e['file']}; "
                        f"recompile the plan for this checkpoint")


def describe(plan: dict[str, Any]) -> str:
    """One-line summary for logs."""
    b = plan["batch"]["decode"]
    return (f"{plan['model']['architecture']} plan v{plan['version']}: decode B={b['B']} "
            f"b_a={b['b_a']} b_e={b['b_e']}, {len(plan['weights'])} weight slices")

