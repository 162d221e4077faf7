"""The module-level graph as ONNX (`moecc compile --dump-format txt,onnx`): every dump passes
onnx.checker, and the node count, roles and attributes round-trip."""

from __future__ import annotations

import json

import onnx
import pytest

from moecc.compiler import compile_model
from moecc.views.onnx_export import DOMAIN, graph_to_onnx, onnx_roles


def test_onnx_dumps_after_every_pass_check_and_round_trip(checkpoints, tmp_path):
    path = checkpoints("mixtral", "per_expert")
    plan, g = compile_model(path, gpu_mem=900_000, max_batch=4, prompt_tokens=24, output_tokens=8,
                            dump_dir=tmp_path, dump_formats=("txt", "onnx"))
    onnx_files = sorted(tmp_path.glob("*.onnx"))
    assert [p.stem for p in onnx_files] == [p.stem for p in sorted(tmp_path.glob("*.txt"))]
    for p in onnx_files:
        m = onnx.load(str(p))
        onnx.checker.check_model(m)
        assert m.doc_string.startswith(f"# {p.stem[:3]} made by pass ")
    last = onnx.load(str(onnx_files[-1]))
    nodes = [n for n in g.nodes if n.op not in ("input", "output")]
    back = onnx_roles(last)
    assert list(back) == [n.name for n in nodes]
    for n in nodes:
        r = back[n.name]
        assert r["role"] == n.role and r["flops_per_token"] == n.flops_per_token
        assert r.get("layer") == n.layer and r.get("module") == n.module
        assert r["weight_bytes"] == n.weight_bytes and json.loads(r["shape"]) == [str(d) if not isinstance(d, int)
                                                                                  else d for d in n.shape]
        for k, v in n.attrs.items():
            if isinstance(v, (int, str)) and not isinstance(v, bool):
                assert r[f"attr.{k}"] == v, (n.name, k)
    attn = next(n for n in nodes if n.op == "attention")
    experts = next(n for n in nodes if n.op == "experts")
    assert back[attn.name]["batch.decode.b_a"] == plan["batch"]["decode"]["b_a"]
    assert back[experts.name]["batch.prefill.b_e"] == plan["batch"]["prefill"]["b_e"]
    assert back[experts.name]["batch.decode.B"] == plan["batch"]["decode"]["B"]
    resident = set(plan["arena"]["resident"])
    assert back[experts.name]["device"] == ("device, resident" if "L0.experts" in resident else "device, streamed")
    assert {back[n.name]["device"] for n in nodes if n.role == "transfer"} <= {"copy engine (h2d)", "copy engine (d2h)"}
    assert back["embed"]["device"] == "host"
    first = onnx_roles(onnx.load(str(onnx_files[0])))  # before solving: no batch sizes yet
    assert not any(k.startswith("batch.") for r in first.values() for k in r)
    kinds = {n.op_type for n in last.graph.node if n.domain == DOMAIN}
    assert {"Attention", "Router", "Experts", "HostBuffer", "FetchExperts", "KVLoad"} <= kinds
    props = {p.key: p.value for p in last.metadata_props}
    assert json.loads(props["graph.batch"])["decode"]["B"] == plan["batch"]["decode"]["B"]


def test_unknown_dump_format_is_refused(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="unknown format"):
        compile_model(checkpoints("mixtral", "per_expert"), dump_dir=tmp_path, dump_formats=("txt", "png"))


def test_gpt_oss_graph_exports(checkpoints):
    _, g = compile_model(checkpoints("gpt_oss", "per_expert"))
    m = graph_to_onnx(g)
    onnx.checker.check_model(m)
    attn = [n for n in m.graph.node if n.op_type == "Attention"]
    windows = [onnx_roles(m)[n.name].get("attr.sliding_window") for n in attn]
    assert windows == [8, None]
