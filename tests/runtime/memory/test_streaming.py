"""Weight and KV streaming through the device arena (runtime/memory/arena.py, copy_engine.py,
streaming.py): plans compiled with a --gpu-mem below the model's weights stream every
non-resident module and expert through slots, and the output stays token-identical to
transformers; the arena never exceeds --gpu-mem; experts no token chose are never fetched, and
the routed ones go on the copy engine's urgent lane; a failed fetch names the tensor and keeps
every result already written."""

from __future__ import annotations

import json

import pytest
import torch

from moecc.compiler import compile_model
from moecc_runtime.job.exec import run_job
from moecc_runtime.contract import speculation
from moecc_runtime.memory import streaming
from moecc_runtime.memory.arena import ArenaError, DeviceArena
from moecc_runtime.memory.copy_engine import CopyEngine, CopyError
from moecc_runtime.memory.weights import WeightError, WeightStore
from moecc_runtime.plan import save_plan
from moecc_runtime.scheduler.sequence import GenRequest

from tests.e2e.test_equivalence import hf_models  # noqa: F401  (a fixture)
from tests.runtime.scheduler.test_refill import (Run, check_against_transformers, eos, mixtral, reference,  # noqa: F401  (fixtures)
                         requests)

# the tiny Mixtral's weights are 1.48 MB; its minimum working set is 0.67 MB (KV buffers for
# its 512-token context, staging, one expert slot pair and two dense slots)
BUDGETS = [700_000, 1_100_000]


def compile_streamed(path, gpu_mem: int):
    plan, _ = compile_model(path, prompt_tokens=24, output_tokens=8, max_batch=4, gpu_mem=gpu_mem)
    return plan


class Spy:
    """Records what StreamedWeights fetches: (step, unit) per transfer submitted."""

    def __init__(self, monkeypatch):
        self.units: list[tuple[int, object]] = []
        self.lanes: list[tuple[object, str]] = []  # (unit, copy lane) per transfer submitted
        self.step = 0
        real = streaming.StreamedWeights._submit_unit
        spy = self

        def submit(self_, pool, unit, keys, what, layer, lane="normal"):
            spy.units.append((spy.step, unit))
            spy.lanes.append((unit, lane))
            return real(self_, pool, unit, keys, what, layer, lane)

        monkeypatch.setattr(streaming.StreamedWeights, "_submit_unit", submit)


@pytest.mark.parametrize("gpu_mem", [BUDGETS[0], pytest.param(BUDGETS[1], marks=pytest.mark.slow)])
def test_streamed_plan_matches_transformers(mixtral, reference, eos, gpu_mem, monkeypatch):  # noqa: F811
    path, _, prompts = mixtral
    plan = compile_streamed(path, gpu_mem)
    lay = plan["arena"]
    assert lay is not None and lay["bytes"] <= gpu_mem
    groups = {f"L{i}.{k}" for i in range(2) for k in ("attn", "dense", "experts")} | {"head"}
    assert set(lay["resident"]) < groups, "the budget must force some weights to stream"
    spy = Spy(monkeypatch)
    reqs = requests(prompts)
    run = Run(plan, path, reqs, eos, kv_blocks=64)
    check_against_transformers(run, reqs, reference, eos)
    st = run.engine.stats
    assert 0 < st.peak_device_bytes <= st.arena_bytes <= gpu_mem
    assert st.copy_bytes > 0 and st.copy_seconds > 0
    assert st.overlap_efficiency is not None and 0.0 <= st.overlap_efficiency <= 1.0
    assert set(st.arena_usage) == {"resident", "dense_slots", "expert_slots", "kv_buffers", "stage"}
    experts = [u for _, u in spy.units if isinstance(u, tuple)]
    if "L0.experts" not in lay["resident"]:
        assert experts, "streamed experts must be fetched"


@pytest.mark.slow
def test_only_chosen_experts_are_fetched(mixtral, eos, monkeypatch):  # noqa: F811
    """Per layer and step, the experts fetched are a subset of those routed to (spied on the
    kernel's fetch list), and never more than once (fetching ahead of routing turned off)."""
    monkeypatch.setattr(speculation, "SPECULATE_ROUTED_PER_EXPERT", 10**9)
    path, _, prompts = mixtral
    plan = compile_streamed(path, BUDGETS[0])
    assert not any(g.endswith(".experts") for g in plan["arena"]["resident"])
    routed: list[set[tuple[str, int]]] = []
    real = streaming.StreamedWeights.experts

    def experts(self, name, used):
        routed.append({(name, e) for e in used})
        fetched_before = len(spy.units)
        yield from real(self, name, used)
        got = [u for _, u in spy.units[fetched_before:] if isinstance(u, tuple)]
        assert set(got) <= routed[-1] and len(got) == len(set(got)), (got, routed[-1])
        fetched.extend(got)

    fetched: list = []
    spy = Spy(monkeypatch)
    monkeypatch.setattr(streaming.StreamedWeights, "experts", experts)
    Run(plan, path, requests(prompts)[:4], eos, kv_blocks=64)
    assert fetched and routed
    assert sum(len(r) for r in routed) >= len(fetched)
    # routed experts on the urgent copy lane, dense modules on the normal one (behind KV gathers)
    assert {lane for u, lane in spy.lanes if isinstance(u, tuple)} == {"urgent"}
    assert {lane for u, lane in spy.lanes if isinstance(u, int)} <= {"normal"}


@pytest.mark.slow
def test_experts_fetched_ahead_of_routing_keep_results(mixtral, reference, eos, monkeypatch):  # noqa: F811
    """Steps with rows x top_k >= 4 x experts fetch a layer's first experts during its
    attention, before the router: the output stays token-identical to transformers, and per
    experts op no more than the slots' worth beyond the routed experts is fetched."""
    path, _, prompts = mixtral
    plan = compile_streamed(path, BUDGETS[0])
    assert not any(g.endswith(".experts") for g in plan["arena"]["resident"])
    spy = Spy(monkeypatch)
    calls: list[str] = []
    real_spec, real_experts = streaming.StreamedWeights.speculate, streaming.StreamedWeights.experts
    ahead: list[int] = []  # experts fetched ahead per speculate call
    taken: list[int] = []  # per experts call after one: routed experts it did not fetch itself

    def speculate(self, name):
        before = len(spy.units)
        real_spec(self, name)
        calls.append(name)
        ahead.append(len(spy.units) - before)

    def experts(self, name, used):
        spec = name in self._spec
        before = len(spy.units)
        yield from real_experts(self, name, used)
        got = [u[1] for _, u in spy.units[before:] if isinstance(u, tuple) and u[0] == name]
        assert len(got) == len(set(got)) and set(got) <= set(used)
        if spec:
            taken.append(len(used) - len(got))

    monkeypatch.setattr(streaming.StreamedWeights, "speculate", speculate)
    monkeypatch.setattr(streaming.StreamedWeights, "experts", experts)
    reqs = requests(prompts)
    run = Run(plan, path, reqs, eos, kv_blocks=64)
    check_against_transformers(run, reqs, reference, eos)
    assert calls, "prompt steps route enough rows to fetch experts ahead"
    slots = plan["arena"]["expert_slots"]
    assert 0 < max(ahead) <= slots
    assert taken and min(taken) > 0  # what was fetched ahead was taken over, not fetched again
    assert all(streaming.speculates(r, 2, 8) == (r >= 16) for r in (1, 15, 16, 400))


def test_no_budget_means_no_arena(mixtral):  # noqa: F811
    plan, _ = compile_model(mixtral[0], prompt_tokens=24, output_tokens=8, max_batch=4)
    assert plan["arena"] is None


@pytest.mark.slow
def test_failed_fetch_names_the_tensor_and_keeps_written_results(mixtral, tmp_path, monkeypatch):  # noqa: F811
    """A weight that cannot be read mid-job (here: the third fetch of one expert raises)
    stops the job with an error naming the tensor; the results written before remain."""
    path, _, prompts = mixtral
    plan = compile_streamed(path, BUDGETS[0])
    plan_path = tmp_path / "plan.pt"
    save_plan(plan, plan_path)
    lines = [json.dumps({"custom_id": f"q{i}", "prompt": p, "max_tokens": 6})
             for i, p in enumerate(["alpha beta", "gamma delta epsilon", "one two", "the cat sat"] * 4)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    victim = next(k for k in plan["weights"] if ".mlp_experts.e" in k and k.endswith(".down"))
    real = WeightStore.host
    calls = {"n": 0}

    def host(self, key):
        if key == victim:
            calls["n"] += 1
            if calls["n"] >= 6:
                raise WeightError(f"weight {key}: simulated read failure")
        return real(self, key)

    monkeypatch.setattr(WeightStore, "host", host)
    out = tmp_path / "out.jsonl"
    with open(out, "w") as f, pytest.raises((CopyError, WeightError), match=victim.replace(".", r"\.")):
        run_job(plan_path, tmp_path / "in.jsonl", f, max_batch=2, log=None)
    done = [json.loads(x) for x in out.read_text().splitlines()]
    assert done, "requests finished before the failure must stay in the results file"
    assert all(d["custom_id"].startswith("q") and d["token_ids"] for d in done)


def test_arena_regions_are_bounded():
    arena = DeviceArena(4096, "cpu")
    r = arena.region("a", 1000)  # rounded up to 1024
    assert r.nbytes == 1024 and arena.carved_bytes == 1024
    t = r.view(256, (4, 8), torch.float32)
    assert t.shape == (4, 8) and r.high == 256 + 128
    with pytest.raises(ArenaError, match="region 'a'"):
        r.view(512, (200, 4), torch.float32)
    with pytest.raises(ArenaError, match="region 'b' needs 4096 B"):
        arena.region("b", 4096)
    assert arena.peak_bytes == 384


def test_copy_engine_writes_into_the_workers_inference_tensors():
    """The worker runs under torch.inference_mode, which is thread-local: buffers it makes there
    are inference tensors, and the copy threads must be in the same mode to write them (the
    first CUDA run failed here: "Inplace update to inference tensor outside InferenceMode")."""
    with torch.inference_mode():
        dst = torch.zeros(8)  # made where the worker makes its staging buffers
    eng = CopyEngine(torch.device("cpu"))
    try:
        eng.submit("a staging buffer", 32, lambda: dst.copy_(torch.arange(8.0))).wait()
        assert torch.equal(dst, torch.arange(8.0))
    finally:
        eng.close()


def test_a_closed_arena_gives_its_memory_back_though_views_remain():
    arena = DeviceArena(4096, "cpu")
    view = arena.region("a", 1024).view(0, (16,), torch.float32)
    arena.close()
    assert arena.base.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0


def test_copy_engine_reports_failure_with_what_was_copied():
    eng = CopyEngine(torch.device("cpu"))
    try:
        ok = eng.submit("fine", 8, lambda: None)

        def boom():
            raise OSError("disk went away")

        bad = eng.submit("expert 3 of l0.mlp_experts", 16, boom)
        ok.wait()
        with pytest.raises(CopyError, match="expert 3 of l0.mlp_experts.*disk went away"):
            bad.wait()
        assert eng.copies == 1 and eng.bytes == 8
    finally:
        eng.close()


@pytest.mark.slow
def test_max_batch_above_the_arena_plan_is_refused_before_running(mixtral, tmp_path):  # noqa: F811
    """The arena's staging is sized for the plan's B: a larger --max-batch fails at once,
    saying what to recompile, instead of overflowing mid-job."""
    from moecc_runtime.plan import PlanError

    plan = compile_streamed(mixtral[0], BUDGETS[1])
    path = tmp_path / "plan.pt"
    save_plan(plan, path)
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "a b"}) + "\n")
    B = plan["batch"]["decode"]["B"]
    with open(tmp_path / "out.jsonl", "w") as f, pytest.raises(PlanError, match=f"--max-batch {B + 1} exceeds"):
        run_job(path, tmp_path / "in.jsonl", f, max_batch=B + 1, log=None)
    with open(tmp_path / "out.jsonl", "w") as f:
        assert run_job(path, tmp_path / "in.jsonl", f, max_batch=B, log=None).succeeded == 1


@pytest.mark.slow
def test_gpt_oss_streamed_through_slots_matches_transformers(checkpoints, hf_models):  # noqa: F811
    """gpt-oss's experts (four tensors each: gate_up, its bias, down, its bias) and its
    attention with sinks stream through the arena's slots and stay token-identical."""
    from tests.e2e.test_equivalence import NEW_TOKENS, _prompts, _reference, _run_moecc

    path = checkpoints("gpt_oss", "per_expert")
    model, tok = hf_models(path)
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    plan, _ = compile_model(path, prompt_tokens=24, output_tokens=8, max_batch=4, gpu_mem=int(weights * 0.8))
    lay = plan["arena"]
    assert lay is not None and not {"L0.experts", "L1.experts"} <= set(lay["resident"])
    reqs = [GenRequest(str(i), tok(p)["input_ids"], NEW_TOKENS) for i, p in enumerate(_prompts(6))]
    got = _run_moecc(plan, path, reqs, max_batch=4)
    for r in reqs:
        assert got[r.key].token_ids == _reference(model, r.prompt_ids, NEW_TOKENS)[0], r.key
