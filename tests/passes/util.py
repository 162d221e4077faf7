"""Helpers for per-pass tests: the graph just before a pass, and golden dumps.

Golden files hold the dump a pass produces (without the provenance line, which carries a
duration). Regenerate with MOECC_UPDATE_GOLDEN=1 and review the diff."""

from __future__ import annotations

import os
from pathlib import Path

from moecc.frontend.trace import build_graph
from moecc.ir import Graph
from moecc.pass_infra import PassContext, PassResult
from moecc.passes import default_pipeline
from moecc.printer import format_graph
from moecc.verify import verify_graph

DATA = Path(__file__).parent / "data"
GOLDEN = Path(__file__).parent / "golden"


def context(model: str = "tiny-mixtral", **options) -> tuple[Graph, PassContext]:
    graph, ckpt = build_graph(DATA / model)
    opts = {"gpu_mem": None, "host_mem": None, "checkpoint": ckpt}
    opts.update(options)
    return graph, PassContext(options=opts, verify=True)


def graph_before(pass_name: str, model: str = "tiny-mixtral", **options) -> tuple[Graph, PassContext]:
    """Run the default pipeline up to (not including) `pass_name`."""
    graph, ctx = context(model, **options)
    for p in default_pipeline():
        if p.name == pass_name:
            return graph, ctx
        result = p.run(graph, ctx)
        result.graph.properties |= set(p.ensures)
        graph = result.graph
    raise KeyError(pass_name)


def run_pass(pass_name: str, model: str = "tiny-mixtral", **options) -> tuple[Graph, PassResult]:
    """(input graph, result) of `pass_name`, checking its contract like the PassManager."""
    graph, ctx = graph_before(pass_name, model, **options)
    p = next(p for p in default_pipeline() if p.name == pass_name)
    assert p.requires <= graph.properties
    before = format_graph(graph)
    result = p.run(graph, ctx)
    assert format_graph(graph) == before, f"{pass_name} mutated its input graph"
    result.graph.properties |= set(p.ensures)
    problems = verify_graph(result.graph)
    assert not problems, problems
    return graph, result


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("MOECC_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"dump differs from {path}; if intended, rerun with MOECC_UPDATE_GOLDEN=1"
