"""Map the parameters of transformers' module tree to checkpoint tensor names.

Checkpoints store experts either fused (transformers 5's own layout: `...experts.gate_up_proj`
[E, 2I, H] and `...experts.down_proj` [E, H, I]) or one by one as published (Mixtral:
`...block_sparse_moe.experts.{e}.w1/w3/w2.weight`; Qwen: `...mlp.experts.{e}.gate/up/down_proj.weight`).
Both become per-expert WeightRefs (a dim-0 index and a row range into the fused tensor, or a
whole per-expert tensor), so the runtime never builds a merged copy.

Quantized checkpoints (config.json's quantization_config, read by config.quantization):
a Linear weight stored as fine-grained FP8 (`X.weight` float8_e4m3fn [R, C] with its
`X.weight_scale_inv` [ceil(R/bR), ceil(C/bC)], fp32 or bf16; fused experts:
`experts.gate_up_proj` [E, 2I, H] with `experts.gate_up_proj_scale_inv`) becomes one
WeightRef of format "fp8_block" whose parts are the data slice and the scale rows its
blocks fall in (runtime/formats/fp8_block.py materializes it). Tensors the release keeps
in bf16 (embeddings, norms, routers, lm_head) stay dense. A config-only compile makes the
same refs from the config (data of the logical shape, fp32 scales).

gpt-oss as published in MXFP4 (quant_method mxfp4): each experts module stores
`gate_up_proj_blocks` uint8 [E, 2I, H/32, 16] with `gate_up_proj_scales` uint8 [E, 2I, H/32]
and `down_proj_blocks` [E, H, I/32, 16] with `down_proj_scales` [E, H, I/32] (rows are the
module's outputs: transformers dequantizes them to [E, 2I, H] and [E, H, I] and transposes
to its parameters' [E, H, 2I] and [E, I, H]); biases and everything else stay bf16. Each
expert's weight becomes one "mxfp4" WeightRef (runtime/formats/mxfp4.py) of logical shape
gate_up [H, 2I] / down [I, H], parts data = blocks[e], scale = scales[e], attrs transpose.
A config-only compile makes the same refs from the config.

GPTQ, AWQ, compressed-tensors and ModelOpt NVFP4 releases (a Quantization with `schemes`)
store each Linear by its own tensor names (`X.qweight`, `X.weight_packed`, ...):
moecc/frontend/quant_linear.py finds and checks them; their experts are per-expert Linears.

Legend: R, C = rows and columns of a weight; bR, bC = the scale block; E = experts;
I = expert intermediate size; H = hidden size; G = groups of 32 along a stored row.
"""

from __future__ import annotations

from moecc.errors import CheckpointError, UnsupportedModelError
from moecc.frontend import quant_linear
from moecc.frontend.checkpoint import Checkpoint
from moecc.frontend.families import family
from moecc.frontend.quantization import Quantization
from moecc.ir import WeightRef

# per-expert tensor names: (gate, up, down)
_PER_EXPERT_NAMES = [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")]
_FLOAT8 = ("float8_e4m3fn", "float8_e5m2")
_SCALE_DTYPES = ("float32", "bfloat16")
_SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv; experts.gate_up_proj -> ..._scale_inv
_MX_GROUP, _MX_BYTES = 32, 16  # MXFP4: values per scale group, bytes per group (two E2M1 a byte)
_MX_PARTS = ("gate_up", "down")  # the gpt-oss expert weights an MXFP4 release quantizes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_rows(r0: int, r1: int, b_r: int, base: int = 0, first: int = 0) -> tuple[tuple[int, int], int]:
    """needs: data rows [r0, r1) of a matrix blocked by `b_r` rows from row `base`, whose
    first block is scale row `first`. guarantees: (the scale rows [a, b) those rows' blocks
    are, row0: the offset of row r0 into its block)."""
    lo, hi = r0 - base, r1 - base
    return (first + lo // b_r, first + _cdiv(hi, b_r)), lo % b_r


def fp8_ref(data: WeightRef, scale: WeightRef, block: tuple[int, int], row0: int = 0) -> WeightRef:
    """The fp8_block weight of stored `data` (its logical shape: the data's) and `scale`."""
    return WeightRef(data.tensor, data.shape, data.dtype, index=data.index, rows=data.rows, format="fp8_block",
                     parts=(("data", data), ("scale", scale)), attrs=(("block", block), ("row0", row0)))


def mxfp4_ref(data: WeightRef, scale: WeightRef, shape: tuple[int, int]) -> WeightRef:
    """The mxfp4 weight of one expert's stored `data` [R, G, 16] and `scale` [R, G], read by
    its module as x @ W: logical `shape` [C, R] (the stored matrix transposed)."""
    return WeightRef(data.tensor, shape, data.dtype, index=data.index, format="mxfp4",
                     parts=(("data", data), ("scale", scale)), attrs=(("transpose", True),))


class WeightResolver:
    """Resolve transformers parameter names to WeightRefs in `ckpt`.

    With no weight files (a config-only compile) every ref keeps transformers' own name and
    the config dtype (quantized Linear weights: the stored format `quant` names); exec then
    refuses the plan with a clear message.
    """

    def __init__(self, ckpt: Checkpoint, model_type: str, default_dtype: str, quant: Quantization | None = None):
        self.ckpt = ckpt
        fam = family(model_type)  # (module path fragment in transformers 5, fragment in published checkpoints)
        self.aliases = list(fam.path_aliases) if fam is not None else []
        self.dtype = default_dtype
        self.quant = quant

    def _candidates(self, name: str) -> list[str]:
        out = [name]
        for a, b in self.aliases:
            if a in name:
                out.append(name.replace(a, b))
        return out

    def _find(self, name: str) -> str | None:
        for c in self._candidates(name):
            if c in self.ckpt.tensors:
                return c
        return None

    def tensor(self, name: str, shape: tuple[int, ...], *, fallback: str | None = None,
               linear: bool = False) -> WeightRef:
        """A whole tensor; `fallback` is tried when `name` is absent (tied lm_head).
        `linear`: the weight of a Linear layer (attention, MLP or expert projection), the
        only kind a quantized checkpoint may store quantized."""
        if linear and self.quant is not None and self.quant.schemes:  # GPTQ, AWQ, compressed-tensors, NVFP4
            ref = quant_linear.resolve(self, name, tuple(shape))
            if ref is not None:
                return ref
        if not self.ckpt.has_weights:
            dense = WeightRef(name, tuple(shape), self.dtype)
            return self._configured(dense) if linear else dense
        found = self._find(name) or (self._find(fallback) if fallback else None)
        if found is None:
            tried = self._candidates(name) + (self._candidates(fallback) if fallback else [])
            raise CheckpointError(
                f"{self.ckpt.directory}: tensor {name} is missing from the checkpoint "
                f"(looked for {', '.join(tried)})"
            )
        loc = self.ckpt.tensors[found]
        if tuple(loc.shape) != tuple(shape):  # the stored data's shape: an fp8 weight's logical one
            raise CheckpointError(
                f"{self.ckpt.directory}/{loc.file}: tensor {found} has shape {list(loc.shape)}, "
                f"but config.json implies {list(shape)}"
            )
        ref = WeightRef(found, tuple(shape), loc.dtype)
        return self._stored(ref, linear) if loc.dtype in _FLOAT8 else ref

    # -- quantized weights ----------------------------------------------------------------
    def _quant_for(self, tensor: str, dtype: str, linear: bool) -> Quantization:
        """The quantization of FP8 tensor `tensor`, or a CheckpointError saying why it cannot be read."""
        where = f"{self.ckpt.directory}/{self.ckpt.tensors[tensor].file}: tensor {tensor}"
        if self.quant is None or self.quant.format != "fp8_block":
            raise CheckpointError(f"{where} is stored as {dtype} but {self.ckpt.directory}/config.json has no fp8 "
                                  f"quantization_config (quant_method fp8, weight_block_size); add the release's "
                                  f"quantization_config or use a bf16 checkpoint")
        if not linear:
            raise CheckpointError(f"{where} is stored as {dtype}; moecc reads FP8 weights of Linear layers only "
                                  f"(attention, MLP and expert projections); embeddings, norms, routers and "
                                  f"lm_head must be bf16 as the FP8 releases store them")
        if dtype != self.quant.data_dtype:
            raise CheckpointError(f"{where} is stored as {dtype} but quantization_config.fmt says "
                                  f"{self.quant.data_dtype}")
        return self.quant

    def _scale_of(self, tensor: str, grid: tuple[int, ...], *alternatives: tuple[int, ...]) -> str:
        """The scale tensor of FP8 tensor `tensor`, checked: present, fp32 or bf16, of shape
        `grid` (or one of `alternatives`)."""
        scale = tensor + _SCALE_SUFFIX
        loc = self.ckpt.tensors.get(scale)
        data = self.ckpt.tensors[tensor]
        where = f"{self.ckpt.directory}/{data.file}: tensor {tensor}"
        if loc is None:
            raise CheckpointError(f"{where} is stored as {data.dtype} but its scale {scale} is missing; a "
                                  f"fine-grained FP8 checkpoint stores X.weight_scale_inv next to every FP8 X.weight")
        if loc.dtype not in _SCALE_DTYPES:
            raise CheckpointError(f"{self.ckpt.directory}/{loc.file}: tensor {scale} is {loc.dtype}; moecc reads "
                                  f"fp8 scales stored as {' or '.join(_SCALE_DTYPES)}")
        if tuple(loc.shape) not in (grid, *alternatives):
            b_r, b_c = self.quant.block  # type: ignore[union-attr]
            want = " or ".join(str(list(g)) for g in (grid, *alternatives))
            raise CheckpointError(
                f"{self.ckpt.directory}/{loc.file}: tensor {scale} has shape {list(loc.shape)}, but {tensor} of "
                f"shape {list(data.shape)} in blocks of [{b_r}, {b_c}] (quantization_config.weight_block_size) "
                f"needs {want}")
        return scale

    def _stored(self, data: WeightRef, linear: bool) -> WeightRef:
        """The fp8_block ref of whole FP8 tensor `data` [R, C] and its scale [ceil(R/bR), ceil(C/bC)]."""
        q = self._quant_for(data.tensor, data.dtype, linear)
        (R, C), (b_r, b_c) = data.shape, q.block
        scale = self._scale_of(data.tensor, (_cdiv(R, b_r), _cdiv(C, b_c)))
        loc = self.ckpt.tensors[scale]
        return fp8_ref(data, WeightRef(scale, tuple(loc.shape), loc.dtype), q.block)

    def _configured(self, dense: WeightRef) -> WeightRef:
        """Config-only: a Linear weight as the quantized release stores it (fp8 data of its
        logical shape, fp32 scales), unless the config keeps its module unquantized."""
        q = self.quant
        if q is None or self._configured_dtype(dense.tensor) not in _FLOAT8:
            return dense
        (R, C), (b_r, b_c) = dense.shape, q.block
        data = WeightRef(dense.tensor, dense.shape, q.data_dtype)
        return fp8_ref(data, WeightRef(dense.tensor + _SCALE_SUFFIX, (_cdiv(R, b_r), _cdiv(C, b_c)), "float32"),
                       q.block)

    def _configured_dtype(self, tensor: str) -> str:
        """Config-only: the stored dtype of Linear tensor `tensor` in the quantized release."""
        q = self.quant
        return q.data_dtype if q is not None and q.format == "fp8_block" and not q.skips(tensor) else self.dtype

    def _fused_fp8(self, tensor: str, dtype: str, shape: tuple[int, int, int], halves: bool) -> dict:
        """How to slice FP8 fused expert tensor `tensor` [E, R, C]: its scale's name, dtype and
        grid, and whether its two row halves (gate, up) are blocked apart (`halves`)."""
        q = self._quant_for(tensor, dtype, linear=True) if self.ckpt.has_weights else self.quant
        assert q is not None  # config-only: _configured_dtype gave fp8
        E, R, C = shape
        b_r, b_c = q.block
        cols = _cdiv(C, b_c)
        if not self.ckpt.has_weights:
            return {"scale": tensor + _SCALE_SUFFIX, "dtype": "float32", "grid": (E, _cdiv(R, b_r), cols),
                    "halves": False}
        whole = (E, _cdiv(R, b_r), cols)
        # gate and up blocked apart: transformers concatenates the published per-expert scales
        split = (E, 2 * _cdiv(R // 2, b_r), cols) if halves else whole
        scale = self._scale_of(tensor, whole, split)
        loc = self.ckpt.tensors[scale]
        return {"scale": scale, "dtype": loc.dtype, "grid": tuple(loc.shape),
                "halves": tuple(loc.shape) != whole}

    def _expert_slice(self, tensor: str, dtype: str, e: int, shape: tuple[int, int],
                      rows: tuple[int, int] | None, fused: dict | None) -> WeightRef:
        """Expert `e`'s slice (rows `rows`, or all) of fused tensor `tensor`, dense or fp8_block."""
        data = WeightRef(tensor, shape, dtype, index=e, rows=rows)
        if fused is None:
            return data
        b_r = self.quant.block[0]  # type: ignore[union-attr]
        _, n_rows, cols = fused["grid"]
        r0, r1 = rows or (0, shape[0])
        if fused["halves"] and r0 > 0:  # the up half, blocked from its own first row
            span, row0 = scale_rows(r0, r1, b_r, base=r0, first=n_rows // 2)
        else:
            span, row0 = scale_rows(r0, r1, b_r)
        scale = WeightRef(fused["scale"], (span[1] - span[0], cols), fused["dtype"], index=e,
                          rows=None if span == (0, n_rows) else span)
        return fp8_ref(data, scale, self.quant.block, row0)  # type: ignore[union-attr]

    # -- experts ------------------------------------------------------------------------
    def experts(self, prefix: str, num_experts: int, hidden: int, inter: int) -> dict[str, WeightRef]:
        """Per-expert gate [I, H], up [I, H], down [H, I] refs for the experts module at `prefix`."""
        fused_gu, fused_d = self._find(f"{prefix}.gate_up_proj"), self._find(f"{prefix}.down_proj")
        per_expert_quant = self.quant is not None and bool(self.quant.schemes)  # published per expert only
        if (not self.ckpt.has_weights and not per_expert_quant) or (fused_gu and fused_d):
            return self._fused_experts(fused_gu or f"{prefix}.gate_up_proj", fused_d or f"{prefix}.down_proj",
                                       num_experts, hidden, inter)
        out: dict[str, WeightRef] = {}
        for names in _PER_EXPERT_NAMES:
            probe = self._find(f"{prefix}.0.{names[0]}.weight") or quant_linear.stored_module(
                self, f"{prefix}.0.{names[0]}.weight") or (None if self.ckpt.has_weights else names[0])
            if probe is None:
                continue
            for e in range(num_experts):
                g, u, d = (f"{prefix}.{e}.{n}.weight" for n in names)
                out[f"e{e}.gate"] = self.tensor(g, (inter, hidden), linear=True)
                out[f"e{e}.up"] = self.tensor(u, (inter, hidden), linear=True)
                out[f"e{e}.down"] = self.tensor(d, (hidden, inter), linear=True)
            return out
        raise CheckpointError(
            f"{self.ckpt.directory}: no expert weights for {prefix}: looked for fused "
            f"{prefix}.gate_up_proj/down_proj and per-expert {prefix}.0.(gate_proj|w1).weight "
            f"(with aliases {self.aliases or 'none'})"
        )

    def _fused_experts(self, gu: str, dn: str, num_experts: int, hidden: int, inter: int) -> dict[str, WeightRef]:
        """Per-expert refs into fused gate_up [E, 2I, H] (gate rows [0, I), up rows [I, 2I))
        and down [E, H, I]; FP8 ones with the scale rows of their slice."""
        gu_shape, dn_shape = (num_experts, 2 * inter, hidden), (num_experts, hidden, inter)
        if self.ckpt.has_weights:
            self._check_shape(gu, gu_shape)
            self._check_shape(dn, dn_shape)
            dt_gu, dt_dn = self.ckpt.tensors[gu].dtype, self.ckpt.tensors[dn].dtype
        else:
            dt_gu, dt_dn = self._configured_dtype(gu), self._configured_dtype(dn)
        f_gu = self._fused_fp8(gu, dt_gu, gu_shape, halves=True) if dt_gu in _FLOAT8 else None
        f_dn = self._fused_fp8(dn, dt_dn, dn_shape, halves=False) if dt_dn in _FLOAT8 else None
        out: dict[str, WeightRef] = {}
        for e in range(num_experts):
            out[f"e{e}.gate"] = self._expert_slice(gu, dt_gu, e, (inter, hidden), (0, inter), f_gu)
            out[f"e{e}.up"] = self._expert_slice(gu, dt_gu, e, (inter, hidden), (inter, 2 * inter), f_gu)
            out[f"e{e}.down"] = self._expert_slice(dn, dt_dn, e, (hidden, inter), None, f_dn)
        return out

    def experts_with_bias(self, prefix: str, num_experts: int, hidden: int, inter: int) -> dict[str, WeightRef]:
        """gpt-oss's experts, as transformers writes them and as the releases publish them:
        per expert gate_up [H, 2I] (x @ gate_up; gate and up interleaved by column), its bias
        [2I], down [I, H] and its bias [H]; each a dim-0 slice of the fused tensor, or (an
        MXFP4 release) gate_up and down as mxfp4 refs into `*_blocks` and `*_scales`."""
        shapes = {"gate_up": (hidden, 2 * inter), "gate_up_bias": (2 * inter,), "down": (inter, hidden),
                  "down_bias": (hidden,)}
        names = {"gate_up": f"{prefix}.gate_up_proj", "gate_up_bias": f"{prefix}.gate_up_proj_bias",
                 "down": f"{prefix}.down_proj", "down_bias": f"{prefix}.down_proj_bias"}
        mx = self._gpt_oss_mxfp4(prefix)
        out: dict[str, WeightRef] = {}
        for part, shape in shapes.items():
            if mx and part in _MX_PARTS:
                refs = self._mxfp4_experts(names[part], num_experts, shape)  # type: ignore[arg-type]
            else:
                refs = self._dense_experts(names[part], num_experts, shape, names)
            out.update({f"e{e}.{part}": ref for e, ref in enumerate(refs)})
        return out

    def _gpt_oss_mxfp4(self, prefix: str) -> bool:
        """Whether the gpt-oss experts at `prefix` are stored as MXFP4: their `*_blocks` are in
        the checkpoint (config-only: the config's mxfp4 quantization does not skip them).
        Other quantization methods, and blocks without an mxfp4 quantization_config, are
        refused naming config.json."""
        q, blocks = self.quant, f"{prefix}.gate_up_proj_blocks"
        if q is not None and q.format != "mxfp4":
            raise UnsupportedModelError(f"{self.ckpt.directory}/config.json: quantization_config {q.method} for "
                                        f"gpt-oss experts ({prefix}) is not read; gpt-oss is published in bf16 or "
                                        f"MXFP4 (quant_method mxfp4): use one of those")
        if not self.ckpt.has_weights:
            return q is not None and not q.skips(f"{prefix}.gate_up_proj")
        found = self._find(blocks)
        if found is not None and q is None:
            loc = self.ckpt.tensors[found]
            raise CheckpointError(f"{self.ckpt.directory}/{loc.file}: tensor {found} holds MXFP4 blocks but "
                                  f"{self.ckpt.directory}/config.json has no quantization_config; add the release's "
                                  f"(\"quantization_config\": {{\"quant_method\": \"mxfp4\", ...}}) or use a bf16 "
                                  f"checkpoint")
        return found is not None

    def _dense_experts(self, name: str, num_experts: int, shape: tuple[int, ...],
                       names: dict[str, str]) -> list[WeightRef]:
        """Each expert's dim-0 slice of fused tensor `name` [E, *shape], checked."""
        found = self._find(name) if self.ckpt.has_weights else name
        if found is None:
            raise CheckpointError(f"{self.ckpt.directory}: tensor {name} is missing from the checkpoint "
                                  f"(gpt-oss experts need {', '.join(names.values())}; an MXFP4 release stores "
                                  f"gate_up_proj and down_proj as *_blocks and *_scales, with quantization_config "
                                  f"quant_method mxfp4 in config.json)")
        if self.ckpt.has_weights:
            self._check_shape(found, (num_experts, *shape))
        dtype = self.ckpt.tensors[found].dtype if self.ckpt.has_weights else self.dtype
        return [WeightRef(found, tuple(shape), dtype, index=e) for e in range(num_experts)]

    def _mxfp4_experts(self, name: str, num_experts: int, shape: tuple[int, int]) -> list[WeightRef]:
        """Each expert's mxfp4 ref of `name` (`gate_up_proj` / `down_proj`) read as x @ W with W
        of logical `shape` [C, R]: blocks [E, R, C/32, 16] and scales [E, R, C/32], checked."""
        (C, R), blocks, scales = shape, f"{name}_blocks", f"{name}_scales"
        if C % _MX_GROUP:
            raise CheckpointError(f"{self.ckpt.directory}/config.json: {name} reads {C} inputs per expert (from "
                                  f"hidden_size / intermediate_size), which MXFP4 cannot group: the input width "
                                  f"must be a multiple of {_MX_GROUP}")
        G = C // _MX_GROUP
        data_shape, scale_shape = (num_experts, R, G, _MX_BYTES), (num_experts, R, G)
        if self.ckpt.has_weights:
            self._check_mxfp4(blocks, data_shape, f"{num_experts} experts x {R} rows x {G} groups of "
                                                  f"{_MX_GROUP} values x {_MX_BYTES} bytes")
            self._check_mxfp4(scales, scale_shape, f"one E8M0 scale per group of {blocks} of shape "
                                                   f"{list(self.ckpt.tensors[blocks].shape)}")
        return [mxfp4_ref(WeightRef(blocks, data_shape[1:], "uint8", index=e),
                          WeightRef(scales, scale_shape[1:], "uint8", index=e), shape)
                for e in range(num_experts)]

    def _check_mxfp4(self, name: str, shape: tuple[int, ...], why: str) -> None:
        """MXFP4 tensor `name`: present, uint8, of `shape` (`why` says what makes it)."""
        loc = self.ckpt.tensors.get(name)
        if loc is None:
            raise CheckpointError(f"{self.ckpt.directory}: tensor {name} is missing from the checkpoint (an MXFP4 "
                                  f"release stores each experts module's gate_up_proj and down_proj as *_blocks "
                                  f"and *_scales, both uint8)")
        where = f"{self.ckpt.directory}/{loc.file}: tensor {name}"
        if loc.dtype != "uint8":
            raise CheckpointError(f"{where} is stored as {loc.dtype}; MXFP4 blocks and scales are uint8")
        if tuple(loc.shape) != shape:
            raise CheckpointError(f"{where} has shape {list(loc.shape)}, but config.json implies {list(shape)} "
                                  f"({why})")

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        loc = self.ckpt.tensors[name]
        if tuple(loc.shape) != shape:
            raise CheckpointError(
                f"{self.ckpt.directory}/{loc.file}: tensor {name} has shape {list(loc.shape)}, "
                f"but config.json implies {list(shape)}"
            )
