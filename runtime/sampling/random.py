"""Each request's random stream: one torch.Generator per completion, seeded from the request
alone, so a seeded request draws the same tokens whatever else runs beside it."""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

from moecc_runtime.syncs import to_device


def request_generator(seed: int | None, custom_id: str, choice: int = 0) -> torch.Generator:
    """The random state of completion `choice` of a request: from its seed (choice j > 0:
    seed + j), else from its custom_id (and j); reproducible whatever else runs."""
    g = torch.Generator(device="cpu")
    if seed is not None:
        g.manual_seed((seed + choice) % 2**64)
    else:
        g.manual_seed(zlib.crc32((custom_id if choice == 0 else f"{custom_id}#{choice}").encode()) | (1 << 32))
    return g


def uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) from each row's generator (a row without one: from torch's
    global stream) -> [R] float32 on `device`: each drawn token takes exactly one number of
    its request's stream."""
    u = torch.empty(len(generators), dtype=torch.float32)
    for r, g in enumerate(generators):
        u[r] = torch.rand((), generator=g)
    return to_device(u, device)
