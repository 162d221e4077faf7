"""The stored tensors of a quantized Linear of the integer and FP4 methods
(moecc/frontend/quant_schemes.py), as a WeightRef of its runtime format (runtime/formats/):
found by the module's checkpoint name, each checked for presence, dtype and shape, with an
error naming the tensor, its file and what the config implies. A config-only compile makes
the same refs from the config (the release's tensor names, dtypes and shapes).

| format    | stored tensors of Linear X [R, C]                                                |
|-----------|----------------------------------------------------------------------------------|
| gptq      | X.qweight [C/k, R] i32, X.qzeros [G, R/k] i32, X.scales [G, R], X.g_idx [C]      |
| awq_gemm  | X.qweight [C, R/8] i32, X.qzeros [G, R/8] i32, X.scales [G, R]                   |
| ct_packed | X.weight_packed [R, C/k] i32, X.weight_scale [R, G], X.weight_zero_point [R/k, G] |
| ct_naive  | X.weight [R, C] int8/fp8, X.weight_scale [R, 1] / [1] / [R, G], X.weight_zero_point |
| nvfp4     | X.weight [R, C/2] u8, X.weight_scale [R, C/16] fp8, X.weight_scale_2 [] f32      |

Legend: R = output channels, C = input channels, G = groups (1 per row for channel / -1),
k = 32 / bits values per int32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moecc.errors import CheckpointError
from moecc.frontend.quant_schemes import LinearScheme
from moecc.ir import WeightRef

if TYPE_CHECKING:
    from moecc.frontend.weights import WeightResolver

_SCALES = ("float16", "bfloat16", "float32")
_MARKERS = (".weight", ".qweight", ".weight_packed")  # a Linear's data tensor in some method
_PACKED = (".qweight", ".weight_packed")  # data tensors only a quantized Linear has


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def stored_module(r: "WeightResolver", name: str) -> str | None:
    """The checkpoint module of Linear weight `name` (transformers' name, aliases tried)
    whose data tensor the checkpoint holds (plain, GPTQ/AWQ or pack-quantized)."""
    for c in r._candidates(name):
        m = c.removesuffix(".weight")
        if any(m + s in r.ckpt.tensors for s in _MARKERS):
            return m
    return None


class _Parts:
    """Builds one Linear's parts: found and checked (weights present) or made (config-only)."""

    def __init__(self, r: "WeightResolver", module: str, shape: tuple[int, int], scheme: LinearScheme):
        self.r, self.m, self.shape, self.scheme = r, module, shape, scheme
        self.parts: list[tuple[str, WeightRef]] = []

    def add(self, part: str, suffix: str, dtypes: tuple[str, ...], *shapes: tuple[int, ...]) -> None:
        """Part `part` = tensor module + suffix, of one of `dtypes` and one of `shapes`."""
        name = self.m + suffix
        if not self.r.ckpt.has_weights:
            self.parts.append((part, WeightRef(name, shapes[0], dtypes[0])))
            return
        loc = self.r.ckpt.tensors.get(name)
        d = self.r.ckpt.directory
        why = (f"{self.scheme.format} weight {self.m} of shape {list(self.shape)} (config.json's "
               f"quantization_config: {self.scheme.bits} bits, group {self.scheme.group})")
        if loc is None:
            raise CheckpointError(f"{d}: tensor {name} is missing from the checkpoint; the {why} stores it. Check "
                                  f"the quantization_config (ignore / modules_to_not_convert) against the files")
        if loc.dtype not in dtypes:
            raise CheckpointError(f"{d}/{loc.file}: tensor {name} is {loc.dtype}; the {why} stores it as "
                                  f"{' or '.join(dtypes)}")
        if tuple(loc.shape) not in shapes:
            want = " or ".join(str(list(s)) for s in shapes)
            raise CheckpointError(f"{d}/{loc.file}: tensor {name} has shape {list(loc.shape)}, but the {why} "
                                  f"needs {want}")
        self.parts.append((part, WeightRef(name, tuple(loc.shape), loc.dtype)))

    def ref(self) -> WeightRef:
        data = self.parts[0][1]
        return WeightRef(data.tensor, self.shape, data.dtype, format=self.scheme.format, parts=tuple(self.parts),
                         attrs=self.scheme.attrs)


def _divisible(r: "WeightResolver", module: str, n: int, k: int, what: str) -> None:
    if n % k:
        raise CheckpointError(f"{r.ckpt.directory}: Linear {module} has {n} {what}, which its format cannot pack "
                              f"({k} values per int32 word); config.json's sizes and the quantization disagree")


def _groups(C: int, group: int) -> int:
    return 1 if group <= 0 else _cdiv(C, group)


def _gptq(p: _Parts, R: int, C: int) -> None:
    s = p.scheme
    k, G = 32 // s.bits, _groups(C, s.group)
    _divisible(p.r, p.m, C, k, "input channels")
    _divisible(p.r, p.m, R, k, "output channels")
    p.add("data", ".qweight", ("int32",), (C // k, R))
    p.add("zero", ".qzeros", ("int32",), (G, R // k))
    p.add("scale", ".scales", _SCALES, (G, R))
    if dict(s.attrs).get("desc_act"):
        p.add("g_idx", ".g_idx", ("int32", "int64"), (C,))


def _awq(p: _Parts, R: int, C: int) -> None:
    G = _groups(C, p.scheme.group)
    _divisible(p.r, p.m, R, 8, "output channels")
    p.add("data", ".qweight", ("int32",), (C, R // 8))
    p.add("zero", ".qzeros", ("int32",), (G, R // 8))
    p.add("scale", ".scales", _SCALES, (G, R))


def _ct_packed(p: _Parts, R: int, C: int) -> None:
    s = p.scheme
    G = _groups(C, s.group)
    p.add("data", ".weight_packed", ("int32",), (R, _cdiv(C * s.bits, 32)))
    p.add("scale", ".weight_scale", _SCALES, (R, G))
    if not s.symmetric:
        p.add("zero", ".weight_zero_point", ("int32",), (_cdiv(R * s.bits, 32), G))
    if p.r.ckpt.has_weights and p.m + ".weight_g_idx" in p.r.ckpt.tensors:
        p.add("g_idx", ".weight_g_idx", ("int32", "int64"), (C,))


def _ct_naive(p: _Parts, R: int, C: int) -> None:
    s = p.scheme
    fp8 = dict(s.attrs).get("type") == "float"
    p.add("data", ".weight", ("float8_e4m3fn",) if fp8 else ("int8",), (R, C))
    shapes = [(R, _groups(C, s.group))] if s.group > 0 else [(R, 1), (1,), ()]
    if not p.r.ckpt.has_weights and s.group == 0 and fp8:
        shapes = [(R, 1)]
    p.add("scale", ".weight_scale", ("float32", "bfloat16", "float16"), *shapes)
    if not s.symmetric:
        p.add("zero", ".weight_zero_point", ("int8",), *shapes)


def _nvfp4(p: _Parts, R: int, C: int) -> None:
    _divisible(p.r, p.m, C, 16, "input channels (NVFP4 scales 16 at a time)")
    p.add("data", ".weight", ("uint8",), (R, C // 2))
    p.add("scale", ".weight_scale", ("float8_e4m3fn",), (R, C // 16))
    p.add("scale_2", ".weight_scale_2", ("float32",), (), (1,))


_LAYOUTS = {"gptq": _gptq, "awq_gemm": _awq, "ct_packed": _ct_packed, "ct_naive": _ct_naive, "nvfp4": _nvfp4}


def resolve(r: "WeightResolver", name: str, shape: tuple[int, ...]) -> WeightRef | None:
    """The quantized ref of Linear weight `name` [R, C] under `r.quant`'s schemes; None when
    it is stored dense (its module ignored or untargeted, or, GPTQ / AWQ, a module the file
    keeps in floats: no qweight) or absent (the caller reports it)."""
    q = r.quant
    assert q is not None and q.schemes
    if r.ckpt.has_weights:
        m = stored_module(r, name)
        if m is None:
            return None
    else:
        m = name.removesuffix(".weight")
    scheme = q.linear_scheme(m)
    packed = [m + s for s in _PACKED if r.ckpt.has_weights and m + s in r.ckpt.tensors]
    if scheme is None:
        if packed:
            raise CheckpointError(f"{r.ckpt.directory}: tensor {packed[0]} is stored quantized, but config.json's "
                                  f"quantization_config keeps module {m} unquantized (ignore / "
                                  f"modules_to_not_convert / exclude_modules, or no config group targets it)")
        return None
    if scheme.format in ("gptq", "awq_gemm") and r.ckpt.has_weights and not packed:
        return None  # GPTQ / AWQ files name no list of what they kept in floats: the tensors say
    if len(shape) != 2:
        raise CheckpointError(f"{r.ckpt.directory}: {m} is quantized ({scheme.format}) but is not a 2-D Linear "
                              f"weight (shape {list(shape)}); moecc reads quantized Linear weights only")
    p = _Parts(r, m, (int(shape[0]), int(shape[1])), scheme)
    _LAYOUTS[scheme.format](p, *p.shape)
    return p.ref()


def has_linear(r: "WeightResolver", name: str) -> bool:
    """Whether the checkpoint holds Linear weight `name` in any stored form (expert probing)."""
    return stored_module(r, name) is not None
