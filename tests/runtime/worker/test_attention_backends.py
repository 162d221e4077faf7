"""The attention backends' registry and dispatch (runtime/worker/attention_backends.py): each
placement (host, device, split) gives the step's micro-batches the expected backends, the
KV buffer cap binds only the backend that gathers, an unknown backend name fails naming it
and the registered ones, each registered backend builds its views once per micro-batch,
and the worker dispatches through the interface only. No model runs here: the numerics are
tests/runtime/worker/test_host_attention.py's and tests/e2e/test_equivalence.py's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from moecc_runtime.memory.kv import KVPool
from moecc_runtime.scheduler.blocks import KVUsage
from moecc_runtime.scheduler.step_plan import SeqChunk, StepPlan
from moecc_runtime.worker.attention import KVView
from moecc_runtime.worker.attention_backends import Where, backend_name, host_fractions, make_backends, place
from moecc_runtime.worker.batch import StepBatch
from moecc_runtime.worker.host_attention import HostView

BS = 4  # block size
WORKER = Path(__file__).resolve().parent.parent.parent.parent / "runtime" / "worker"


def _step(contexts: list[tuple[int, int]]) -> StepBatch:
    """A step of one chunk per (start, n): sequence i's blocks are 100*i, 100*i+1, ..."""
    seqs = []
    for i, (start, n) in enumerate(contexts):
        table = [100 * i + b for b in range(-(-(start + n) // BS))]
        pos = range(start, start + n)
        seqs.append(SeqChunk(i, [7] * n, start, table, [table[p // BS] for p in pos], [p % BS for p in pos],
                             prefill=n > 1, finishes=True))
    plan = StepPlan(seqs, "decode", [], KVUsage(0, 0, 0))
    return StepBatch.build(plan, BS)


def _layout(mbs) -> list[tuple[str, list[int], int]]:
    """(backend, sequence ids, index) per micro-batch, in list order."""
    return [(mb.where.value, [it[0] for it in mb.items], mb.index) for mb in mbs]


STEP = [(8, 1), (3, 1), (0, 5), (12, 1), (5, 1)]  # four decoding sequences and a prompt chunk


@pytest.mark.parametrize("fraction,expected", [
    (1.0, [("host", [0, 1], 0), ("host", [2, 3], 1), ("host", [4], 2)]),
    (0.0, [("device", [0, 1], 0), ("device", [2, 3], 1), ("device", [4], 2)]),
    (0.6, [("device", [3, 4], 0), ("host", [0, 1], 1), ("host", [2], 2)]),  # round(0.6 * 5) = 3 on the host
], ids=["host", "device", "split"])
def test_each_placement_gives_the_expected_backends(fraction, expected) -> None:
    assert _layout(place(_step(STEP), fraction, 2, None)) == expected


def test_the_kv_buffer_cap_binds_only_the_backend_that_gathers() -> None:
    """Sequences spanning 3, 1, 2, 4, 2 blocks; a device KV buffer of 4 blocks."""
    step = _step(STEP)
    assert _layout(place(step, 0.0, 3, 4)) == [("device", [0, 1], 0), ("device", [2], 1), ("device", [3], 2),
                                             ("device", [4], 3)]
    assert _layout(place(step, 1.0, 3, 4)) == [("host", [0, 1, 2], 0), ("host", [3, 4], 1)]
    with pytest.raises(ValueError, match="sequence 3 needs 4 KV blocks but one device KV buffer holds 3"):
        place(step, 0.0, 3, 3)


def test_an_unknown_backend_name_names_itself_and_the_registered_ones() -> None:
    assert backend_name("host") is Where.HOST and backend_name("device") is Where.DEVICE
    with pytest.raises(ValueError, match=r"attention backend 'gpu' is not registered; the registered ones: host, device"):
        backend_name("gpu")
    plan = {"batch": {ph: {} for ph in ("decode", "prefill")}}
    with pytest.raises(ValueError, match="'gpu'.*host, device"):
        host_fractions(plan, torch.device("cpu"), "gpu")


def test_host_fractions_force_then_plan_then_the_machine() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    plan = {"batch": {"decode": {"attention": {"where": "split", "host_fraction": 0.25}}, "prefill": {}}}
    assert host_fractions(plan, cpu) == {"decode": 0.25, "prefill": 1.0}
    assert host_fractions(plan, cuda) == {"decode": 0.25, "prefill": 0.0}
    assert host_fractions(plan, cuda, "host") == {"decode": 1.0, "prefill": 1.0}
    assert host_fractions(plan, cpu, Where.DEVICE) == {"decode": 0.0, "prefill": 0.0}


def test_each_backend_builds_its_views_once_per_micro_batch() -> None:
    pool = KVPool(1, 2, 8, block_size=BS, num_blocks=600, dtype=torch.float32)
    backends = make_backends(pool, torch.device("cpu"))
    assert set(backends) == set(Where)
    assert backends[Where.DEVICE].gathers and not backends[Where.HOST].gathers
    dev, host = place(_step(STEP), 0.4, 8, None)  # round(0.4 * 5) = 2 sequences on the host
    blocks = backends[Where.DEVICE].prepare(dev, None)
    assert blocks is not None and blocks.tolist() == [200, 201, 400, 401, 300, 301, 302, 303]  # prompt, then by span
    assert backends[Where.DEVICE].prepare(dev, None) is blocks  # cached: every layer of the step shares it
    view = dev.views.get(KVView, None, "cpu", lambda: pytest.fail("the view was not cached"))
    assert [g.S for g in view.decode_groups] == [1, 1] and len(view.prefill) == 1
    assert backends[Where.HOST].prepare(host, 6) is None  # reads the pool in place: nothing to gather
    hv = host.views.get(HostView, 6, "cpu", lambda: pytest.fail("the host view was not cached"))
    assert hv.rows.tolist() == [0, 1] and hv.lo.tolist() == [3, 0]  # sequence 0: positions 3..8 (window 6)


def test_the_worker_dispatches_through_the_interface_only() -> None:
    """No backend is named, nor a micro-batch's placement tested, in the worker."""
    src = (WORKER / "worker.py").read_text()
    for pattern in (r"mb\.host\b", r"\"host\"|\"device\"", r"HostAttention|GatheredAttention"):
        assert not re.search(pattern, src), f"worker.py: {pattern}"
    for f in sorted(WORKER.glob("*.py")):
        code = "\n".join(line.split("#")[0] for line in f.read_text().splitlines())
        assert "type: ignore" not in f.read_text(), f"{f.name}: a type: ignore"
        if f.name != "attention_backends.py":
            assert not re.search(r"[=!]= *\"(host|device)\"|in \(.*\"(host|device)\"", code), f"{f.name}"


def test_every_sdpa_call_of_the_runtime_goes_through_kernels_sdpa():
    """On CUDA kernels.sdpa leaves out cuDNN's backend, which builds a plan for every new shape
    (ragged steps: ~7 ms of host time a call on the first device run); a direct call would
    bring it back. On a CPU it is F.scaled_dot_product_attention itself."""
    from moecc_runtime.worker import kernels

    runtime = WORKER.parent
    direct = [str(p.relative_to(runtime)) for p in runtime.rglob("*.py")
              if "scaled_dot_product_attention(" in p.read_text() and p.name != "kernels.py"]
    assert direct == []
    assert torch.nn.attention.SDPBackend.CUDNN_ATTENTION not in kernels.CUDA_SDPA_BACKENDS
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(kernels.sdpa(q, k, v, is_causal=True), want)
