"""Plan files: writing and reading a plan (plain data, `torch.load(weights_only=True)`), and
checking it against the checkpoint it names. What a plan holds, and the check of every
field on load, is the schema's: moecc_runtime/plan_schema.py.

A plan compiled with `--quantize` reads its quantized weights from one file beside it, its
sidecar: the plan's file name + ".weights.safetensors" (sidecar_path). The name is fixed by
the path the plan is read from, never taken from the plan, so a plan still reads nothing
outside its checkpoint directory but that one file; manifest entries in it say `root:
"plan"`, and the fingerprint records its size and header hash (the header's metadata holds
a digest of its data), which exec checks like the checkpoint's.
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


#: The quantized weights file of plan P is P's file name + this, in P's directory.
SIDECAR_SUFFIX = ".weights.safetensors"


def sidecar_path(plan_path: str | Path) -> Path:
    """Where the plan at `plan_path` keeps the weights `moecc compile --quantize` wrote: beside
    it, named after it (plan.pt -> plan.pt.weights.safetensors). Fixed by the plan's own
    path: a plan never names a path of its own to read."""
    p = Path(plan_path)
    return p.with_name(p.name + SIDECAR_SUFFIX)


def has_sidecar(plan: dict[str, Any]) -> bool:
    """Whether the plan reads weights quantized at compile from its sidecar."""
    return "sidecar" in plan["model"]["fingerprint"]


def check_checkpoint(plan: dict[str, Any], model_dir: str | Path | None = None,
                     plan_path: str | Path | None = None) -> Path:
    """Refuse a plan whose checkpoint is gone, changed (config, file sizes, tensor layout), or
    lacks weights, or whose manifest names a file outside the checkpoint directory or bytes
    that are not the tensor slice it says; return the checkpoint directory. A plan with
    quantized weights (a sidecar) needs `plan_path`, where it was read from: its sidecar
    must be there, of the size and header it recorded. Reads headers only, each once."""
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
    sidecar = _check_sidecar(plan, d, plan_path)
    _check_manifest(plan, {f: h.tensors for f, h in headers.items()}, sidecar)
    return d


def _check_sidecar(plan: dict[str, Any], d: Path, plan_path: str | Path | None) -> dict[str, TensorLocation] | None:
    """The tensors of the plan's sidecar (None: it has none), refused (PlanError naming the
    file) when missing or not the file the plan recorded (size, header hash)."""
    want = plan["model"]["fingerprint"].get("sidecar")
    if want is None:
        return None
    if plan_path is None:
        raise PlanError("the plan reads quantized weights from the file beside it, but it was given without the "
                        "path it was read from; pass the plan's path (check_checkpoint(..., plan_path=...), "
                        "Engine(..., plan_path=...))")
    path = sidecar_path(plan_path)
    q = want["quantize"]
    redo = (f"recompile with `moecc compile {d} --quantize {q.get('scheme')} --quantize-group-size "
            f"{q.get('group_size')} --quantize-scope {q.get('scope')} -o {plan_path}`")
    if not path.is_file():
        raise PlanError(f"{path}: the quantized weights of plan {plan_path} are missing (compile writes them "
                        f"beside the plan, named after it; moved or deleted?); {redo}")
    try:
        header = read_header(path) if path.stat().st_size == want["size"] else None
    except HeaderError as e:
        raise PlanError(f"{e}; the quantized weights file changed since compile: {redo}") from None
    if header is None or header.sha256 != want["header_sha256"]:
        what = "size" if header is None else "tensor layout (its safetensors header)"
        raise PlanError(f"{path}: the quantized weights file of plan {plan_path} changed since compile (its "
                        f"{what} differs from what the plan recorded); {redo}")
    return header.tensors


def _agree(d: Path, what: str, want: Any, have: Any) -> None:
    if have != want:
        raise PlanError(f"plan was made for another checkpoint: {what} of {d} differ from what the plan "
                        f"recorded; recompile with `moecc compile {d}`")


def _plain_name(name: Any, where: str) -> None:
    """A weight file is named by a plain file name inside the checkpoint directory."""
    if not isinstance(name, str) or name != Path(name).name or name in ("", ".", "..") or "\\" in name:
        raise PlanError(f"{where}: {name!r} is not a file name inside the checkpoint directory; "
                        f"this plan is not one moecc wrote: recompile it")


def _check_manifest(plan: dict[str, Any], headers: dict[str, dict[str, TensorLocation]],
                    sidecar: dict[str, TensorLocation] | None = None) -> None:
    """Every manifest entry is the slice of its tensor it says: same file, dtype, shape, offset
    (an entry with root "plan": in the sidecar, whose tensors are `sidecar`)."""
    for key, entry in plan["weights"].items():
        for part, e in {"data": entry, **entry.get("parts", {})}.items():
            where = f"plan.weights[{key!r}]" + ("" if part == "data" else f".parts[{part!r}]")
            _check_stored(where, e, headers, sidecar)


def _check_stored(where: str, e: dict[str, Any], headers: dict[str, dict[str, TensorLocation]],
                  sidecar: dict[str, TensorLocation] | None = None) -> None:
    """One stored tensor slice of the manifest is what it says, in its file's header."""
    if e["file"] is None:
        return
    _plain_name(e["file"], f"{where}.file")
    if e.get("root") == "plan":
        if sidecar is None:
            raise PlanError(f"{where}: names the plan's quantized weights file, but the plan records none "
                            f"(model.fingerprint.sidecar); this plan is not one moecc wrote: recompile it")
        headers = {e["file"]: sidecar}
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

