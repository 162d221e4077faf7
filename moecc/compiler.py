"""`moecc compile`: frontend, then the pass pipeline, then the plan."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from moecc.frontend.trace import build_graph
from moecc.ir import Graph
from moecc.pass_infra import DumpIR, PassContext, PassManager, PrintAfter, record_trace
from moecc.passes import PASS_NAMES, default_pipeline


def compile_model(
    model_dir: str | os.PathLike,
    *,
    gpu_mem: int | None = None,
    host_mem: int | None = None,
    prompt_tokens: int = 512,
    output_tokens: int = 256,
    max_batch: int = 1024,
    hardware: str | os.PathLike | None = None,
    dump_dir: str | os.PathLike | None = None,
    dump_formats: tuple[str, ...] = ("txt",),
    print_after: set[str] | None = None,
    verify: bool | None = None,
) -> tuple[dict[str, Any], Graph]:
    """Compile the checkpoint at `model_dir`; return (plan, final graph).

    verify=None reads MOECC_VERIFY (the test suite sets it to 1, so every compile in tests
    checks the graph after every pass)."""
    if verify is None:
        verify = os.environ.get("MOECC_VERIFY", "") not in ("", "0")
    if print_after:
        unknown = set(print_after) - set(PASS_NAMES) - {"all", "trace"}
        if unknown:
            raise ValueError(f"--print-after: unknown pass {sorted(unknown)}; passes: trace, "
                             f"{', '.join(PASS_NAMES)}, or all")
    instruments: list[Any] = []
    if dump_dir is not None:
        bad = set(dump_formats) - {"txt", "onnx", "svg"}
        if bad:
            raise ValueError(f"--dump-format: unknown format {sorted(bad)}; formats: txt, onnx, svg")
        instruments.append(DumpIR(Path(dump_dir), formats=tuple(dump_formats)))
    if print_after:
        instruments.append(PrintAfter(set(print_after)))
    start = time.perf_counter()
    graph, ckpt = build_graph(model_dir)
    ctx = PassContext(
        options={"gpu_mem": gpu_mem, "host_mem": host_mem, "prompt_tokens": prompt_tokens,
                 "output_tokens": output_tokens, "max_batch": max_batch, "checkpoint": ckpt,
                 "hardware": None if hardware is None else str(hardware)},
        instruments=instruments,
        verify=verify,
    )
    if verify:
        from moecc.errors import FrontendError
        from moecc.verify import verify_graph

        problems = verify_graph(graph)
        if problems:
            raise FrontendError(None, "graph", "traced graph is not well-formed:\n  " + "\n  ".join(problems))
    record_trace(graph, ctx, time.perf_counter() - start)
    final = PassManager(default_pipeline())(graph, ctx)
    return final.attrs["plan"], final
