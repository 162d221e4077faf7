"""Pass infrastructure: the Pass interface, PassResult, PassContext with instruments, and
the PassManager that runs a flat pipeline (all of it, or through a named pass:
`stop_after`), checks each pass's requirements and guarantees, and runs the verifier after
every pass when asked (always in tests). Options are typed: `moecc.options.CompileOptions`.

Modelled on torch.fx's PassBase (requires -> call -> ensures) and TVM's PassContext with
instruments (PrintAfter, DumpIR): printing and dumping are instruments, never prints in
passes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol, Sequence, TextIO

from moecc.errors import MoeccError, PassError
from moecc.ir.graph import Graph
from moecc.ir.printer import format_graph
from moecc.options import CompileOptions


@dataclass
class PassResult:
    graph: Graph
    modified: bool


class Pass:
    """One graph rewrite. Subclasses set `name` (= their module's file name), `requires`
    (graph properties that must hold before) and `ensures` (properties that hold after),
    and implement `run(graph, ctx) -> PassResult`. A pass must not mutate its input graph:
    it works on `graph.copy()` and returns that."""

    name: ClassVar[str] = "pass"
    requires: ClassVar[frozenset[str]] = frozenset()
    ensures: ClassVar[frozenset[str]] = frozenset()

    def run(self, graph: Graph, ctx: "PassContext") -> PassResult:  # pragma: no cover
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<pass {self.name}>"


class Instrument(Protocol):
    def after_pass(self, index: int, p: Pass, result: PassResult, seconds: float) -> None: ...


def provenance(index: int, p: Pass, result: PassResult, seconds: float) -> str:
    """The first line of every dump: which pass, how long, whether it changed anything."""
    changed = "changed" if result.modified else "unchanged"
    return f"# {index:03d} made by pass {p.name} in {seconds * 1e3:.1f} ms ({changed})"


@dataclass
class DumpIR:
    """Write the graph after every pass to DIR/NNN_<pass>.txt and, with "onnx" in
    `formats`, DIR/NNN_<pass>.onnx (moecc/views/onnx_export.py; the provenance line goes into
    the model's doc string), with "svg", DIR/NNN_<pass>.svg (moecc/views/graph_svg.py; the
    provenance line is its heading)."""

    directory: Path
    written: list[Path] = field(default_factory=list)
    formats: tuple[str, ...] = ("txt",)

    def after_pass(self, index: int, p: Pass, result: PassResult, seconds: float) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        head = provenance(index, p, result, seconds)
        if "txt" in self.formats:
            path = self.directory / f"{index:03d}_{p.name}.txt"
            path.write_text(head + "\n" + format_graph(result.graph, weights=(index == 0)))
            self.written.append(path)
        if "onnx" in self.formats:
            from moecc.views.onnx_export import graph_to_onnx

            model = graph_to_onnx(result.graph, name=f"{index:03d}_{p.name}")
            model.doc_string = head
            path = self.directory / f"{index:03d}_{p.name}.onnx"
            path.write_bytes(model.SerializeToString())
            self.written.append(path)
        if "svg" in self.formats:
            from moecc.views.graph_svg import graph_to_svg

            path = self.directory / f"{index:03d}_{p.name}.svg"
            path.write_text(graph_to_svg(result.graph, heading=head.lstrip("# ")), encoding="utf-8")
            self.written.append(path)


@dataclass
class PrintAfter:
    """Print the graph after the named passes (or after all: names = {"all"})."""

    names: set[str]
    stream: TextIO | None = None

    def after_pass(self, index: int, p: Pass, result: PassResult, seconds: float) -> None:
        if "all" in self.names or p.name in self.names:
            import sys

            out = self.stream or sys.stdout
            out.write(provenance(index, p, result, seconds) + "\n" + format_graph(result.graph) + "\n")


@dataclass
class PassContext:
    """Options every pass may read, the instruments to run, and whether to verify."""

    options: CompileOptions = field(default_factory=CompileOptions)
    instruments: list[Instrument] = field(default_factory=list)
    verify: bool = False
    timings: dict[str, float] = field(default_factory=dict)


class PassManager:
    """Run passes in order; index 0 is reserved for the frontend's graph ("trace")."""

    def __init__(self, passes: Sequence[Pass]):
        self.passes = list(passes)
        names = [p.name for p in self.passes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate pass names in pipeline: {names}")

    def __call__(self, graph: Graph, ctx: PassContext, *, first_index: int = 1,
                 stop_after: str | None = None) -> Graph:
        """Run the pipeline (through the pass named `stop_after`, when given) on `graph`;
        return the last pass's graph."""
        names = [p.name for p in self.passes]
        if stop_after is not None and stop_after not in names:
            raise ValueError(f"stop_after: unknown pass {stop_after!r}; passes: {', '.join(names)}")
        done: list[str] = []
        for offset, p in enumerate(self.passes):
            graph = self._run_one(p, graph, ctx, first_index + offset, done)
            done.append(p.name)
            if p.name == stop_after:
                break
        return graph

    def _run_one(self, p: Pass, graph: Graph, ctx: PassContext, index: int, done: list[str]) -> Graph:
        """One pass: check what it requires, run it, record what it ensures, verify, instrument."""
        from moecc.ir.verify import verify_graph

        missing = p.requires - graph.properties
        if missing:
            raise PassError(
                p.name,
                f"requires {sorted(missing)}, which no earlier pass established "
                f"(ran before it: {done or ['trace']}); add the pass that ensures them "
                f"earlier in the pipeline",
            )
        start = time.perf_counter()
        try:
            result = p.run(graph, ctx)
        except PassError:
            raise
        except MoeccError as e:  # a user-facing error: keep its message, name the pass
            raise PassError(p.name, str(e)) from e
        except Exception as e:  # name the pass, keep the cause
            raise PassError(p.name, f"{type(e).__name__}: {e}") from e
        seconds = time.perf_counter() - start
        if result.graph is graph and result.modified:
            raise PassError(p.name, "mutated its input graph; passes must work on graph.copy()")
        result.graph.properties |= set(p.ensures)
        if ctx.verify:
            problems = verify_graph(result.graph)
            if problems:
                raise PassError(
                    p.name,
                    "the graph it produced is not well-formed (passes before it: "
                    f"{done or ['trace']}):\n  " + "\n  ".join(problems),
                )
        ctx.timings[p.name] = seconds
        for inst in ctx.instruments:
            inst.after_pass(index, p, result, seconds)
        return result.graph


class _TracePass(Pass):
    """Stand-in used to dump the frontend's graph as 000_trace.txt."""

    name = "trace"


def record_trace(graph: Graph, ctx: PassContext, seconds: float) -> None:
    """Let instruments see the frontend's graph as step 000."""
    for inst in ctx.instruments:
        inst.after_pass(0, _TracePass(), PassResult(graph, True), seconds)
