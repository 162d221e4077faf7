"""Decide a module's role from what it holds, not from its class name.

- experts:   holds 3-D parameters (all experts of a layer stacked: [E, 2I, H], [E, H, I])
- attention: holds q/k/v/o projections, or MLA's (kv_a_proj_with_mqa, kv_b_proj, o_proj)
- mlp:       holds gate/up/down projections (a dense MLP or a shared expert)
- router:    holds one [E, H] weight and a `top_k`, returns (logits, weights, index)
- norm:      holds one 1-D weight and an epsilon

Modules with a role are fx leaves: moecc implements them; the glue between them (residual
adds, reshapes, shared-expert gating) comes from transformers' own layer code.
"""

from __future__ import annotations

from torch import nn

ROLES = ("experts", "attention", "mlp", "router", "norm")


def classify(module: nn.Module) -> str | None:
    params = dict(module.named_parameters(recurse=False))
    children = dict(module.named_children())
    if any(p.dim() == 3 for p in params.values()):
        return "experts"
    if {"q_proj", "k_proj", "v_proj", "o_proj"} <= children.keys():
        return "attention"
    if {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} <= children.keys():
        return "attention"  # multi-head latent attention (DeepSeek-V2/V3)
    if {"gate_proj", "up_proj", "down_proj"} <= children.keys():
        return "mlp"
    if not children and "weight" in params and params["weight"].dim() == 2 and hasattr(module, "top_k"):
        return "router"
    if (
        not children
        and set(params) == {"weight"}
        and params["weight"].dim() == 1
        and any(hasattr(module, a) for a in ("variance_epsilon", "eps"))
    ):
        return "norm"
    return None


def norm_eps(module: nn.Module) -> float:
    return float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
