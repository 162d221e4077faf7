"""`moecc compile`: frontend, then the pass pipeline, then the plan."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Callable

from moecc_runtime.plan import sidecar_path

from moecc.frontend.build import build_graph
from moecc.frontend.dtype_choice import check_dtype
from moecc.ir import Graph
from moecc.ir.pass_infra import DumpIR, Instrument, PassContext, PassManager, PrintAfter, record_trace
from moecc.options import CompileOptions
from moecc.passes import PASS_NAMES, default_pipeline
from moecc.quantize import quantize_spec
from moecc.quantize.writer import partial_path


def compile_model(
    model_dir: str | os.PathLike,
    *,
    gpu_mem: int | None = None,
    host_mem: int | None = None,
    host_reserve: int | None = None,
    device_reserve: int | None = None,
    prompt_tokens: int = 512,
    output_tokens: int = 256,
    shared_prefix: float = 0.0,
    max_batch: int = 1024,
    hardware: str | os.PathLike | None = None,
    dump_dir: str | os.PathLike | None = None,
    dump_formats: tuple[str, ...] = ("txt",),
    print_after: set[str] | None = None,
    verify: bool | None = None,
    quantize: str | None = None,
    quantize_group_size: int = 128,
    quantize_scope: str = "experts",
    quantize_symmetric: bool = False,
    output: str | os.PathLike | None = None,
    log: Callable[[str], None] | None = None,
    attention: str = "auto",
    dtype: str = "auto",
) -> tuple[dict[str, Any], Graph]:
    """Compile the checkpoint at `model_dir`; return (plan, final graph).

    `quantize` ("int8", "int4"; see moecc/quantize/) needs `output`, the path the plan will
    be saved at (save_plan(plan, output)): the quantized weights are written beside it, as
    `output` + ".weights.safetensors", the file the runtime reads for a plan at `output`.
    verify=None reads MOECC_VERIFY (the test suite sets it to 1, so every compile in tests
    checks the graph after every pass). `attention`: auto, host or device (--attention).
    `device_reserve`: device bytes kept out of `gpu_mem` (None: the hardware profile's).
    `shared_prefix`: the share of prompt tokens computed once by prefix sharing (what
    `moecc compile --prompts` measures; moecc/planner/shared_prefix.py). `dtype`: the compute
    dtype (--dtype: auto, fastest, bfloat16, float16, float32; moecc/frontend/dtype_choice.py)."""
    options = CompileOptions(gpu_mem=gpu_mem, host_mem=host_mem, host_reserve=host_reserve,
                             device_reserve=device_reserve, prompt_tokens=prompt_tokens,
                             output_tokens=output_tokens, shared_prefix=float(shared_prefix), max_batch=max_batch,
                             hardware=None if hardware is None else str(hardware), quantize=quantize,
                             quantize_group_size=quantize_group_size, quantize_scope=quantize_scope,
                             quantize_symmetric=quantize_symmetric,
                             plan_path=None if output is None else str(output), log=log, attention=attention,
                             dtype=dtype)
    final = compile_graph(model_dir, options, instruments=instruments_for(dump_dir, dump_formats, print_after),
                          verify=verify)
    return final.attrs["plan"], final


def compile_graph(model_dir: str | os.PathLike, options: CompileOptions = CompileOptions(), *,
                  stop_after: str | None = None, instruments: list[Instrument] | None = None,
                  verify: bool | None = None) -> Graph:
    """The frontend's graph of `model_dir` through the default pipeline, or through the pass
    named `stop_after` (TVM/Triton style: e.g. "insert_transfers" for the graph the planner
    reads). `options.checkpoint` is set from the frontend. verify=None reads MOECC_VERIFY.
    With `options.quantize`, the sidecar is in place beside `options.plan_path` once the
    plan is made (a compile that fails or stops before emit_plan leaves none, and an earlier
    one there untouched)."""
    quantize_spec(options.quantize, options.quantize_group_size, options.quantize_scope)  # refuse early
    check_attention(options.attention)
    check_dtype(options.dtype)
    if verify is None:
        verify = os.environ.get("MOECC_VERIFY", "") not in ("", "0")
    start = time.perf_counter()
    graph, ckpt = build_graph(model_dir, options.dtype, options.hardware)
    ctx = PassContext(options=dataclasses.replace(options, checkpoint=ckpt), instruments=list(instruments or []),
                      verify=verify)
    if verify:
        from moecc.errors import FrontendError
        from moecc.ir.verify import verify_graph

        problems = verify_graph(graph)
        if problems:
            raise FrontendError(None, "graph", "traced graph is not well-formed:\n  " + "\n  ".join(problems))
    record_trace(graph, ctx, time.perf_counter() - start)
    try:
        final = PassManager(default_pipeline())(graph, ctx, stop_after=stop_after)
    except BaseException:
        _discard_partial(options.plan_path)
        raise
    _commit_sidecar(final, options.plan_path)
    return final


def check_attention(attention: str) -> None:
    """Refuse an --attention value the planner does not know, naming the option."""
    from moecc.planner.solve import ATTENTION_CHOICES

    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"--attention must be one of {', '.join(ATTENTION_CHOICES)}, not {attention!r}")


def _commit_sidecar(final: Graph, plan_path: str | None) -> None:
    """The quantized weights' partial file becomes the plan's sidecar once there is a plan."""
    q = final.attrs.get("quantized") or {}
    if "partial" in q and "plan" in final.properties:
        os.replace(q["partial"], q["path"])
    else:
        _discard_partial(plan_path)


def _discard_partial(plan_path: str | None) -> None:
    if plan_path is not None:
        partial_path(sidecar_path(plan_path)).unlink(missing_ok=True)


def instruments_for(dump_dir: str | os.PathLike | None, dump_formats: tuple[str, ...],
                    print_after: set[str] | None) -> list[Instrument]:
    """The --dump-dir and --print-after instruments; ValueError naming an unknown pass or format."""
    if print_after:
        unknown = set(print_after) - set(PASS_NAMES) - {"all", "trace"}
        if unknown:
            raise ValueError(f"--print-after: unknown pass {sorted(unknown)}; passes: trace, "
                             f"{', '.join(PASS_NAMES)}, or all")
    instruments: list[Instrument] = []
    if dump_dir is not None:
        bad = set(dump_formats) - {"txt", "onnx", "svg"}
        if bad:
            raise ValueError(f"--dump-format: unknown format {sorted(bad)}; formats: txt, onnx, svg")
        instruments.append(DumpIR(Path(dump_dir), formats=tuple(dump_formats)))
    if print_after:
        instruments.append(PrintAfter(set(print_after)))
    return instruments
