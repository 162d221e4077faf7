"""quantize_weights: weight-only int8 / int4 of the selected Linear weights (`--quantize`).

Requires: modules_split.
Does: with `options.quantize` set, every weight moecc/quantize/select.py picks (the routed
experts' matrices; with scope "all" also attention and dense / shared-expert MLP matrices)
becomes a WeightRef of format int8_channel or int4_group whose parts are tensors of the
plan's sidecar, PLAN + ".weights.safetensors" (moecc_runtime.plan.sidecar_path of
`options.plan_path`). The tensors are quantized one by one from the memory-mapped
checkpoint and written to `<sidecar>.<pid>.partial` (moecc/quantize/writer.py); the
compiler renames it to the sidecar once the plan is made (compiler._commit_sidecar), so a
failed compile leaves an earlier plan's sidecar as it was. A config-only checkpoint gets the
refs (the planner sizes the stored bytes) and no file. Without `options.quantize`: nothing.
Guarantees: the planner, which runs after, sees stored bytes (WeightRef.nbytes);
graph.attrs["quantized"]: the options, the sidecar's final and partial paths, its size and
header hash; the checkpoint is only read (mmap ACCESS_READ). No graph property: one would
show in every later pass's golden dump, and no pass requires it yet.
Options: quantize, quantize_group_size, quantize_scope, quantize_symmetric, plan_path, log.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from moecc_runtime.plan import sidecar_path

from moecc.errors import PassError
from moecc.frontend.checkpoint import Checkpoint
from moecc.ir import Graph, WeightRef
from moecc.ir.pass_infra import Pass, PassContext, PassResult
from moecc.quantize import QuantizeError, QuantizeSpec, quantize_spec
from moecc.quantize.select import Target, refuse_quantized, targets
from moecc.quantize.source import CheckpointReader
from moecc.quantize.writer import Layout, SidecarWriter, partial_path

#: a progress line each time another this share of the bytes is done, once this many seconds
#: have passed (a small model gets the last line only)
PROGRESS_STEP, PROGRESS_AFTER = 0.05, 2.0


class QuantizeWeights(Pass):
    name = "quantize_weights"
    requires = frozenset({"modules_split"})
    ensures: frozenset[str] = frozenset()

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        o = ctx.options
        spec = quantize_spec(o.quantize, o.quantize_group_size, o.quantize_scope, o.quantize_symmetric)
        if spec is None:
            return PassResult(graph, modified=False)
        ckpt = o.checkpoint
        if ckpt is None:
            raise PassError(self.name, "ctx.options.checkpoint is not set (the frontend's Checkpoint)")
        g = graph.copy()
        picked = targets(g, spec)
        refuse_quantized(ckpt, picked, spec)
        refs = {t.ref: _quantized_ref(t, spec) for t in picked}  # one per slice, however many nodes read it
        record: dict[str, Any] = {**spec.attrs(), "tensors": len(refs)}
        if ckpt.has_weights:
            record.update(_write_sidecar(ckpt, refs, spec, o.plan_path, o.log))
        nodes = g.by_name()
        for t in picked:
            nodes[t.node].weights[t.local] = refs[t.ref]
        g.attrs["quantized"] = record
        return PassResult(g, modified=True)


def _quantized_ref(t: Target, spec: QuantizeSpec) -> WeightRef:
    """The stored-format ref of target `t`: its parts named after the slice in the sidecar."""
    R, C = t.ref.shape[::-1] if t.transpose else t.ref.shape  # as stored: [out, in]
    base = t.ref.describe()
    layout = spec.format.stored_layout((R, C), spec.group_size, spec.symmetric)
    parts = tuple((part, WeightRef(f"{base}:{part}", shape, dtype)) for part, (dtype, shape) in layout.items())
    attrs: dict[str, Any] = {"group": spec.group_size} if spec.scheme == "int4" else {}
    if t.transpose:
        attrs["transpose"] = True
    return WeightRef(parts[0][1].tensor, t.ref.shape, parts[0][1].dtype, format=spec.format.NAME, parts=parts,
                     attrs=tuple(attrs.items()))


def _write_sidecar(ckpt: Checkpoint, refs: dict[WeightRef, WeightRef], spec: QuantizeSpec,
                   plan_path: str | None, log: Callable[[str], None] | None) -> dict[str, Any]:
    """Quantize every ref's slice and write the sidecar's partial file; what the plan records."""
    final = _destination(ckpt, plan_path, spec)
    partial = partial_path(final)
    layout: Layout = {p.tensor: (p.dtype, p.shape) for q in refs.values() for _, p in q.parts}
    fp = ckpt.fingerprint()
    meta = {"format": "moecc.quantized_weights", "source_config_sha256": fp["config_sha256"],
            "source_headers": ",".join(f"{f}={h}" for f, h in sorted(fp["weight_headers"].items())),
            **{k: str(v) for k, v in spec.attrs().items()}}
    try:
        writer = SidecarWriter(partial, layout, meta, sources=[src.tensor for src in refs])
    except OSError as e:
        raise QuantizeError(f"{partial}: cannot write the quantized weights: {e.strerror or e}") from e
    reader = CheckpointReader(ckpt)
    try:
        _quantize_all(reader, writer, refs, spec, final, log)
        size, header = writer.finish(reader.digests)
    except BaseException as e:
        writer.abort()
        if isinstance(e, OSError):
            raise QuantizeError(f"{partial}: writing the quantized weights failed: {e.strerror or e}") from e
        raise
    finally:
        reader.close()
    return {"path": str(final), "partial": str(partial), "file": final.name, "size": size,
            "header_sha256": header.sha256, "source_bytes": reader.bytes_read}


def _quantize_all(reader: CheckpointReader, writer: SidecarWriter, refs: dict[WeightRef, WeightRef],
                  spec: QuantizeSpec, final: Path, log: Callable[[str], None] | None) -> None:
    """Each slice read, quantized and written in turn (one in memory at a time); progress
    lines on `log` (every PROGRESS_STEP of the bytes read, with the time left; the last one)."""
    kwargs = {"group": spec.group_size, "symmetric": spec.symmetric} if spec.scheme == "int4" else {}
    start, total, done, shown = time.perf_counter(), sum(src.nbytes for src in refs), 0, 0.0
    for i, (src, q) in enumerate(refs.items(), 1):
        w = reader.read(src)  # [shape] fp32
        stored = spec.format.quantize(w.t() if dict(q.attrs).get("transpose") else w, **kwargs)
        for part, p in q.parts:
            writer.write(p.tensor, stored[part])
        del w, stored
        done += src.nbytes
        took = time.perf_counter() - start
        last = i == len(refs)
        if log is not None and (last or (done / total >= shown + PROGRESS_STEP and took >= PROGRESS_AFTER)):
            shown = done / total
            log(f"quantize {spec.scheme}: {i}/{len(refs)} weights, {_progress(done, total, took, last)} "
                f"-> {final.name}")


def _progress(done: int, total: int, took: float, last: bool) -> str:
    """"3.0 of 10.0 MiB (30%), 1.2s, about 2.8s left"."""
    share = done / total
    left = "" if last else f", about {took / share - took:.0f}s left"
    return f"{done / 2**20:.1f} of {total / 2**20:.1f} MiB ({share:.0%}), {took:.1f}s{left}"


def _destination(ckpt: Checkpoint, plan_path: str | None, spec: QuantizeSpec) -> Path:
    """The sidecar of the plan at `plan_path`; refused when there is no plan path, its
    directory is missing, or it is the checkpoint's (a safetensors file there would join the
    checkpoint at the next compile, and the checkpoint is never written)."""
    if plan_path is None:
        raise QuantizeError(f"--quantize {spec.scheme}: the quantized weights are written beside the plan, "
                            f"but no plan path was given (compile_model(..., output=PLAN) / moecc compile -o PLAN)")
    final = sidecar_path(plan_path)
    parent = final.parent.resolve()
    if not parent.is_dir():
        raise QuantizeError(f"-o {plan_path}: directory {final.parent} does not exist; create it or write the "
                            f"plan elsewhere")
    if parent == Path(ckpt.directory).resolve():
        raise QuantizeError(f"-o {plan_path}: with --quantize the plan cannot be written inside the checkpoint "
                            f"directory {ckpt.directory} (its quantized weights file, {final.name}, would become "
                            f"part of the checkpoint); write the plan elsewhere")
    return final
