"""The schedule of one decode step and one prefill step as a timeline (SVG): a compute lane
and a copy lane (and a host lane where attention runs on the host CPU beside a device), one
bar per job over time, the critical path outlined in red; the measured
timeline of the same steps (from `moecc exec --stats`) drawn below the predicted one, on the
same time scale.

Input is plain data: the plan's "timeline" (moecc/planner/schedule.py `to_data`: the
planner's own job DAG, stored at compile time) and the stats file's engine "timeline"
(runtime/worker/timeline.py). Both hold jobs as [name, lane, kind, layer, start_s, seconds].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moecc.views import svg

LANES = ("compute", "copy")
HOST_LANE = "host"  # attention on the host CPU beside a real device (drawn when a step has such jobs)
KIND_COLOURS = {"attention": "#4e79a7", "gather": "#a0cbe8", "gemm": "#59a14f", "expert": "#59a14f",
                "router": "#f28e2b", "mlp": "#8cd17d", "head": "#76b7b2", "stem": "#bab0ac",
                "fetch": "#b07aa1", "kv_load": "#ff9da7", "kv_store": "#d4a6c8", "glue": "#dcdcdc"}
CRITICAL = "#d62728"
LEFT, LANE_H, BAR_H, WIDTH = 150, 26, 18, 1100


class TimelineError(ValueError):
    """A timeline that cannot be drawn (missing, or not in the expected shape)."""


@dataclass(frozen=True)
class Bar:
    name: str
    lane: str
    kind: str
    layer: int | None
    start: float
    seconds: float
    critical: bool = False

    @property
    def end(self) -> float:
        return self.start + self.seconds


def bars(data: dict[str, Any], layers: int | None, origin: str) -> list[Bar]:
    """The jobs of one step to draw: all of them when `layers` is None or covers every
    layer, else the stem's and those of the first `layers` layers (not the head's). `origin` names the data
    in errors (e.g. "plan timeline.decode")."""
    try:
        rows = data["jobs"]
        crit = set(data.get("critical", []))
        out = [Bar(str(r[0]), str(r[1]), str(r[2]), None if r[3] is None else int(r[3]), float(r[4]), float(r[5]),
                   i in crit) for i, r in enumerate(rows)]
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise TimelineError(f"{origin}: jobs are not [name, lane, kind, layer, start, seconds] rows ({e})") from e
    total = data.get("layers") or 1 + max((b.layer for b in out if b.layer is not None), default=-1)
    if layers is None or layers >= total:
        return out
    return [b for b in out if (b.layer is not None and b.layer < layers)
            or (b.layer is None and (b.kind == "stem" or b.name.startswith("stem")))]


def _tick(span: float) -> float:
    """A round tick interval (1, 2 or 5 x 10^k seconds) giving 5-10 ticks over `span`."""
    raw = span / 8 if span > 0 else 1e-3
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def lanes_of(bs: list[Bar]) -> tuple[str, ...]:
    """The lanes to draw: compute and copy, and the host lane when a job runs there."""
    return LANES + ((HOST_LANE,) if any(b.lane == HOST_LANE for b in bs) else ())


def _row(label: str, bs: list[Bar], y: float, scale: float, mark_critical: bool,
         lanes: tuple[str, ...] = LANES) -> list[str]:
    out = [svg.text(12, y + 12, label, size=12, font_weight="bold")]
    for k, lane in enumerate(lanes):
        ly = y + 18 + k * LANE_H
        out.append(svg.text(24, ly + 13, lane, size=11, fill="#555"))
        out.append(svg.rect(LEFT, ly, WIDTH, BAR_H, "#f7f7f7", stroke="#e5e5e5"))
        for b in (b for b in bs if b.lane == lane):
            crit = mark_critical and b.critical
            cls = f"bar lane-{lane} kind-{b.kind}" + (" critical" if crit else "")
            tip = f"{b.name} ({b.kind}{'' if b.layer is None else f', layer {b.layer}'}): {_ms(b.start)} + {_ms(b.seconds)}" \
                  + (" - on the critical path" if crit else "")
            out.append(f"<g {svg.attr(class_=cls)}>{svg.title(tip)}"
                       + svg.rect(LEFT + b.start * scale, ly + 1, max(b.seconds * scale, 0.6), BAR_H - 2,
                                  KIND_COLOURS.get(b.kind, "#cccccc"), stroke=CRITICAL if crit else "white",
                                  stroke_width=1.6 if crit else 0.4, data_name=b.name, data_start=repr(b.start),
                                  data_seconds=repr(b.seconds))
                       + "</g>")
    return out


def _axis(y: float, span: float, scale: float) -> list[str]:
    out = [svg.line(LEFT, y, LEFT + WIDTH, y, stroke="#888")]
    step = _tick(span)
    t = 0.0
    while t <= span * 1.0001:
        x = LEFT + t * scale
        out += [svg.line(x, y, x, y + 4, stroke="#888"), svg.text(x, y + 15, _ms(t), size=10, anchor="middle")]
        t += step
    return out


def _legend(y: float, kinds: list[str]) -> list[str]:
    out, x = [], float(LEFT)
    for kind in kinds:
        out += [svg.rect(x, y, 14, 12, KIND_COLOURS.get(kind, "#cccccc"), stroke="white"),
                svg.text(x + 18, y + 10, kind, size=10)]
        x += 30 + 6.5 * len(kind)
    out += [svg.rect(x, y, 14, 12, "white", stroke=CRITICAL, stroke_width=1.6),
            svg.text(x + 18, y + 10, "critical path (predicted)", size=10)]
    return out


def draw_timeline(predicted: dict[str, Any], measured: dict[str, Any] | None = None, layers: int | None = 2,
                  title: str = "") -> str:
    """SVG text: for each phase in `predicted` (the plan's timeline), its predicted step and,
    when `measured` (the stats file's engine timeline) has the phase, the measured one below,
    both on one time scale. `layers`: how many layers to show (None: all, head included)."""
    if not predicted:
        raise TimelineError("the plan has no predicted timeline (compiled by an older moecc): recompile it")
    body: list[str] = []
    y = 40.0
    kinds: set[str] = set()
    for phase in ("decode", "prefill"):
        pred = predicted.get(phase)
        if pred is None:
            continue
        meas = (measured or {}).get(phase)
        pbars = bars(pred, layers, f"plan timeline.{phase}")
        mbars = bars(meas, layers, f"stats timeline.{phase}") if meas else []
        span = max([b.end for b in pbars + mbars] + [1e-9])
        scale = WIDTH / span
        total = pred.get("layers", "?")
        shown = "all layers" if layers is None or (isinstance(total, int) and layers >= total) else \
            f"layers 0-{layers - 1} of {total}"
        head = (f"{phase} step (B={pred.get('B')}, {pred.get('tokens')} tokens): predicted {_ms(pred['step_s'])}"
                + (f", measured {_ms(float(meas['step_s']))} (step {meas.get('step')}, {meas.get('sequences')} "
                   f"sequences, {meas.get('tokens')} tokens)" if meas else "") + f"; {shown}")
        body.append(svg.text(12, y, head, size=13, font_weight="bold"))
        y += 10
        lanes = lanes_of(pbars + mbars)
        body += _row("predicted", pbars, y, scale, True, lanes)
        y += 18 + len(lanes) * LANE_H + 6
        if meas:
            body += _row("measured", mbars, y, scale, False, lanes)
            y += 18 + len(lanes) * LANE_H + 6
        body += _axis(y, span, scale)
        y += 46
        kinds |= {b.kind for b in pbars + mbars}
    order = [k for k in KIND_COLOURS if k in kinds] + sorted(kinds - set(KIND_COLOURS))
    body += _legend(y - 18, order)
    return svg.document(LEFT + WIDTH + 30, y + 10, body, title)
