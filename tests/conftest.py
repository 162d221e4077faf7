"""Shared fixtures: tiny real checkpoints (written once per session) and the verifier on."""

from __future__ import annotations

import os

import pytest

# Every compile in the test suite (in-process or CLI subprocess) verifies after every pass.
os.environ["MOECC_VERIFY"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Lazily written tiny checkpoints: checkpoints(family, layout) -> Path."""
    from moecc.testing.checkpoints import write_checkpoint

    cache: dict[tuple[str, str], object] = {}
    root = tmp_path_factory.mktemp("ckpt")

    def get(family: str = "mixtral", layout: str = "per_expert"):
        key = (family, layout)
        if key not in cache:
            cache[key] = write_checkpoint(root / f"{family}-{layout}", family, layout=layout)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`):
    as fast on tiny matrices, and not slowed tenfold when other processes share the cores;
    restored after the module."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
