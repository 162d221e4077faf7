"""A residual add and the RMSNorm that opens the next module in one pass (worker/norm_ahead.py):
every such norm of a step is served from the add's pass, micro-batch by micro-batch, with the
bits of the ordinary path (tokens and logits equal with MOECC_NORM_AHEAD=0); rows it did not make
are refused; the plan pattern it looks for is found only where it holds."""

from __future__ import annotations

import random

import pytest
import torch

from moecc.compiler import compile_model
from moecc_runtime.contract.plan_types import Module, Op
from moecc_runtime.engine import Engine, generate
from moecc_runtime.native import rmsnorm as native_rmsnorm
from moecc_runtime.scheduler.sequence import GenRequest
from moecc_runtime.worker import kernels
from moecc_runtime.worker.norm_ahead import NormAhead, norms_ahead

needs_native = pytest.mark.skipif(native_rmsnorm._module() is None or native_rmsnorm.sum_lanes() is None,
                                  reason="the native rmsnorm was not built or not calibrated here")


def _op(kind: str, name: str, inputs=(), weights=None, attrs=None) -> Op:
    return Op(kind, name, tuple(inputs), weights or {}, attrs or {})


def _run(plan, path, monkeypatch, on: bool) -> tuple[dict, int, set]:
    """Results by key; how many norm ops NormAhead served, and which."""
    monkeypatch.setenv("MOECC_NORM_AHEAD", "1" if on else "0")
    eng = Engine(plan, path, "cpu", expert_chunk=3, attn_micro_batch=2)  # several micro-batches a step
    ahead = eng.worker._norm_ahead
    real, served, names = ahead.take, [0], set()

    def counted(op, x):
        got = real(op, x)
        if got is not None:
            served[0] += 1
            names.add(op.name)
        return got

    ahead.take = counted
    out: dict = {}
    rng = random.Random(1)
    reqs = [GenRequest(f"r{i}", [rng.randrange(3, 200) for _ in range(rng.randint(3, 30))], 5) for i in range(6)]
    try:
        generate(eng, reqs, lambda r: out.__setitem__(r.key, r), max_batch=4, record_logits=True)
    finally:
        eng.close()
    return out, served[0], names


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_norm_after_an_add_served_with_the_same_bits(checkpoints, monkeypatch, dtype):
    path = checkpoints("mixtral", "per_expert")
    plan, _ = compile_model(path, prompt_tokens=24, output_tokens=8, max_batch=4, dtype=dtype)
    got, served, names = _run(plan, path, monkeypatch, on=True)
    norms = [op["name"] for m in plan["schedule"] for op in m["ops"] if op["op"] == "rmsnorm"]
    # every layer's norms but the first layer's input norm (after the embedding) and the final norm
    assert names == set(norms[1:-1]) and served > len(names)
    ref, none, _ = _run(plan, path, monkeypatch, on=False)
    assert none == 0 and ref.keys() == got.keys()
    for k in ref:
        assert got[k].token_ids == ref[k].token_ids
        assert all(torch.equal(a, b) for a, b in zip(got[k].logits, ref[k].logits)), k


def test_finds_the_norm_that_opens_the_next_module():
    attn = Module("L0.attn", "attn", 0, "g0", (_op("attention", "a", ["x"]), _op("add", "s", ["x", "a"]),
                                             _op("host_buffer", "buf.s", ["s"])))
    moe = Module("L0.moe", "moe", 0, "g0", (_op("fetch_weights", "f"), _op("rmsnorm", "n", ["buf.s", "f"]),
                                           _op("add", "t", ["buf.s", "n"]), _op("host_buffer", "buf.t", ["t"])))
    head = Module("head", "head", None, "g1", (_op("rmsnorm", "final", ["buf.t"]),))
    late = Module("L1.attn", "attn", 1, "g0", (_op("attention", "b", ["buf.t"]), _op("rmsnorm", "m", ["buf.t"])))
    kept = {"s": "buf.s", "t": "buf.t"}
    assert {k: v.name for k, v in norms_ahead([attn, moe, head], kept).items()} == {"s": "n"}  # not the head's
    assert norms_ahead([attn, moe, late], kept).keys() == {"s"}  # a norm that does not open its module
    assert norms_ahead([attn, moe], {}) == {}


@needs_native
def test_refuses_rows_it_did_not_make(monkeypatch):
    T, H = 10, 64
    norm = _op("rmsnorm", "n", ["buf.s"], {"weight": "w"}, {"eps": 1e-6})
    w = torch.randn(H)
    ahead = NormAhead({"s": norm}, lambda op: w)
    full = torch.zeros(T, H)  # the host buffer the add keeps its sum in
    a, b = torch.randn(4, H), torch.randn(4, H)
    ahead.start_step()
    assert ahead.add(_op("add", "s"), (a, b), full[2:6], full)
    assert torch.equal(full[2:6], a + b)
    got = ahead.take(norm, full[2:6])
    assert got is not None and torch.equal(got, kernels.rmsnorm(full[2:6], w, 1e-6))
    assert torch.equal(ahead.take(norm, full[3:5]), got[1:3])
    assert ahead.take(norm, full[2:7]) is None  # row 6 not made
    assert ahead.take(norm, full[:, :32]) is None  # other columns
    assert ahead.take(norm, full[2:6].clone()) is None  # not the buffer's rows
    assert ahead.take(_op("rmsnorm", "other", ["buf.s"]), full[2:6]) is None
    assert not ahead.add(_op("add", "t"), (a, b), full[2:6], full)  # no norm after it
    ahead.start_step()
    assert ahead.take(norm, full[2:6]) is None  # made in an earlier step
    monkeypatch.setenv("MOECC_NORM_AHEAD", "0")
    off = NormAhead({"s": norm}, lambda op: w)
    assert not off.add(_op("add", "s"), (a, b), full[2:6], full)
