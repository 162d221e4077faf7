"""The MLP activations moecc runs, by the name a checkpoint's config.json gives them
(`hidden_act` / `hidden_activation`): the frontend refuses any other name at compile, the
worker's expert and MLP kernels apply them (runtime/worker/kernels.py)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
