"""Which weights --quantize replaces, and the refusal of checkpoints that are quantized already.

Needs: the traced graph (op and weights of every node). Does: picks the 2-D matrices of
experts nodes (scope "experts"), and with scope "all" those of attention and mlp nodes too.
Guarantees: never an embedding, norm, bias, sink, router, gate (`linear` op) or lm_head;
each picked weight with whether ops read it as x @ W (`transpose`: the format stores it as
[out, in] either way).
"""

from __future__ import annotations

from dataclasses import dataclass

from moecc.frontend.checkpoint import Checkpoint
from moecc.ir import Graph, WeightRef
from moecc.quantize import QuantizeError, QuantizeSpec

#: ops whose matrices each scope quantizes
SCOPE_OPS: dict[str, frozenset[str]] = {"experts": frozenset({"experts"}),
                                        "all": frozenset({"experts", "attention", "mlp"})}
#: the dtypes --quantize reads
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Target:
    """One weight to quantize: where it is in the graph and how ops read it."""

    node: str
    local: str
    ref: WeightRef
    transpose: bool  # ops compute x @ W with W [in, out] (gpt-oss's experts)


def targets(graph: Graph, spec: QuantizeSpec) -> list[Target]:
    """The weights `spec.scope` quantizes, in graph order."""
    ops = SCOPE_OPS[spec.scope]
    out = []
    for n in graph.nodes:
        if n.op not in ops:
            continue
        transpose = n.op == "experts" and n.attrs.get("act") == "clamped_swiglu"  # gpt-oss: x @ gate_up
        for local, ref in n.weights.items():
            if len(ref.shape) == 2 and not _is_norm(local):
                out.append(Target(n.name, local, ref, transpose))
    return out


def _is_norm(local: str) -> bool:
    """A norm's weight held by an attention node (MLA's q_a_norm, kv_a_norm; q_norm, k_norm)."""
    return local.endswith("norm")


def refuse_quantized(ckpt: Checkpoint, picked: list[Target], spec: QuantizeSpec) -> None:
    """QuantizeError when the checkpoint is quantized already (a quantization_config, or a
    picked weight stored in another format or a non-float dtype)."""
    where = f"--quantize {spec.scheme}: {ckpt.directory}"
    qc = ckpt.config.get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise QuantizeError(f"{where}/config.json has a quantization_config (quant_method {method!r}): the "
                            f"checkpoint is quantized already. --quantize reads bf16, fp16 or fp32 checkpoints; "
                            f"compile this one without --quantize")
    for t in picked:
        if t.ref.format != "dense" or t.ref.dtype not in FLOAT_DTYPES:
            stored = t.ref.format if t.ref.format != "dense" else t.ref.dtype
            raise QuantizeError(f"{where}: tensor {t.ref.tensor} is stored as {stored}, not a float dtype "
                                f"({', '.join(FLOAT_DTYPES)}): the checkpoint is quantized already; compile "
                                f"it without --quantize")
