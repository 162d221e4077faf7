"""Each served model's plan: compiled once for the server's budgets, cached under the data
directory by a fingerprint.

Needs: the model specs and budgets of the config. Does: fingerprints each checkpoint (the
runtime's: config.json hash, each weight file's size and header hash) together with its
resolved directory, the budgets, the moecc version and the plan schema version; loads
`plans/<fingerprint>.pt` when it is there and valid, else compiles with the same code as
`moecc compile` (moecc.compiler.compile_model) and writes it atomically. Guarantees: the
same checkpoint under the same budgets reuses one plan (so a resumed batch keeps its
plan's identity across restarts); a changed checkpoint or budget compiles anew.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moecc.serve.config import ModelSpec, ServeConfig


@dataclass
class ServedModel:
    """A model the server runs: its name, checkpoint, cached plan, and what the status page
    shows of the plan (explain's summary, the predicted timeline as SVG)."""

    name: str
    path: Path
    created: int
    plan_path: Path | None = None  # None until `prepare` made or found it
    fingerprint: str = ""
    explain: str = ""
    timeline_svg: str = ""

    @classmethod
    def of(cls, spec: ModelSpec) -> "ServedModel":
        """Not yet prepared: named, dated by its config.json."""
        d = spec.path.resolve()
        return cls(spec.name, d, int((d / "config.json").stat().st_mtime))


def fingerprint(spec: ModelSpec, cfg: ServeConfig) -> str:
    """16 hex digits naming the plan `spec` compiles to under `cfg`'s budgets."""
    import moecc
    from moecc_runtime.plan import fingerprint as checkpoint_fingerprint
    from moecc_runtime.plan_schema import SCHEMA_VERSION

    d = spec.path.resolve()
    files = sorted(p.name for p in d.glob("*.safetensors"))
    content = {"checkpoint": checkpoint_fingerprint(d, files), "dir": str(d), "gpu_mem": cfg.gpu_mem,
               "host_mem": cfg.host_mem, "hardware": cfg.hardware, "max_batch": cfg.max_batch,
               "moecc": moecc.__version__, "schema": SCHEMA_VERSION}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def prepare(spec: ModelSpec, cfg: ServeConfig, plans_dir: Path, log: Callable[[str], None],
            model: ServedModel | None = None) -> ServedModel:
    """The served model of `spec` (`model`, filled in) with its cached plan, compiled first
    when missing or unreadable."""
    from moecc_runtime.plan import PlanError, load_plan, save_plan

    plans_dir.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(spec, cfg)
    path = plans_dir / f"{fp}.pt"
    plan: dict[str, Any] | None = None
    if path.is_file():
        try:
            plan = load_plan(path)
            log(f"moecc serve: model {spec.name}: cached plan {path}")
        except PlanError as e:
            log(f"moecc serve: model {spec.name}: cached plan unusable ({e}); recompiling")
    if plan is None:
        from moecc.compiler import compile_model

        log(f"moecc serve: model {spec.name}: compiling {spec.path} (fingerprint {fp})")
        plan, _ = compile_model(spec.path.resolve(), gpu_mem=cfg.gpu_mem, host_mem=cfg.host_mem,
                                hardware=cfg.hardware, max_batch=cfg.max_batch)
        tmp = plans_dir / f".{fp}.{os.getpid()}.tmp"
        save_plan(plan, tmp)
        os.replace(tmp, path)
    model = model or ServedModel.of(spec)
    model.explain, model.timeline_svg = describe(plan)
    model.fingerprint, model.plan_path = fp, path
    return model


def describe(plan: dict[str, Any]) -> tuple[str, str]:
    """(explain's text summary, the predicted timeline of one decode and prefill step as SVG;
    empty when the plan has none)."""
    from moecc.views.explain import explain, format_explain
    from moecc.views.timeline_svg import TimelineError, draw_timeline

    text = format_explain(explain(plan))
    try:
        svg = draw_timeline(plan.get("timeline") or {}, None, 2, title=plan["model"]["architecture"])
    except TimelineError:
        svg = ""
    return text, svg
