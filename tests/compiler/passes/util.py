"""Helpers for per-pass tests: the graph just before a pass, and golden dumps.

Golden files hold the dump a pass produces (without the provenance line, which carries a
duration). Regenerate with MOECC_UPDATE_GOLDEN=1 and review the diff."""

from __future__ import annotations

import os
from pathlib import Path

from moecc.frontend.build import build_graph
from moecc.ir import Graph
from moecc.ir.pass_infra import PassContext, PassManager, PassResult
from moecc.options import CompileOptions
from moecc.passes import default_pipeline
from moecc.ir.printer import format_graph
from moecc.ir.verify import verify_graph

DATA = Path(__file__).parent / "data"
GOLDEN = Path(__file__).parent / "golden"


def context(model: str = "tiny-mixtral", **options) -> tuple[Graph, PassContext]:
    """The frontend's graph of a test model and a verifying context (CompileOptions fields as keywords)."""
    graph, ckpt = build_graph(DATA / model)
    return graph, PassContext(options=CompileOptions(checkpoint=ckpt, **options), verify=True)


def graph_before(pass_name: str, model: str = "tiny-mixtral", **options) -> tuple[Graph, PassContext]:
    """Run the default pipeline up to (not including) `pass_name`."""
    graph, ctx = context(model, **options)
    names = [p.name for p in default_pipeline()]
    if names.index(pass_name) == 0:
        return graph, ctx
    return PassManager(default_pipeline())(graph, ctx, stop_after=names[names.index(pass_name) - 1]), ctx


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
