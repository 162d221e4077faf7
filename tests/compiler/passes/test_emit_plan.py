"""emit_plan: the plan is plain data, its schedule follows the graph, and every manifest
entry reads exactly the bytes of the parameter it names (numeric check, both layouts)."""

import io

import pytest
import torch

from moecc.compiler import compile_model
from moecc_runtime.memory.weights import WeightStore
from moecc_runtime.plan import SCHEMA_VERSION

from tests.compiler.passes.util import check_golden, run_pass


def _summary(plan) -> str:
    lines = [f"schema {plan['schema']} v{plan['version']}", f"batch {plan['batch']['decode']}"]
    for m in plan["schedule"]:
        ops = ", ".join(f"{op['op']}:{op['name']}" for op in m["ops"])
        lines.append(f"{m['module']} ({m['kind']}): {ops}")
    for key in sorted(plan["weights"])[:6]:
        e = plan["weights"][key]
        lines.append(f"{key} -> {e['tensor']} index={e['index']} rows={e['rows']} {e['shape']} {e['dtype']}")
    return "\n".join(lines) + "\n"


def test_emit_plan_golden():
    _, result = run_pass("emit_plan")
    check_golden("emit_plan", _summary(result.graph.attrs["plan"]))


def test_plan_is_plain_data_loadable_with_weights_only():
    _, result = run_pass("emit_plan")
    buf = io.BytesIO()
    torch.save(result.graph.attrs["plan"], buf)
    buf.seek(0)
    plan = torch.load(buf, weights_only=True)
    assert plan["schema"] == "moecc.plan" and plan["version"] == SCHEMA_VERSION
    assert [m["module"] for m in plan["schedule"]] == ["stem", "L0.attn", "L0.moe", "head"]
    assert all(e["file"] is None for e in plan["weights"].values())  # config-only checkpoint


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_manifest_reads_the_exact_parameters(family, checkpoints):
    from transformers import AutoModelForCausalLM

    per, fused = checkpoints(family, "per_expert"), checkpoints(family, "fused")
    model = AutoModelForCausalLM.from_pretrained(str(per), dtype=torch.float32)
    params = dict(model.named_parameters())
    for path in (per, fused):
        plan, _ = compile_model(path)
        store = WeightStore(plan["weights"], path, torch.device("cpu"))
        try:
            checked = 0
            for key, e in plan["weights"].items():
                if e["tensor"] not in params:
                    continue  # a per-expert checkpoint name: checked by key below
                ref = params[e["tensor"]]
                if e["index"] is not None:
                    ref = ref[e["index"]]
                if e["rows"] is not None:
                    ref = ref[e["rows"][0]:e["rows"][1]]
                torch.testing.assert_close(store.host(key), ref.detach(), rtol=0, atol=0)
                checked += 1
            assert checked > 0
            # per-expert layout: expert 3's gate/up/down equal slices of HF's fused parameters
            prefix = "l0.mlp_experts"
            fused_gu = params["model.layers.0.mlp.experts.gate_up_proj"][3]
            inter = fused_gu.shape[0] // 2
            torch.testing.assert_close(store.host(f"{prefix}.e3.gate"), fused_gu[:inter].detach(), rtol=0, atol=0)
            torch.testing.assert_close(store.host(f"{prefix}.e3.up"), fused_gu[inter:].detach(), rtol=0, atol=0)
            torch.testing.assert_close(store.host(f"{prefix}.e3.down"),
                                       params["model.layers.0.mlp.experts.down_proj"][3].detach(), rtol=0, atol=0)
        finally:
            store.close()
