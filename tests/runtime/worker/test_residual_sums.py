"""A CPU run's residual adds write their sums straight into the host buffers that keep them
(Worker._add_into): the same bits as the add then the buffer's copy, micro-batch by micro-batch."""

from __future__ import annotations

import random

import pytest
import torch

from moecc.compiler import compile_model
from moecc_runtime.engine import Engine, generate
from moecc_runtime.scheduler.sequence import GenRequest
from moecc_runtime.worker import worker as worker_module


def _requests() -> list[GenRequest]:
    rng = random.Random(1)
    return [GenRequest(f"r{i}", [rng.randrange(3, 200) for _ in range(rng.randint(3, 30))], 5) for i in range(6)]


def _run(plan, path) -> tuple[dict, int]:
    """Results by key, and how many adds wrote into a host buffer."""
    eng = Engine(plan, path, "cpu", expert_chunk=3, attn_micro_batch=2)  # several micro-batches a step
    w, real, into = eng.worker, eng.worker._add_into, [0]

    def counted(*args):
        got = real(*args)
        into[0] += got is not None
        return got

    w._add_into = counted
    out: dict = {}
    try:
        generate(eng, _requests(), lambda r: out.__setitem__(r.key, r), max_batch=4, record_logits=True)
    finally:
        eng.close()
    return out, into[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sums_written_in_place_have_the_bits_of_the_copy(checkpoints, monkeypatch, dtype):
    path = checkpoints("mixtral", "per_expert")
    plan, _ = compile_model(path, prompt_tokens=24, output_tokens=8, max_batch=4, dtype=dtype)
    got, n_into = _run(plan, path)
    adds = sum(1 for m in plan["schedule"] for op in m["ops"] if op["op"] == "add")
    assert n_into >= adds, "every residual add of a step wrote its host buffer in place"
    monkeypatch.setattr(worker_module, "_sums_kept", lambda schedule: {})
    ref, none = _run(plan, path)
    assert none == 0
    assert ref.keys() == got.keys()
    for k in ref:
        assert got[k].token_ids == ref[k].token_ids
        assert all(torch.equal(a, b) for a, b in zip(got[k].logits, ref[k].logits)), k


def test_sums_kept_finds_the_add_before_its_buffer():
    from moecc_runtime.contract.plan_types import Module, Op

    def op(kind, name, inputs=()):
        return Op(kind, name, tuple(inputs), {}, {})

    m = Module("L0.attn", "attn", 0, "g0", (op("attention", "a", ["x"]), op("add", "s", ["x", "a"]),
                                      op("kv_store", "kv", ["a"]), op("host_buffer", "buf.s", ["s"])))
    other = Module("L0.moe", "moe", 0, "g0", (op("add", "t", ["x", "y"]), op("mul", "u", ["t", "t"]),
                                        op("host_buffer", "buf.u", ["u"])))
    assert worker_module._sums_kept([m, other]) == {"s": "buf.s"}
