"""Pictures of a plan: the module graph as SVG (`--dump-format svg`) and the schedule as a
timeline (`moecc explain --timeline`, measured beside predicted with `--measured`).

The SVG is well-formed XML naming every node; roles differ in shape and colour; the
timeline is the planner's own DAG, whose critical-path bars add up to the predicted step
time; the measured timeline comes from a real `moecc exec --stats` run."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moecc.cli import app
from moecc.compiler import compile_model
from moecc.views.graph_svg import STYLES, graph_to_dot, graph_to_svg
from moecc.planner.schedule import to_data
from moecc.views.timeline_svg import TimelineError, bars, draw_timeline
from moecc_runtime.plan import save_plan

SVG = "{http://www.w3.org/2000/svg}"
ROLES = ("attention", "router", "experts", "buffer", "transfer")


def _svg_nodes(root: ET.Element) -> dict[str, ET.Element]:
    """name (from <title>) -> the node's <g> group."""
    out = {}
    for g in root.iter(f"{SVG}g"):
        if "node" in (g.get("class") or "").split():
            out[g.find(f"{SVG}title").text] = g
    return out


def test_svg_dumps_are_well_formed_and_draw_every_node(checkpoints, tmp_path):
    plan, g = compile_model(checkpoints("mixtral", "per_expert"), gpu_mem=900_000, max_batch=4, prompt_tokens=24,
                            output_tokens=8, dump_dir=tmp_path, dump_formats=("txt", "svg"))
    svgs = sorted(tmp_path.glob("*.svg"))
    assert [p.stem for p in svgs] == [p.stem for p in sorted(tmp_path.glob("*.txt"))]
    for p in svgs:
        root = ET.parse(p).getroot()  # well-formed XML
        assert root.tag == f"{SVG}svg"
        assert f"{p.stem[:3]} made by pass" in "".join(root.itertext())
    nodes = _svg_nodes(ET.parse(svgs[-1]).getroot())
    assert set(nodes) == {n.name for n in g.nodes}
    # attention, router, experts, host buffers and transfers: distinct shapes or colours
    drawn = {}
    for n in g.nodes:
        if n.role in ROLES and n.role not in drawn:
            first = [e for e in nodes[n.name] if e.tag != f"{SVG}title"][0]
            drawn[n.role] = (first.tag, first.get("fill"), first.get("stroke-dasharray"))
    assert set(drawn) == set(ROLES)
    assert len({v[1] for v in drawn.values()}) == len(ROLES)  # five colours
    assert {v[0].removeprefix(SVG) for v in drawn.values()} >= {"rect", "polygon", "ellipse"}
    assert drawn["transfer"][2] is not None  # transfers dashed


def test_graph_svg_layouts(checkpoints):
    _, g = compile_model(checkpoints("qwen2_moe", "per_expert"))
    dot = graph_to_dot(g, heading="qwen2_moe")
    assert "subgraph cluster_L0" in dot and all(f'"{n.name}"' in dot for n in g.nodes)
    assert f'fillcolor="{STYLES["shared_expert"].fill}"' in dot
    plain = ET.fromstring(graph_to_svg(g, layout="plain").encode())
    assert set(_svg_nodes(plain)) == {n.name for n in g.nodes}
    if shutil.which("dot"):
        ET.fromstring(graph_to_svg(g, layout="dot").encode())
    else:
        with pytest.raises(RuntimeError, match="graphviz"):
            graph_to_svg(g, layout="dot")
    with pytest.raises(ValueError, match="layout"):
        graph_to_svg(g, layout="neato")


def _budget_plan(checkpoints, tmp_path):
    ckpt = checkpoints("mixtral", "per_expert")
    plan, _ = compile_model(ckpt, gpu_mem=900_000, max_batch=8, prompt_tokens=12, output_tokens=12, hardware="cpu")
    path = tmp_path / "plan.pt"
    save_plan(plan, path)
    return ckpt, plan, path


def test_predicted_timeline_is_the_planners_dag_and_adds_up(checkpoints, tmp_path):
    _, plan, _ = _budget_plan(checkpoints, tmp_path)
    for phase in ("decode", "prefill"):
        t = plan["timeline"][phase]
        assert t["step_s"] == pytest.approx(plan["predicted"][f"{phase}_step_s"], rel=1e-12)
        bs = bars(t, None, phase)
        crit = [b for b in bs if b.critical]
        assert sum(b.seconds for b in crit) == pytest.approx(t["step_s"], rel=1e-9)
        assert max(b.end for b in bs) == pytest.approx(t["step_s"], rel=1e-9)
        for a, b in zip(crit, crit[1:]):  # the critical path runs back to back
            assert b.start == pytest.approx(a.end, rel=1e-9, abs=1e-12)
        assert {b.lane for b in bs} == {"compute", "copy"}  # a budget: weights stream
        for u, v in t["edges"]:  # dependencies point forward in time
            assert t["jobs"][v][4] >= t["jobs"][u][4] + t["jobs"][u][5] - 1e-12
    svg = draw_timeline(plan["timeline"], None, layers=None)
    root = ET.fromstring(svg.encode())
    rects = [r for r in root.iter(f"{SVG}rect") if r.get("data-name")]
    critical = [r for g in root.iter(f"{SVG}g") if "critical" in (g.get("class") or "")
                for r in g.iter(f"{SVG}rect")]
    total = sum(float(r.get("data-seconds")) for r in critical)
    steps = plan["timeline"]["decode"]["step_s"] + plan["timeline"]["prefill"]["step_s"]
    assert total == pytest.approx(steps, rel=1e-9)
    assert len(rects) == len(plan["timeline"]["decode"]["jobs"]) + len(plan["timeline"]["prefill"]["jobs"])


def test_timeline_of_a_large_model_keeps_a_few_layers(checkpoints):
    from moecc.planner.hardware import PRESETS
    from moecc.planner.costs import model_cost
    from moecc.planner.schedule import Knobs, StepShape, build_schedule

    _, g = compile_model(checkpoints("mixtral", "per_expert"))
    cost = model_cost(g)
    cost.layers = [replace(cost.layers[i % len(cost.layers)], layer=i) for i in range(6)]  # a deeper model
    s = build_schedule(cost, PRESETS["cpu"], StepShape(64, 64, 40, 64), Knobs(16, 64))
    full, cut = to_data(s), to_data(s, max_jobs=10, keep=2)
    assert full["layers_kept"] == [0, 1, 2, 3, 4, 5] and cut["layers_kept"] == [0, 1, 5]
    assert len(cut["jobs"]) < len(full["jobs"]) and cut["layers"] == full["layers"] == 6
    names = [j[0] for j in cut["jobs"]]
    assert {j[3] for j in cut["jobs"]} == {None, 0, 1, 5} and "head" in names
    assert all(0 <= i < len(names) for i in cut["critical"])
    assert all(0 <= u < len(names) and 0 <= v < len(names) for u, v in cut["edges"])
    assert cut["step_s"] == full["step_s"] == s.seconds


@pytest.mark.slow
def test_measured_timeline_from_exec_stats_drawn_under_the_predicted(checkpoints, tmp_path):
    ckpt, plan, path = _budget_plan(checkpoints, tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [1 + i, 7, 9, 11, 13, 2 + i], "max_tokens": 8}) + "\n"
                               for i in range(12)))
    stats = tmp_path / "stats.json"
    r = CliRunner().invoke(app, ["exec", str(path), str(prompts), "-o", str(tmp_path / "out.jsonl"), "--stats",
                                 str(stats), "--quiet"])
    assert r.exit_code == 0, r.output
    tl = json.loads(stats.read_text())["engine"]["timeline"]
    assert set(tl) == {"decode", "prefill"}
    for phase, t in tl.items():
        kinds = {(j[1], j[2]) for j in t["jobs"]}
        assert {("compute", "attention"), ("compute", "gemm"), ("compute", "head")} <= kinds, phase
        assert ("copy", "fetch") in kinds, phase  # experts stream through the arena's slots
        assert all(j[4] >= 0 and j[5] >= 0 and j[4] + j[5] <= t["step_s"] + 1e-3 for j in t["jobs"])
        busy = sum(j[5] for j in t["jobs"] if j[1] == "compute")
        assert busy <= t["step_s"] * 1.001  # one compute thread: its jobs do not overlap
    assert tl["decode"]["prefill_tokens"] == 0
    assert tl["prefill"]["prefill_tokens"] > tl["prefill"]["tokens"] / 2
    # the step's shape, as the planner's StepShape reads it (moecc/measure/calibrate.py): a decode row
    # attends to its whole sequence; a prefill row on average to half its step's prompt and more
    assert tl["decode"]["context"] > tl["decode"]["tokens"] / tl["decode"]["sequences"]
    assert 0 < tl["prefill"]["context"] and 0 < tl["prefill"]["head_rows"] <= tl["prefill"]["sequences"]
    assert tl["decode"]["head_rows"] == tl["decode"]["sequences"]
    out = tmp_path / "t.svg"
    r = CliRunner().invoke(app, ["explain", str(path), "--timeline", str(out), "--measured", str(stats),
                                 "--layers", "0"])
    assert r.exit_code == 0, r.output
    assert "wrote" in r.output
    root = ET.parse(out).getroot()
    text = " ".join(root.itertext())
    assert text.count("predicted") >= 2 and text.count("measured") >= 2
    measured_bars = [r for r in root.iter(f"{SVG}rect") if r.get("data-name")]
    assert len(measured_bars) == sum(len(plan["timeline"][p]["jobs"]) + len(tl[p]["jobs"]) for p in tl)
    # without --timeline: predicted against measured seconds per job kind, in the report
    r = CliRunner().invoke(app, ["explain", str(path), "--measured", str(stats), "--json"])
    assert r.exit_code == 0, r.output
    cmp = json.loads(r.output)["measured"]
    assert set(cmp) == {"decode", "prefill"}
    for phase, c in cmp.items():
        assert c["predicted_step_s"] == plan["timeline"][phase]["step_s"]
        assert c["measured_step_s"] == tl[phase]["step_s"]
        for kind in ("compute/gemm", "compute/attention", "compute/head", "copy/fetch"):
            assert c["kinds"][kind]["predicted_s"] > 0 and c["kinds"][kind]["measured_s"] > 0, (phase, kind)
        for lane in ("compute", "copy"):  # every job of both timelines is counted once
            for side, t in (("predicted_s", plan["timeline"][phase]), ("measured_s", tl[phase])):
                total = sum(v[side] for k, v in c["kinds"].items() if k.startswith(lane) and k != "compute/idle")
                assert total == pytest.approx(sum(j[5] for j in t["jobs"] if j[1] == lane))
        idle = c["kinds"]["compute/idle"]["measured_s"]
        assert idle == pytest.approx(tl[phase]["step_s"] - sum(j[5] for j in tl[phase]["jobs"] if j[1] == "compute"),
                                     abs=1e-9)
    r = CliRunner().invoke(app, ["explain", str(path), "--measured", str(stats)])
    assert r.exit_code == 0 and "predicted against measured" in r.output and "compute/gemm" in r.output


def test_timeline_errors_name_what_is_wrong(checkpoints, tmp_path):
    _, plan, path = _budget_plan(checkpoints, tmp_path)
    r = CliRunner().invoke(app, ["explain", str(path), "--measured", str(tmp_path / "s.json")])
    assert r.exit_code == 1 and "s.json" in r.output and "not a readable stats JSON" in r.output
    stale = tmp_path / "old.json"
    stale.write_text(json.dumps({"engine": {"steps": 3}}))
    r = CliRunner().invoke(app, ["explain", str(path), "--timeline", str(tmp_path / "t.svg"), "--measured",
                                 str(stale)])
    assert r.exit_code == 1 and "engine.timeline" in r.output
    with pytest.raises(TimelineError, match="older moecc"):
        draw_timeline({}, None)
    with pytest.raises(TimelineError, match="plan timeline.decode"):
        bars({"jobs": [["x", "compute"]]}, None, "plan timeline.decode")


def test_readme_pictures_exist():
    root = Path(__file__).resolve().parent.parent.parent
    readme = (root / "README.md").read_text()
    for pic in ("docs/graph.svg", "docs/timeline.svg"):
        assert pic in readme
        ET.parse(root / pic)
