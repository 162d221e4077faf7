"""The plan schema (moecc_runtime/plan_schema.py): every plan the compiler writes follows it,
and a plan with a missing, unknown or mistyped field, or of another version, is refused with
the field's path and "recompile"."""

from __future__ import annotations

import copy
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
])
def test_bad_field_is_named(plan, tmp_path, mutate, where):
    bad = copy.deepcopy(plan)
    mutate(bad)
    msg = _refused(bad, tmp_path)
    assert where in msg and "recompile" in msg


def test_older_version_is_refused_with_recompile(plan, tmp_path):
    old = copy.deepcopy(plan)
    old["version"] = 2
    msg = _refused(old, tmp_path)
    assert "version 2" in msg and "recompile" in msg


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


def test_compiler_model_info_is_the_schemas():
    """The compiler's ModelInfo dataclass is what the plan's model.info holds: same fields,
    same types (the schema's TypedDict is the contract; this keeps the two from drifting)."""
    import dataclasses
    import typing

    from moecc.ir import ModelInfo

    hints = typing.get_type_hints(ModelInfo)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(ModelInfo)}
    assert fields == typing.get_type_hints(schema.ModelInfo)
