"""The fx tracer: one torch.fx trace per decoder layer of a model built on the meta device.

Needs: a decoder layer (an nn.Module on meta) and the model's facts.
Does: traces the layer with moecc's role modules (roles.py) and plain nn.Linear as leaves;
every value carries a meta value (node.meta["val"]), so layer code may read shapes.
Guarantees: a torch.fx GraphModule per layer, or a FrontendError naming the layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn

from moecc.errors import FrontendError
from moecc.frontend.roles import classify
from moecc.ir.graph import ModelInfo

#: any length: the lowering keeps rows flat ([T, H]) and drops shape ops
TRACE_TOKENS = 8


def trace_layer(idx: int, layer: nn.Module, info: ModelInfo) -> torch.fx.GraphModule:
    """The fx trace of decoder layer `idx`, called as layer(h, position_embeddings=(cos, sin))."""
    try:
        wrapper = _LayerCall(layer)
        rope_dim, T = rope_dims(layer, info), TRACE_TOKENS
        inputs = {"h": torch.empty(1, T, info.hidden_size, device="meta"),
                  "cos": torch.empty(1, T, rope_dim, device="meta"), "sin": torch.empty(1, T, rope_dim, device="meta")}
        return torch.fx.GraphModule(wrapper, _RoleTracer(inputs).trace(wrapper))
    except Exception as e:
        raise FrontendError(idx, type(layer).__name__, f"torch.fx could not trace the layer: {e}") from e


def rope_dims(layer: nn.Module, info: ModelInfo) -> int:
    """Width of the rotary cos/sin a layer's attention takes (MLA rotates only part of a head)."""
    attn = next((m for m in layer.modules() if classify(m) == "attention"), None)
    rope = getattr(attn, "qk_rope_head_dim", None) if attn is not None else None
    return int(rope or info.head_dim)




class _MetaProxy(torch.fx.Proxy):
    """A proxy that knows its value's meta tensor (or shape), so layer code may read shapes
    and star-unpack them (`view(*orig_shape)`, as DeepSeek's MoE block does)."""

    def __iter__(self):
        return _iter_meta(self)

    def __len__(self) -> int:
        return _len_meta(self)

    def __getattr__(self, k: str) -> "_MetaAttribute":
        return _MetaAttribute(self, k)


class _MetaAttribute(torch.fx.proxy.Attribute):
    """`proxy.shape` and friends: iterable like their meta value."""

    def __iter__(self):
        return _iter_meta(self)

    def __len__(self) -> int:
        return _len_meta(self)


def _len_meta(p: torch.fx.Proxy) -> int:
    val = p.node.meta.get("val")
    if val is None:
        return torch.fx.Proxy.__len__(p)
    return len(val.shape) if isinstance(val, torch.Tensor) else len(val)


def _iter_meta(p: torch.fx.Proxy):
    if p.node.meta.get("val") is None:
        return torch.fx.Proxy.__iter__(p)
    return iter([p[i] for i in range(_len_meta(p))])


class _RoleTracer(torch.fx.Tracer):
    """Modules with a moecc role (and plain nn.Linear) stay leaves. Every value carries a
    meta value (node.meta["val"]) computed alongside: leaves by their role's output shape,
    everything else by running the op on meta tensors."""

    def __init__(self, inputs: dict[str, torch.Tensor]):
        super().__init__()
        self.inputs = inputs

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return classify(m) is not None or isinstance(m, nn.Linear)

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _MetaProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        p = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        try:
            p.node.meta["val"] = self._meta(kind, target, args, kwargs)
        except Exception:  # a value whose shape cannot be known: only reading it fails later
            p.node.meta["val"] = None
        return p

    def _meta(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        def val(x: Any) -> Any:
            return torch.fx.node.map_aggregate(
                x, lambda v: v.node.meta.get("val") if isinstance(v, torch.fx.Proxy) else v)

        a, kw = val(args), val(kwargs)
        if kind == "placeholder":
            return self.inputs.get(target)
        if kind == "get_attr":
            obj = self.root
            for part in str(target).split("."):
                obj = getattr(obj, part)
            return obj
        if kind == "call_function":
            return target(*a, **kw)
        if kind == "call_method":
            return getattr(a[0], target)(*a[1:], **kw)
        if kind == "call_module":
            mod = self.root.get_submodule(target)
            x = a[0] if a else next(iter(kw.values()))
            return _leaf_meta(mod, x)
        return None


class _LayerCall(nn.Module):
    """A decoder layer with explicit arguments, so fx can trace it."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.layer(h, position_embeddings=(cos, sin), attention_mask=None)


def _leaf_meta(mod: nn.Module, x: torch.Tensor) -> Any:
    """The meta output of a leaf module for input `x`, by its role (leaves are not run:
    experts on meta would need data-dependent shapes). Runs inside the tracer, which
    turns parameter reads and module calls into graph nodes, so shapes come from
    `_parameters` and plain attributes only."""
    role = classify(mod)
    lead = x.shape[:-1]
    if role == "router":
        n, E, k = x.numel() // x.shape[-1], mod._parameters["weight"].shape[0], int(mod.top_k)
        return (torch.empty(n, E, device="meta"), torch.empty(n, k, device="meta"),
                torch.empty(n, k, dtype=torch.long, device="meta"))
    if role == "attention":
        return (torch.empty(x.shape, device="meta"), None)
    if role in ("experts", "norm"):
        return torch.empty(x.shape, device="meta")
    if role == "mlp":
        return torch.empty(*lead, mod._modules["down_proj"].out_features, device="meta")
    if isinstance(mod, nn.Linear):
        return torch.empty(*lead, mod.out_features, device="meta")
    return None

