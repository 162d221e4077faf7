"""Errors the compiler raises. Each names where it happened and what to do about it."""

from __future__ import annotations


class MoeccError(Exception):
    """Base class: a user-facing error with a clear message (the CLI prints it, exits 1)."""


class CheckpointError(MoeccError):
    """The model directory is missing, is not a checkpoint, or is inconsistent."""


class UnsupportedModelError(MoeccError):
    """The architecture (or one of its features) is not supported yet."""


class FrontendError(MoeccError):
    """Tracing or lowering a decoder layer failed; names the layer and the fx node."""

    def __init__(self, layer: int | None, node: str, message: str):
        where = f"layer {layer}" if layer is not None else "model skeleton"
        super().__init__(f"frontend: {where}, node %{node}: {message}")
        self.layer, self.node = layer, node


class PassError(MoeccError):
    """A pass failed or broke an invariant; names the pass."""

    def __init__(self, pass_name: str, message: str):
        super().__init__(f"pass {pass_name}: {message}")
        self.pass_name = pass_name


class BudgetError(MoeccError):
    """The memory budgets cannot hold the model's minimum working set."""


class HardwareError(MoeccError):
    """An unknown hardware preset, or a hardware profile file that is missing or malformed."""
