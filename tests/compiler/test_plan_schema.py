"""The plan schema (moecc_runtime/plan_schema.py): every plan the compiler writes follows it,
and a plan with a missing, unknown or mistyped field, or of another version, is refused with
the field's path and "recompile"."""

from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moecc.compiler import compile_model
from moecc.ir import OPS as IR_OPS
from moecc_runtime import plan_schema as schema
from moecc_runtime.plan import PlanError, load_plan, save_plan


@pytest.fixture(scope="module")
def plan(checkpoints) -> dict:
    p, _ = compile_model(checkpoints("mixtral"), gpu_mem=2_000_000, prompt_tokens=16, output_tokens=8, max_batch=8)
    return p


def _refused(plan: dict, tmp_path: Path) -> str:
    path = tmp_path / "plan.pt"
    save_plan(plan, path)
    with pytest.raises(PlanError) as e:
        load_plan(path)
    return str(e.value)


def test_compiled_plan_follows_the_schema(plan):
    schema.validate(plan)
    assert plan["version"] == schema.SCHEMA_VERSION
    kv = plan["batch"]["kv"]
    assert (kv["heads"], kv["key_dim"], kv["value_dim"]) == (2, 16, 16) and kv["block_size"] == schema.KV_BLOCK_SIZE
    groups = {m["module"]: m["residency_group"] for m in plan["schedule"]}
    assert groups["stem"] is None and groups["head"] == "head" and groups["L0.attn"] == "L0.attn"
    assert groups["L1.moe"] == "L1.dense"
    assert set(plan["arena"]["resident"]) <= {g for g in groups.values() if g} | {"L0.experts", "L1.experts"}


def test_schema_ops_are_the_compilers():
    assert schema.OPS <= set(IR_OPS) and schema.TRANSFER_OPS <= schema.OPS


@pytest.mark.parametrize(("mutate", "where"), [
    (lambda p: p["batch"]["kv"].pop("block_size"), "plan.batch.kv.block_size: missing"),
    (lambda p: p["arena"].update(extra=1), "plan.arena.extra: unknown field"),
    (lambda p: p["batch"]["decode"].update(b_a="8"), "plan.batch.decode.b_a: expected int"),
    (lambda p: p["schedule"][1]["ops"][0].update(op="conv2d"), "plan.schedule[1].ops[0].op: 'conv2d' is not one of"),
    (lambda p: p["weights"][next(iter(p["weights"]))].update(offset=1.5), ".offset: expected int, got float"),
    (lambda p: p["rope"].update(inv_freq=[1.0]), "plan.rope.inv_freq: expected Tensor"),
    (lambda p: p.update(arena=[]), "plan.arena: expected an object"),
    (lambda p: _op(p, "rmsnorm")["attrs"].pop("eps"), ".attrs.eps: missing"),
    (lambda p: _op(p, "host_buffer")["attrs"].update(bytes_per_token="8"), ".attrs.bytes_per_token: expected int"),
    (lambda p: _op(p, "experts")["attrs"].update(colour=1), ".attrs.colour: unknown field"),
    (lambda p: p["batch"]["kv"].update(key_dim=None), "plan.batch.kv.key_dim: expected int"),
    (lambda p: p["model"]["info"].pop("top_k"), "plan.model.info.top_k: missing"),
    (lambda p: p["batch"]["workload"].pop("shared_prefix"), "plan.batch.workload.shared_prefix: missing"),
    (lambda p: p.pop("compiled_with"), "plan.compiled_with: missing"),
])
def test_bad_field_is_named(plan, tmp_path, mutate, where):
    bad = copy.deepcopy(plan)
    mutate(bad)
    msg = _refused(bad, tmp_path)
    assert where in msg and "recompile" in msg


def _op(plan: dict, kind: str) -> dict:
    """The first op of `kind` in the plan's schedule."""
    return next(op for m in plan["schedule"] for op in m["ops"] if op["op"] == kind)


@pytest.mark.parametrize("version", [2, 4])
def test_older_version_is_refused_with_recompile(plan, tmp_path, version):
    """Version 4 plans (shared_prefix under predicted, no compiled_with) are refused too."""
    old = copy.deepcopy(plan)
    old["version"] = version
    msg = _refused(old, tmp_path)
    assert f"version {version}" in msg and "recompile" in msg


def test_every_op_kind_has_an_attrs_record():
    from moecc_runtime.plan_ops import OP_ATTRS

    assert set(OP_ATTRS) == schema.OPS


def test_v5_records_the_workload_prefix_and_the_compile_options(plan):
    assert plan["batch"]["workload"]["shared_prefix"] is None  # compiled without --prompts
    assert "shared_prefix" not in plan["predicted"]
    assert set(plan["compiled_with"]) == set(typing.get_type_hints(schema.CompiledWith))


@settings(max_examples=40, deadline=None)
@given(path=st.lists(st.integers(0, 10_000), min_size=1, max_size=6), junk=st.sampled_from([None, "x", 3, 2.5, [], {}]))
def test_any_replaced_field_is_accepted_only_if_it_still_follows_the_schema(plan, path, junk):
    """Replace one field somewhere in the plan: validate either accepts it, or refuses with a
    SchemaError whose path names a field of the plan (never another exception)."""
    bad = copy.deepcopy(plan)
    node, trail = bad, "plan"
    for i in path:
        keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        if not keys or isinstance(node, torch.Tensor):
            break
        k = keys[i % len(keys)]
        child = node[k]
        if not isinstance(child, (dict, list)) or not child:
            node[k] = junk
            break
        node = child
    try:
        schema.validate(bad)
    except schema.SchemaError as e:
        assert e.path.startswith(trail)


def test_model_info_and_kv_geometry_are_defined_once(plan):
    """The compiler's ModelInfo is the schema's (the contract's dataclass), and the runtime's
    typed plan reads model.info and batch.kv into those same classes."""
    from moecc.ir import ModelInfo
    from moecc_runtime.contract.plan_types import PlanView
    from moecc_runtime.memory import kv

    assert ModelInfo is schema.ModelInfo and kv.KVGeometry is schema.KVGeometry
    view = PlanView.of(plan)
    assert dataclasses.asdict(view.info) == plan["model"]["info"]
    assert dataclasses.asdict(view.kv) == plan["batch"]["kv"]
    assert [op.name for m in view.schedule for op in m.ops] == [op["name"] for m in plan["schedule"] for op in m["ops"]]
