"""Weight-only quantization at compile: `moecc compile MODEL --quantize int8|int4 -o PLAN`.

A bf16/fp16/fp32 checkpoint's selected Linear weights are quantized once, tensor by tensor
from the memory-mapped checkpoint (never the whole model in memory, the checkpoint never
written), into one safetensors file beside the plan, PLAN + ".weights.safetensors"
(moecc_runtime.plan.sidecar_path); the graph's WeightRefs of those weights become refs of
the stored format whose parts are tensors of that file, so the planner sizes memory and
copies by the stored bytes. The runtime dequantizes next to the GEMM (runtime/formats/).

Schemes (runtime/formats/ documents each layout):
  int8  int8_channel: symmetric int8, one fp32 scale per output channel.
  int4  int4_group: 4-bit values two per byte, one fp32 scale and uint8 zero point per group
        of `group_size` (default 128) input channels; the last group of a row whose width is
        not a multiple of the group is partial. Asymmetric (zero points) by default, as it
        measured better: held-out perplexity of examples/demo-model through moecc's runtime
        (`moecc perplexity`, group 128; unquantized 42.3763):
                          int8      int4 asymmetric   int4 symmetric
            experts       42.3905   42.9446           42.9972
            all           42.3614   43.4494           44.2628
        The symmetric variant stays available (CompileOptions.quantize_symmetric).
Scope: "experts" (default) quantizes the routed experts' matrices; "all" also attention
projections and dense / shared-expert MLPs. Never embeddings, norms, biases, routers, gates
(`linear` ops) or lm_head.

Modules: select.py (which weights, and refusing checkpoints already quantized),
source.py (a weight slice read from the mmapped checkpoint), writer.py (the sidecar file);
the pass is moecc/passes/quantize_weights.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from moecc_runtime.formats import int4_group, int8_channel

from moecc.errors import MoeccError

#: --quantize value -> the runtime format module that stores it
SCHEMES: dict[str, ModuleType] = {"int8": int8_channel, "int4": int4_group}
SCOPES: tuple[str, ...] = ("experts", "all")
DEFAULT_GROUP = int4_group.DEFAULT_GROUP


class QuantizeError(MoeccError):
    """A --quantize option is invalid, or the checkpoint cannot be quantized (already is)."""


@dataclass(frozen=True)
class QuantizeSpec:
    """What --quantize asked for: scheme (int8, int4), group size (int4), scope, symmetry (int4)."""

    scheme: str
    group_size: int = DEFAULT_GROUP
    scope: str = "experts"
    symmetric: bool = False

    @property
    def format(self) -> ModuleType:
        return SCHEMES[self.scheme]

    def attrs(self) -> dict[str, object]:
        """The plan's record of the options (Fingerprint.sidecar.quantize)."""
        return {"scheme": self.scheme, "group_size": self.group_size, "scope": self.scope,
                "symmetric": self.symmetric}

    def flags(self) -> str:
        """The command-line options that ask for this spec."""
        group = f" --quantize-group-size {self.group_size}" if self.scheme == "int4" else ""
        return f"--quantize {self.scheme}{group} --quantize-scope {self.scope}"


def quantize_spec(scheme: str | None, group_size: int = DEFAULT_GROUP, scope: str = "experts",
                  symmetric: bool = False) -> QuantizeSpec | None:
    """The validated spec (None: no quantization); QuantizeError naming the option otherwise."""
    if scheme is None:
        return None
    if scheme not in SCHEMES:
        raise QuantizeError(f"--quantize: unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)} "
                            f"(weight-only int8 per channel, or int4 in groups)")
    if scope not in SCOPES:
        raise QuantizeError(f"--quantize-scope: unknown scope {scope!r}; choose experts (routed experts only) "
                            f"or all (also attention and dense/shared-expert MLPs)")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise QuantizeError(f"--quantize-group-size must be a positive number of input channels, not {group_size!r}")
    return QuantizeSpec(scheme, int(group_size), scope, bool(symmetric))


__all__ = ["DEFAULT_GROUP", "SCHEMES", "SCOPES", "QuantizeError", "QuantizeSpec", "quantize_spec"]
