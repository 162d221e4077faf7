"""Device memory as the process really takes it (issue 29, item 3): the device reserve (CUDA
context, library workspaces) kept out of --gpu-mem, every temporary of a step counted (logits
and their fp32 copy, the sampler's, dequantize, attention workspace), dense slots sized for
what streams, explain naming each allocation, the runtime's cap a no-op on a CPU; and host
buffers shared by liveness (item 10)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from moecc.compiler import compile_model
from moecc.errors import HardwareError
from moecc.planner import solve as S
from moecc.planner.costs import DEQUANT_TEMP_BYTES_PER_ELEM, dequant_device_bytes, model_cost
from moecc.planner.hardware import DEVICE_RESERVE_BYTES, HardwareProfile, resolve_hardware
from moecc.sizes import format_bytes
from moecc.views.explain import DEVICE_ROWS, explain, format_explain
from moecc_runtime.memory.device_budget import cap_process, plan_device_budget, process_device_bytes, uncap

from tests.compiler.passes.util import DATA, graph_before
from tests.compiler.planner.test_solve import cost, problem

TINY = DATA / "tiny-mixtral"  # config only


def test_presets_carry_a_device_reserve_and_a_profile_without_one_gets_its_kinds():
    assert resolve_hardware("h200").device_reserve_bytes == DEVICE_RESERVE_BYTES["cuda"] >= 900 * 10**6
    assert resolve_hardware("cpu").device_reserve_bytes == 0
    d = resolve_hardware("a5000").to_json()
    assert d["device_reserve_bytes"] == DEVICE_RESERVE_BYTES["cuda"]
    d.pop("device_reserve_bytes")  # a profile written before the field
    assert HardwareProfile.from_json(d).device_reserve_bytes == DEVICE_RESERVE_BYTES["cuda"]
    with pytest.raises(HardwareError, match="device_reserve_bytes"):
        HardwareProfile.from_json({**d, "device_reserve_bytes": -5})


def test_the_budget_is_gpu_mem_less_the_reserve_at_the_derate_and_counts_the_logits():
    pr = problem(device_reserve_given=None, gpu_mem=10**9 + 3_000_000)  # a5000: 1 GB reserve
    assert pr.device_budget == int(3_000_000 * S.DEVICE_DERATE)
    sol = S.solve(pr)
    dev, B, V = sol.device_bytes, sol.choice.B, cost().vocab
    assert dev["device_reserve"] == 10**9
    assert dev["logits"] == B * V * (cost().itemsize + 4) and dev["sampler"] == B * V * 4 * 2
    for phase in ("decode", "prefill"):
        parts = dev[f"{phase}_activations"] + dev[f"{phase}_attention_workspace"] + dev["logits"] + dev["sampler"] \
            + dev["dequantize"]
        assert dev[f"{phase}_temporaries"] == parts
        assert dev[f"{phase}_total"] == dev["arena"] + parts <= pr.device_budget
    assert S.solve(problem(device_reserve_given=None, gpu_mem=3_000_000)) is None  # the context alone is 1 GB


def test_a_resident_head_leaves_the_dense_slots_to_what_streams():
    """A head ten times the size of every other dense group: kept resident, the two dense
    slots hold the largest group that streams, not the head."""
    big = dataclasses.replace(cost(), head_slot_bytes=10 * cost().dense_slot_bytes)
    pr = problem(cost=big, gpu_mem=big.head_slot_bytes * 3)
    sol = S.solve(pr)
    assert "head" in sol.choice.resident
    streamed = [b for g, b in pr.dense_slot_groups().items() if g not in sol.choice.resident]
    assert sol.device_bytes["dense_slots"] == 2 * max(streamed, default=0) < big.head_slot_bytes
    # the minimum keeps the head once rather than two slots of it
    assert S.minimum_device_bytes(pr) < 2 * big.head_slot_bytes


def test_dequantize_holds_the_materialised_weights_and_fp32_temporaries_of_the_largest():
    assert dequant_device_bytes((0, 0), (0, 0), 2) == 0
    assert dequant_device_bytes((100, 60), (30, 20), 2) == 130 * 2 + DEQUANT_TEMP_BYTES_PER_ELEM * 60


def test_attention_workspace_grows_with_the_micro_batch_and_a_prompt_chunk_squared():
    c = cost()
    assert c.attention_workspace(8, 1, 64, False) == 2 * c.attention_workspace(4, 1, 64, False)
    assert c.attention_workspace(1, 64, 64, True) > c.attention_workspace(1, 32, 64, True) \
        > c.attention_workspace(1, 1, 64, False)


def _layers(tmp: Path, n: int) -> Path:
    """tiny-mixtral's config with `n` layers (config only)."""
    d = tmp / f"tiny-{n}"
    shutil.copytree(TINY, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = n
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_host_buffers_of_a_deep_model_share_two_ping_pong_slots_and_the_rope_table(tmp_path):
    g, _ = graph_before("insert_transfers")  # tiny-mixtral, 1 layer: embed, rope, attention and MoE outputs
    bufs = {n.name: n.attrs for n in g.nodes if n.op == "host_buffer"}
    assert bufs["buf.l0.add_1"]["slot"] == bufs["buf.embed"]["slot"] != bufs["buf.l0.add"]["slot"]
    from moecc.compiler import compile_graph
    from moecc.options import CompileOptions

    deep = compile_graph(_layers(tmp_path, 4), CompileOptions(), stop_after="insert_transfers")
    bufs = [n for n in deep.nodes if n.op == "host_buffer"]
    slots = {n.attrs["slot"] for n in bufs}
    assert len(bufs) == 2 + 2 * 4 and len(slots) == 3  # embed + rope + two per layer -> two ping-pong + rope
    hidden = deep.info.hidden_size * 4  # fp32 rows
    rope = next(n for n in bufs if n.name == "buf.rope").attrs["bytes_per_token"]
    assert model_cost(deep).buffer_bytes_per_token == 2 * hidden + rope


def test_explain_names_every_device_allocation_and_the_context_reserve():
    plan, _ = compile_model(TINY, gpu_mem=10**9 + 4_000_000, hardware="h200", prompt_tokens=16, output_tokens=16,
                            max_batch=64)
    rep = explain(plan)
    text = format_explain(rep)
    for _, label in DEVICE_ROWS:
        assert label in text, label
    assert "context reserve (CUDA context, cuBLAS workspaces)" in text
    assert f"of --gpu-mem {format_bytes(10**9 + 4_000_000)}" in text and "fragmentation margin" in text
    table = {row[0]: row[1:] for row in rep["device_table"]}
    assert table["context reserve (CUDA context, cuBLAS workspaces)"] == (10**9, 10**9)
    assert max(table["process total"]) <= 10**9 + 4_000_000
    assert plan["arena"]["dense_slot_bytes"] * 2 == plan["memory"]["device"]["dense_slots"]


def test_the_runtime_cap_is_a_no_op_on_a_cpu():
    plan = {"memory": {"device": {"gpu_mem": 24 * 10**9, "device_reserve": 10**9}}}
    assert plan_device_budget(plan) == (24 * 10**9, 10**9)
    assert plan_device_budget({"memory": {}}) == (None, 0)
    assert cap_process(plan, torch.device("cpu")) is None
    assert process_device_bytes(torch.device("cpu")) == (None, None)


def test_the_runtime_cap_is_put_back_when_the_engine_closes(monkeypatch):
    """The allocator's share is the process's: the cap an engine set is undone by `uncap`, back to
    what it replaced, so a second engine (or the weights written after it) is not held to the
    first plan's budget (the first device run found this: a tiny plan's cap outlived its engine)."""
    shares: dict[int, float] = {0: 0.5}
    props = type("Props", (), {"total_memory": 100 * 10**9})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: shares.__setitem__(i, f))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i: shares[i], raising=False)
    plan = {"memory": {"device": {"gpu_mem": 24 * 10**9, "device_reserve": 4 * 10**9}}}
    cap = cap_process(plan, torch.device("cuda"))
    assert cap is not None and shares[0] == pytest.approx(0.2) and cap.allocator_bytes == 20 * 10**9
    uncap(cap)
    assert shares[0] == 0.5
    uncap(None)
    assert shares[0] == 0.5


def test_batch_candidates_include_the_largest_batch_host_memory_holds():
    """--host-mem between two powers of two: the largest B it holds (per prefill step offered)
    is tried, and nothing above it."""
    base = problem(host_reserve_given=0, max_batch=1024)
    per_seq = S.host_bytes(base.cost, base.seq_len, 1, 1)["kv_cache"]
    pr = dataclasses.replace(base, host_mem=base.cost.weight_bytes + 300 * per_seq + 10**6)
    limits = S.host_batch_limits(pr)
    assert limits and all(pr.host_fits(B, min(128, B * 24)) for B in limits)
    cands = S.batch_candidates(pr)
    assert set(limits) <= set(cands) and max(cands) == max(limits) and any(B & (B - 1) for B in limits)
    assert not pr.host_fits(max(limits) + 1, 128)
