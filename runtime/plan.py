"""The plan: a versioned, plain-data artifact (dicts, lists, strings, numbers, tensors)
written by `moecc compile` and read here with `torch.load(weights_only=True)`.

Top-level keys (schema version 2; 2 added `arena`):
  schema, version      "moecc.plan", 1
  model                {dir, architecture, model_type, fingerprint{config_sha256, weight_files}, info{...}}
  batch                {prefill{B,b_a,b_e}, decode{B,b_a,b_e}, workload{...}}
  memory               {device{...}, host{...}}
  arena                None (no device budget: weights read in place) or the device arena the
                       runtime carves: {bytes, resident[groups], dense_slot_bytes, expert_slots,
                       expert_slot_bytes, kv_buffer_tokens, stage_bytes}
  weights              {key: {tensor, file, offset, nbytes, dtype, shape}}   (file None: absent)
  rope                 {inv_freq: tensor [hd/2], attention_scaling: float}
  schedule             [{module, kind, layer, ops: [{op, name, inputs, weights{local: key}, attrs}]}]
  predicted            {flops_per_token, weight_bytes, kv_bytes_per_token, ...}
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import torch

SCHEMA = "moecc.plan"
SCHEMA_VERSION = 2
REQUIRED_KEYS = ("schema", "version", "model", "batch", "weights", "rope", "schedule")


class PlanError(Exception):
    """The plan file is unreadable, of another schema version, or made for another checkpoint."""


def save_plan(plan: dict[str, Any], path: str | Path) -> None:
    torch.save(plan, str(path))


def load_plan(path: str | Path) -> dict[str, Any]:
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
    missing = [k for k in REQUIRED_KEYS if k not in plan]
    if missing:
        raise PlanError(f"{p}: plan is missing {missing}; recompile it")
    return plan


def fingerprint(model_dir: str | Path, weight_files: list[str]) -> dict[str, Any]:
    """config.json's hash and the sizes of the weight files (what compile recorded)."""
    d = Path(model_dir)
    return {
        "config_sha256": hashlib.sha256((d / "config.json").read_bytes()).hexdigest(),
        "weight_files": {f: (d / f).stat().st_size for f in sorted(weight_files)},
    }


def check_checkpoint(plan: dict[str, Any], model_dir: str | Path | None = None) -> Path:
    """Refuse a plan whose checkpoint is gone, changed, or lacks weights; return its dir."""
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
    missing = [f for f in want["weight_files"] if not (d / f).is_file()]
    if missing:
        raise PlanError(f"{d}: weight files {missing} named in the plan are missing")
    have = fingerprint(d, list(want["weight_files"]))
    if have != want:
        what = "config.json" if have["config_sha256"] != want["config_sha256"] else "weight file sizes"
        raise PlanError(
            f"plan was made for another checkpoint: {what} of {d} differ from what the plan "
            f"recorded; recompile with `moecc compile {d}`"
        )
    return d


def describe(plan: dict[str, Any]) -> str:
    """One-line summary for logs."""
    b = plan["batch"]["decode"]
    return (f"{plan['model']['architecture']} plan v{plan['version']}: decode B={b['B']} "
            f"b_a={b['b_a']} b_e={b['b_e']}, {len(plan['weights'])} weight slices")

