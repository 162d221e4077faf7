"""Errors the compiler raises. Each names where it happened and what to do about it."""

from __future__ import annotations


class MoeccError(Exception):
    """Base class: a user-facing error with a clear message (the CLI prints it, exits 1)."""


class CheckpointError(MoeccError):
    """The model directory is missing, is not a checkpoint, or is inconsistent."""


class ConfigError(CheckpointError):
    """A field of config.json (or generation_config.json) that moecc reads has the wrong type,
    is out of range, or disagrees with another field; the message names the file and the
    field (`path`, `field`)."""

    def __init__(self, path: str, field: str, message: str):
        super().__init__(f"{path}: field '{field}' {message}")
        self.path, self.field = path, field


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
