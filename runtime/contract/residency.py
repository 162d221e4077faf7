"""Residency groups: the units of weights the planner keeps on the device or streams whole."""

from __future__ import annotations


def residency_group(kind: str, layer: int | None) -> str | None:
    """The residency group of a module's non-expert weights: what the planner keeps on the
    device or streams as a unit (`L3.attn`, `L3.dense`, `head`; None: the stem, which runs
    on the host). Expert weights are `expert_group(layer)`."""
    if kind == "head":
        return "head"
    if kind == "attn":
        return f"L{layer}.attn"
    if layer is None:
        return None
    return f"L{layer}.dense"


def expert_group(layer: int) -> str:
    """The residency group of one layer's routed experts (`L3.experts`)."""
    return f"L{layer}.experts"
