"""Dense weights laid out once for the host GEMM that runs them (oneDNN's reorder), on a CPU
run without an arena.

torch's `F.linear` hands an fp32 [T, in] x [out, in]^T product to MKL, which on this project's
AMD Zen 4 reaches 82-150 GFLOP/s at 16-1,024 rows; oneDNN over a weight reordered once into its
blocked layout for this CPU's ISA reaches 167-204 (bf16: 217-366 against 304-401). So a CPU
run packs every weight that only a GEMM reads, once at start-up, and runs those GEMMs through
oneDNN (`PackedLinear`); gate and up of a gated MLP (an expert's or a dense one) are stacked
into one [2I, H] packed weight, so an expert is two GEMMs (kernels.gated_mlp), and an attention's
q, k and v (without biases) into one [(Hq + 2 Hkv) D, H] weight, one GEMM (kernels.attention_qkv:
at a decode step's 512 rows, 2.1 ms against 4.2 for three GEMMs at hidden 768, the same bits).

What is packed (`packable`): dense weights in fp32 or bf16 compute whose every reader is a
GEMM: linear and lm_head weights, attention projections (q, k, v, o; MLA's q_a, q_b, kv_a,
never kv_b, which its absorption reads as a tensor), dense MLPs and the experts of gated MLPs
(never gpt-oss's clamped SwiGLU, which reads gate_up as [H, 2I]). Quantized formats keep
their dequantize next to the GEMM; routers, norms and embeddings are read as tensors.

The packed copy costs anonymous host memory equal to the weights' bytes (the mapped file's
pages become reclaimable page cache), so packing happens only when that fits in half of the
memory available at start-up and oneDNN runs the compute dtype here (`in_place_weights`);
MOECC_PACK=0 turns it off. bf16 results
are F.linear's bits at most shapes (torch's bf16 GEMM is oneDNN's too), not all: oneDNN picks its
kernel by the packed layout and the row count, and on an AMX Xeon a 768 x 768 weight at 512 rows
or a 1152 x 768 one at 1,024 rounds apart from F.linear; fp32 ones agree to ~1e-6 relative
(another summation order). Row counts are bucketed (`bucket_rows`): oneDNN JITs a
kernel per row count, which on an AMX Xeon cost more than the GEMMs it ran.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from moecc_runtime import formats
from moecc_runtime.contract.plan_types import Op, PlanView
from moecc_runtime.memory.pinned import available_bytes
from moecc_runtime.memory.streaming import InPlaceWeights
from moecc_runtime.memory.weights import WeightStore
from moecc_runtime.native import linear_amx

PACKED_DTYPES = (torch.float32, torch.bfloat16)
_ATTENTION_GEMMS = ("q", "k", "v", "o", "q_a", "q_b", "kv_a")  # read only by kernels.linear
_QKV = ("q", "k", "v")  # stacked into one GEMM where none has a bias (PackPlan.qkv)


def packing_available() -> bool:
    """oneDNN's packed linear is in this torch build (and MOECC_PACK is not 0)."""
    if os.environ.get("MOECC_PACK", "1") == "0":
        return False
    ops = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


def bucket_rows(m: int) -> int:
    """The row count a packed GEMM of `m` rows runs at: `m` rounded up to 16 (up to 256 rows),
    32 (to 1,024) or 64. oneDNN generates (JITs) a kernel for every new row count, and an
    expert's rows change every step: on an AMX Xeon, 96-160 varying rows ran at 632 GFLOP/s
    against 2,194 rounded to 16, 1,800-2,400 rows at 994 against 2,908 rounded to 32. The
    padding rows are zeros; each output row depends only on its own input row."""
    step = 16 if m <= 256 else 32 if m <= 1024 else 64
    return -(-m // step) * step


class PackedLinear:
    """A dense [out, in] weight in oneDNN's blocked layout; `self(x, bias)` = F.linear(x, w, bias),
    in bf16 without a bias on the AMX projection kernel where it runs (native/linear_amx.py, over
    these bytes), else oneDNN's GEMM.
    A stacked weight (gate and up, or q, k and v, one after another by rows) has `sections`,
    the row counts of its parts, and `split`, where the first ends (gate rows [0, split));
    both None otherwise."""

    __slots__ = ("packed", "out_features", "in_features", "dtype", "split", "sections", "rows_hint")

    def __init__(self, w: torch.Tensor, rows_hint: int, split: int | None = None,
                 sections: tuple[int, ...] | None = None):
        """needs: w [out, in], fp32 or bf16, on the CPU. Copies it (the packed layout is oneDNN's)."""
        self.out_features, self.in_features = int(w.shape[0]), int(w.shape[1])
        self.dtype = w.dtype
        self.split = split
        self.sections = sections
        self.rows_hint = max(1, int(rows_hint))  # oneDNN's layout depends on it (native/expert_amx.py reads it)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), self.rows_hint)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [..., in] -> [..., out]; rows padded with zeros up to `bucket_rows` (see there)
        if bias is None and self.dtype == torch.bfloat16:
            y = linear_amx.linear(x, self)  # AMX tiles over these bytes where they run (None: not here)
            if y is not None:
                return y
        m = x.numel() // self.in_features if self.in_features else 0
        if bucket_rows(m) == m:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        padded = self.input_rows(m, x)  # [rows, in]
        padded[:m] = x.reshape(m, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(padded, self.packed, bias, "none", [], "")  # [rows, out]
        return y[:m].view(*x.shape[:-1], self.out_features)

    def input_rows(self, m: int, like: torch.Tensor) -> torch.Tensor:
        """An input for `m` rows as this GEMM runs it: [bucket_rows(m), in] of `like`'s dtype and
        device, the rows past `m` zero; the caller writes rows [0, m) (kernels.experts gathers
        straight into them), and the GEMM takes it without a padded copy."""
        buf = like.new_empty((bucket_rows(m), self.in_features))  # [rows, in]
        buf[m:].zero_()
        return buf

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize


@dataclass
class PackPlan:
    """Which weight keys a run packs: `single` alone, `stacked` (gate key, up key) pairs,
    `qkv` (q key, k key, v key) triples."""

    single: list[str] = field(default_factory=list)
    stacked: list[tuple[str, str]] = field(default_factory=list)
    qkv: list[tuple[str, str, str]] = field(default_factory=list)

    def keys(self) -> list[str]:
        return self.single + [k for group in self.stacked + self.qkv for k in group]


def packable(plan: PlanView, store: WeightStore) -> PackPlan:
    """The weights of `plan` that only a GEMM reads and that are dense in a packed dtype."""
    out = PackPlan()

    def dense(key: str) -> bool:
        entry = store.manifest.get(key)
        return (entry is not None and formats.is_dense(entry) and len(entry["shape"]) == 2
                and key not in store.keep and store.compute_dtype in PACKED_DTYPES)

    def gated(gate: str, up: str, down: str) -> None:
        if dense(gate) and dense(up) and store.manifest[gate]["shape"] == store.manifest[up]["shape"]:
            out.stacked.append((gate, up))
        if dense(down):
            out.single.append(down)

    for m in plan.schedule:
        for op in m.ops:
            _add_op(op, dense, gated, out)
    return out


def _add_op(op: Op, dense, gated, out: PackPlan) -> None:
    """The packable weights of one op into `out`."""
    w, a = op.weights, op.attrs
    if op.op in ("linear", "lm_head") and dense(w["weight"]):
        out.single.append(w["weight"])
    elif op.op == "attention":
        qkv = all(k in w and dense(w[k]) for k in _QKV) and not any(f"{k}_bias" in w for k in _QKV)
        if qkv:
            out.qkv.append((w["q"], w["k"], w["v"]))
        out.single.extend(w[k] for k in _ATTENTION_GEMMS if k in w and dense(w[k]) and not (qkv and k in _QKV))
    elif op.op == "mlp":
        gated(w["gate"], w["up"], w["down"])
    elif op.op == "experts" and a.get("act") != "clamped_swiglu":
        for e in range(int(a["num_experts"])):
            if f"e{e}.gate" in w:
                gated(w[f"e{e}.gate"], w[f"e{e}.up"], w[f"e{e}.down"])


class PackedInPlaceWeights(InPlaceWeights):
    """InPlaceWeights with the GEMM-only weights packed (`pack`): `get` (and so an expert's
    weights) returns a PackedLinear for them, and None for an `up` stacked under its gate:
    (gate+up, None, down) for a stacked expert; likewise None for k and v stacked under q."""

    def __init__(self, store: WeightStore, plan: PlanView, pack: PackPlan, rows_hint: int):
        super().__init__(store, plan)
        self._packed: dict[str, PackedLinear | None] = {}
        for key in pack.single:
            self._packed[key] = PackedLinear(store.get(key), rows_hint)
            store.drop(key)
        for keys in pack.stacked + pack.qkv:  # (gate, up) [I, H] each; (q, k, v) [Hq*D, H], [Hkv*D, H] x2
            ws = [store.get(k) for k in keys]
            sections = tuple(int(t.shape[0]) for t in ws)
            self._packed[keys[0]] = PackedLinear(torch.cat(ws, dim=0), rows_hint, split=sections[0], sections=sections)
            self._packed.update(dict.fromkeys(keys[1:]))  # read through the first key's stacked weight
            for k in keys:
                store.drop(k)
        self.packed_bytes = sum(p.nbytes for p in self._packed.values() if p is not None)

    def get(self, key: str):  # type: ignore[override]
        if key in self._packed:
            return self._packed[key]
        return super().get(key)

    def _expert_weight(self, key: str):  # type: ignore[override]
        if key in self._packed:
            return self._packed[key]
        return super()._expert_weight(key)


def _dtype_works(dtype: torch.dtype | None) -> bool:
    """oneDNN packs and runs a GEMM in `dtype` on this CPU (bf16 needs its bf16 support: an
    AVX2-only CPU has none); checked on a tiny weight."""
    if dtype not in PACKED_DTYPES:
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        w = torch.ones(4, 8, dtype=dtype)
        y = PackedLinear(w, 2)(torch.ones(2, 8, dtype=dtype))
        return bool((y == 8).all())
    except RuntimeError:
        return False


def in_place_weights(store: WeightStore, plan: PlanView, rows_hint: int) -> InPlaceWeights:
    """The in-place weights policy of a run without an arena: packed on a CPU where oneDNN is
    built and runs the compute dtype, the weights are in a packed dtype and their copy fits in
    half the available memory; plain InPlaceWeights otherwise."""
    if store.device.type != "cpu" or not packing_available() or not _dtype_works(store.compute_dtype):
        return InPlaceWeights(store, plan)
    pack = packable(plan, store)
    need = sum(_entry_bytes(store, k) for k in pack.keys())
    free = available_bytes()
    if not need or (free is not None and need > free // 2):
        return InPlaceWeights(store, plan)
    return PackedInPlaceWeights(store, plan, pack, rows_hint)


def _entry_bytes(store: WeightStore, key: str) -> int:
    """Bytes of weight `key` in the compute dtype (what its packed copy takes)."""
    return math.prod(int(d) for d in store.manifest[key]["shape"]) * store.compute_dtype.itemsize
