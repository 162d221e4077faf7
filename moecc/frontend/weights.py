"""Map the parameters of transformers' module tree to checkpoint tensor names.

Checkpoints store experts either fused (transformers 5's own layout: `...experts.gate_up_proj`
[E, 2I, H] and `...experts.down_proj` [E, H, I]) or one by one as published (Mixtral:
`...block_sparse_moe.experts.{e}.w1/w3/w2.weight`; Qwen: `...mlp.experts.{e}.gate/up/down_proj.weight`).
Both become per-expert WeightRefs (a dim-0 index and a row range into the fused tensor, or a
whole per-expert tensor), so the runtime never builds a merged copy.
"""

from __future__ import annotations

from moecc.errors import CheckpointError
from moecc.frontend.checkpoint import Checkpoint
from moecc.ir import WeightRef

# (module path fragment in transformers 5, fragment in published checkpoints)
_PATH_ALIASES: dict[str, list[tuple[str, str]]] = {
    "mixtral": [(".mlp.", ".block_sparse_moe.")],
}
# per-expert tensor names: (gate, up, down)
_PER_EXPERT_NAMES = [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")]


class WeightResolver:
    """Resolve transformers parameter names to WeightRefs in `ckpt`.

    With no weight files (a config-only compile) every ref keeps transformers' own name and
    the config dtype; exec then refuses the plan with a clear message.
    """

    def __init__(self, ckpt: Checkpoint, model_type: str, default_dtype: str):
        self.ckpt = ckpt
        self.aliases = _PATH_ALIASES.get(model_type, [])
        self.dtype = default_dtype

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

    def tensor(self, name: str, shape: tuple[int, ...], *, fallback: str | None = None) -> WeightRef:
        """A whole tensor; `fallback` is tried when `name` is absent (tied lm_head)."""
        if not self.ckpt.has_weights:
            return WeightRef(name, tuple(shape), self.dtype)
        found = self._find(name) or (self._find(fallback) if fallback else None)
        if found is None:
            tried = self._candidates(name) + (self._candidates(fallback) if fallback else [])
            raise CheckpointError(
                f"{self.ckpt.directory}: tensor {name} is missing from the checkpoint "
                f"(looked for {', '.join(tried)})"
            )
        loc = self.ckpt.tensors[found]
        if tuple(loc.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.ckpt.directory}/{loc.file}: tensor {found} has shape {list(loc.shape)}, "
                f"but config.json implies {list(shape)}"
            )
        return WeightRef(found, tuple(shape), loc.dtype)

    def experts(self, prefix: str, num_experts: int, hidden: int, inter: int) -> dict[str, WeightRef]:
        """Per-expert gate [I, H], up [I, H], down [H, I] refs for the experts module at `prefix`."""
        fused_gu, fused_d = self._find(f"{prefix}.gate_up_proj"), self._find(f"{prefix}.down_proj")
        out: dict[str, WeightRef] = {}
        if not self.ckpt.has_weights or (fused_gu and fused_d):
            gu = fused_gu or f"{prefix}.gate_up_proj"
            dn = fused_d or f"{prefix}.down_proj"
            if self.ckpt.has_weights:
                self._check_shape(gu, (num_experts, 2 * inter, hidden))
                self._check_shape(dn, (num_experts, hidden, inter))
                dt_gu, dt_dn = self.ckpt.tensors[gu].dtype, self.ckpt.tensors[dn].dtype
            else:
                dt_gu = dt_dn = self.dtype
            for e in range(num_experts):
                out[f"e{e}.gate"] = WeightRef(gu, (inter, hidden), dt_gu, index=e, rows=(0, inter))
                out[f"e{e}.up"] = WeightRef(gu, (inter, hidden), dt_gu, index=e, rows=(inter, 2 * inter))
                out[f"e{e}.down"] = WeightRef(dn, (hidden, inter), dt_dn, index=e)
            return out
        for names in _PER_EXPERT_NAMES:
            probe = self._find(f"{prefix}.0.{names[0]}.weight")
            if probe is None:
                continue
            for e in range(num_experts):
                g, u, d = (f"{prefix}.{e}.{n}.weight" for n in names)
                out[f"e{e}.gate"] = self.tensor(g, (inter, hidden))
                out[f"e{e}.up"] = self.tensor(u, (inter, hidden))
                out[f"e{e}.down"] = self.tensor(d, (hidden, inter))
            return out
        raise CheckpointError(
            f"{self.ckpt.directory}: no expert weights for {prefix}: looked for fused "
            f"{prefix}.gate_up_proj/down_proj and per-expert {prefix}.0.(gate_proj|w1).weight "
            f"(with aliases {self.aliases or 'none'})"
        )

    def experts_with_bias(self, prefix: str, num_experts: int, hidden: int, inter: int) -> dict[str, WeightRef]:
        """gpt-oss's experts, as transformers writes them and as the bf16 releases publish them:
        per expert gate_up [H, 2I] (x @ gate_up; gate and up interleaved by column), its bias
        [2I], down [I, H] and its bias [H]; each a dim-0 slice of the fused tensor."""
        shapes = {"gate_up": (hidden, 2 * inter), "gate_up_bias": (2 * inter,), "down": (inter, hidden),
                  "down_bias": (hidden,)}
        names = {"gate_up": f"{prefix}.gate_up_proj", "gate_up_bias": f"{prefix}.gate_up_proj_bias",
                 "down": f"{prefix}.down_proj", "down_bias": f"{prefix}.down_proj_bias"}
        out: dict[str, WeightRef] = {}
        for part, shape in shapes.items():
            found = self._find(names[part]) if self.ckpt.has_weights else names[part]
            if found is None:
                raise CheckpointError(f"{self.ckpt.directory}: tensor {names[part]} is missing from the checkpoint "
                                      f"(gpt-oss experts need {', '.join(names.values())}; MXFP4 "
                                      f"*_blocks/*_scales releases are not read yet: use a bf16 checkpoint)")
            if self.ckpt.has_weights:
                self._check_shape(found, (num_experts, *shape))
            dtype = self.ckpt.tensors[found].dtype if self.ckpt.has_weights else self.dtype
            for e in range(num_experts):
                out[f"e{e}.{part}"] = WeightRef(found, shape, dtype, index=e)
        return out

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        loc = self.ckpt.tensors[name]
        if tuple(loc.shape) != shape:
            raise CheckpointError(
                f"{self.ckpt.directory}/{loc.file}: tensor {name} has shape {list(loc.shape)}, "
                f"but config.json implies {list(shape)}"
            )
