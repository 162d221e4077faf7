"""PassManager: requirements, the verifier after every pass, dumps and printing."""

from __future__ import annotations

import io
import re

import pytest

from moecc.errors import PassError
from moecc.ir import Graph, Node
from moecc.ir.pass_infra import DumpIR, Pass, PassContext, PassManager, PassResult, PrintAfter
from moecc.passes import PASS_NAMES, default_pipeline

from tests.compiler.passes.util import context


def test_pipeline_names_match_files():
    import importlib

    assert [p.name for p in default_pipeline()] == list(PASS_NAMES)
    for p in default_pipeline():
        pkg = "moecc.codegen" if p.name == "emit_plan" else "moecc.passes"
        mod = importlib.import_module(f"{pkg}.{p.name}")
        assert type(p).__module__ == mod.__name__
        assert "Requires" in (mod.__doc__ or "") and "Guarantees" in (mod.__doc__ or "")


def test_missing_requirement_names_the_pass_and_what_ran():
    graph, ctx = context()
    passes = {p.name: p for p in default_pipeline()}
    with pytest.raises(PassError, match=r"pass insert_transfers: requires \['host_buffers'\].*ran before it: \['split_modules'\]"):
        PassManager([passes["split_modules"], passes["insert_transfers"]])(graph, ctx)


class _BreakGraph(Pass):
    """Adds a node reading an undefined value."""

    name = "break_graph"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        g = graph.copy()
        g.nodes.insert(3, Node("bad", "add", ["nowhere", "embed"], shape=("T", 16)))
        return PassResult(g, True)


class _Mutate(Pass):
    name = "mutate"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        graph.nodes[2].attrs["x"] = 1
        return PassResult(graph, True)


def test_verifier_names_the_pass_and_the_node():
    graph, ctx = context()
    with pytest.raises(PassError, match=r"(?s)pass break_graph: .*not well-formed.*%bad: input %nowhere"):
        PassManager([_BreakGraph()])(graph, ctx)


def test_a_pass_that_mutates_its_input_is_caught():
    graph, ctx = context()
    with pytest.raises(PassError, match="mutate: mutated its input graph"):
        PassManager([_Mutate()])(graph, ctx)


def test_dump_ir_writes_numbered_files_with_provenance(tmp_path):
    graph, ctx = context()
    dump = DumpIR(tmp_path)
    ctx.instruments.append(dump)
    PassManager(default_pipeline())(graph, ctx)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"{i + 1:03d}_{n}.txt" for i, n in enumerate(PASS_NAMES)]
    for path in tmp_path.iterdir():
        first = path.read_text().splitlines()[0]
        assert re.fullmatch(r"# \d{3} made by pass \w+ in \d+\.\d ms \((changed|unchanged)\)", first), first


def test_print_after_prints_only_the_named_pass():
    graph, ctx = context()
    out = io.StringIO()
    ctx.instruments.append(PrintAfter({"insert_transfers"}, out))
    PassManager(default_pipeline())(graph, ctx)
    text = out.getvalue()
    assert text.count("made by pass") == 1 and "made by pass insert_transfers" in text
    assert "fetch_experts" in text


def test_stop_after_runs_the_pipeline_through_the_named_pass():
    graph, ctx = context()
    out = PassManager(default_pipeline())(graph, ctx, stop_after="insert_transfers")
    assert "transfers" in out.properties and "batch_sizes" not in out.properties
    assert list(ctx.timings) == list(PASS_NAMES[:PASS_NAMES.index("insert_transfers") + 1])
    with pytest.raises(ValueError, match=r"stop_after: unknown pass 'nope'; passes: split_modules"):
        PassManager(default_pipeline())(graph, ctx, stop_after="nope")


def test_compile_graph_stops_after_a_pass_with_typed_options():
    from moecc.compiler import compile_graph
    from moecc.options import CompileOptions

    from tests.compiler.passes.util import DATA

    g = compile_graph(DATA / "tiny-mixtral", CompileOptions(max_batch=8), stop_after="solve_batch_sizes", verify=True)
    assert g.attrs["batch"]["decode"]["B"] <= 8 and "plan" not in g.attrs
