"""Each request's random stream: one torch.Generator per completion, seeded from the request
alone, so a seeded request draws the same tokens whatever else runs beside it.

Completion j of a request draws from a stream derived from (seed, j) by a hash, so streams are
independent across seeds and completions (the old rule, seed + j, made completion j of seed s
the stream of completion j - 1 of seed s + 1). Completion 0 keeps the stream it always had
(the seed itself; without a seed, crc32 of the custom_id with bit 32 set), so every n = 1
result stays what it was; with a seed, the custom_id does not matter.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Sequence

import torch

from moecc_runtime.syncs import to_device


def completion_seed(seed: int | None, custom_id: str, j: int) -> int:
    """The torch seed, in [0, 2**64), of completion `j` (0-based) of a request with `seed`
    (None: unseeded, then named by `custom_id`); the same on every machine and run."""
    if j < 0:
        raise ValueError(f"completion index must be >= 0, got {j}")
    if j == 0:
        return seed % 2**64 if seed is not None else zlib.crc32(custom_id.encode("utf-8")) | (1 << 32)
    who = f"seed:{seed}" if seed is not None else f"id:{custom_id}"
    digest = hashlib.sha256(f"moecc.completion\x00{who}\x00{j}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")


def request_generator(seed: int | None, custom_id: str, choice: int = 0) -> torch.Generator:
    """The random state of completion `choice` of a request (`completion_seed`)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(completion_seed(seed, custom_id, choice))
    return g


def uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) from each row's generator (a row without one: from torch's
    global stream) -> [R] float32 on `device`: each drawn token takes exactly one number of
    its request's stream."""
    u = torch.empty(len(generators), dtype=torch.float32)
    for r, g in enumerate(generators):
        u[r] = torch.rand((), generator=g)
    return to_device(u, device)
