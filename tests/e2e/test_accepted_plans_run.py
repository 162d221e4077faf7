"""Every plan the compiler accepts runs (issue 20): a property test over families x shapes
(dimensions that are not multiples of 64, odd vocabularies, 1-4 layers, 2-6 experts) x
budgets from the stated minimum (what `--gpu-mem` / `--host-mem` errors name) up to all
resident. Each accepted plan execs through the real job path, gives the unbudgeted plan's
greedy tokens, keeps the arena's measured peak within --gpu-mem, and fails no request; and
the planner's full device accounting holds against what the run really used: each arena
region within the bytes the plan gave it, every step's temporaries (each storage an op
allocates during the step, host buffers and host attention aside: on a GPU they are host
memory, on this CPU the same RAM) within the
phase's planned temporaries, and arena + temporaries + device reserve within --gpu-mem."""

from __future__ import annotations

import io
import os
import json
import re
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import pytest
import pytest
import pytest
import pytest
import pytest
import pytest
import pytest
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from moecc.compiler import compile_model
from moecc.errors import BudgetError, PassError
from moecc.sizes import parse_size
from moecc.testing.checkpoints import write_checkpoint
from moecc_runtime.job.exec import run_job
from moecc_runtime.plan import save_plan

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v2", "gpt_oss")
PROMPTS = ["The cat sat on", "def main():", "Once upon a time, far away"]
WORKLOAD = dict(prompt_tokens=16, output_tokens=8, max_batch=4)


pytestmark = pytest.mark.slow  # the whole file


@st.composite
def shapes(draw) -> tuple[str, dict]:
    """A family and config overrides of an odd-sized model of that family."""
    family = draw(st.sampled_from(FAMILIES))
    hidden = draw(st.sampled_from((24, 40, 56, 72, 96)))
    heads = draw(st.sampled_from((2, 4)))
    layers = draw(st.integers(1, 4))
    experts = draw(st.integers(2, 6))
    o: dict = {"hidden_size": hidden, "num_hidden_layers": layers, "num_experts_per_tok": draw(st.integers(1, 2)),
               "vocab_size": draw(st.sampled_from((301, 517, 700))), "intermediate_size": draw(st.sampled_from((40, 72, 100))),
               "num_attention_heads": heads}
    expert_key = {"mixtral": "num_local_experts", "gpt_oss": "num_local_experts",
                  "deepseek_v2": "n_routed_experts"}.get(family, "num_experts")
    o[expert_key] = experts
    if family in ("qwen3_moe", "qwen2_moe"):
        o["moe_intermediate_size"] = draw(st.sampled_from((24, 36)))
        o["mlp_only_layers"] = [1] if layers > 1 else []
    if family == "gpt_oss":
        o["head_dim"] = draw(st.sampled_from((12, 20)))
    if family != "deepseek_v2":
        o["num_key_value_heads"] = draw(st.sampled_from((1, heads)))
    if family == "deepseek_v2":
        o.update(num_key_value_heads=heads, moe_intermediate_size=draw(st.sampled_from((24, 36))),
                 first_k_dense_replace=1 if layers > 1 else 0, n_group=1, topk_group=1,
                 kv_lora_rank=draw(st.sampled_from((12, 20))), qk_rope_head_dim=8, qk_nope_head_dim=12,
                 v_head_dim=12)
    if family == "gpt_oss":
        o["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
    return family, o


def stated_minimum(ckpt: Path, flag: str, **budgets) -> int:
    """The `flag` budget the compiler's refusal of `budgets` (the flag's at 1 byte) names."""
    try:
        compile_model(ckpt, **WORKLOAD, **budgets)
    except (BudgetError, PassError) as e:
        m = re.search(re.escape(flag) + r" ([0-9.]+[KMGT]?B) or more", str(e))
        assert m, f"the refusal names no minimum {flag}: {e}"
        return parse_size(m.group(1))
    raise AssertionError(f"a 1-byte {flag} was accepted")


class StepAllocations(TorchDispatchMode):
    """Every storage an op allocates while on (views and in-place writes excluded: their
    storage is an input's), in order: (pointer, bytes) when made, (pointer, -bytes) when its
    tensor is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []
        self._live: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
            if n and ptr not in inputs and ptr not in self._live:
                self._live[ptr] = n
                self.events.append((ptr, n))
                weakref.finalize(t, self._free, ptr)
        return out

    def _free(self, ptr: int) -> None:
        n = self._live.pop(ptr, 0)
        if n:
            self.events.append((ptr, -n))

    def peak(self, excluded: set[int]) -> int:
        """The most bytes live at once, storages at `excluded` pointers left out."""
        live = top = 0
        for ptr, n in self.events:
            if ptr not in excluded:
                live += n
                top = max(top, live)
        return top


@contextmanager
def step_temporaries() -> Iterator[list[tuple[str, int]]]:
    """Per step the worker executes: (phase, peak bytes of its temporaries), host buffers and
    host attention (host memory on a GPU) aside."""
    from moecc_runtime.worker import host_attention as HA
    from moecc_runtime.worker import worker as W

    steps: list[tuple[str, int]] = []
    original, on_host = W.Worker.execute, HA.HostAttention.forward

    def host_attention(self, *args, **kwargs):
        with _disable_current_modes():  # its temporaries are the host's
            return on_host(self, *args, **kwargs)

    def execute(self, sp):
        mode = StepAllocations()
        with mode:
            out = original(self, sp)
        host = {b.untyped_storage().data_ptr() for b in self._host_bufs.values()}
        steps.append((sp.phase, mode.peak(host)))
        return out

    W.Worker.execute, HA.HostAttention.forward = execute, host_attention
    try:
        yield steps
    finally:
        W.Worker.execute, HA.HostAttention.forward = original, on_host


def check_device_accounting(plan: dict, stats: dict, steps: list[tuple[str, int]], gpu_mem: int) -> None:
    """The plan's device bytes against what the run used (see the module docstring)."""
    dev, eng = plan["memory"]["device"], stats["engine"]
    planned = {"resident": dev["resident_weights"], "dense_slots": dev["dense_slots"],
               "expert_slots": dev["expert_slots"], "kv_buffers": dev["kv_buffers"], "stage": dev["staging"]}
    for region, used in eng["arena_usage"].items():
        assert used <= planned[region], f"arena region {region}: {used} B used, {planned[region]} B planned"
    assert steps, "no step ran"
    for phase, used in steps:
        assert used <= dev[f"{phase}_temporaries"], \
            f"a {phase} step's temporaries took {used} B, the plan counts {dev[f'{phase}_temporaries']} B"
    for phase in ("decode", "prefill"):
        assert dev[f"{phase}_total"] <= dev["budget"] and dev[f"{phase}_total"] + dev["device_reserve"] <= gpu_mem
    worst = max(eng["peak_device_bytes"] + used for _, used in steps)
    assert worst + dev["device_reserve"] <= gpu_mem, f"arena peak + step temporaries {worst} B > --gpu-mem {gpu_mem}"


def execute(plan: dict, ckpt: Path, tmp: Path, name: str) -> tuple[list[list[int]], dict]:
    """Greedy token ids per prompt and the job's stats, through the real exec path."""
    plan_path, prompts, stats = tmp / f"{name}.pt", tmp / "prompts.jsonl", tmp / f"{name}.stats.json"
    save_plan(plan, plan_path)
    prompts.write_text("".join(json.dumps({"custom_id": str(i), "prompt": p, "max_tokens": 6}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    out = io.StringIO()
    summary = run_job(plan_path, prompts, out, model_dir=ckpt, log=None, stats_path=stats, device="cpu")
    assert summary.failed == 0, summary.errors
    rows = {r["custom_id"]: r["token_ids"] for r in map(json.loads, out.getvalue().splitlines())}
    return [rows[str(i)] for i in range(len(PROMPTS))], json.loads(stats.read_text())


@settings(max_examples=int(os.environ.get("MOECC_PROPERTY_EXAMPLES", "16")), deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.generate))
@given(shape=shapes(), gpu_frac=st.floats(0.0, 1.0), host_frac=st.one_of(st.none(), st.floats(0.0, 1.0)))
def test_every_accepted_plan_runs_within_budget_and_matches(tmp_path_factory, shape, gpu_frac, host_frac):
    family, overrides = shape
    tmp = tmp_path_factory.mktemp(family)
    ckpt = write_checkpoint(tmp / "ckpt", family, **overrides)
    weights = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    base_plan, _ = compile_model(ckpt, **WORKLOAD)
    expected, _ = execute(base_plan, ckpt, tmp, "unbudgeted")

    lo = stated_minimum(ckpt, "--gpu-mem", gpu_mem=1)
    gpu_mem = int(lo + gpu_frac * 2 * weights)  # up to all resident (and beyond)
    host = {}
    if host_frac is not None:
        hlo = stated_minimum(ckpt, "--host-mem", gpu_mem=gpu_mem, host_mem=1, host_reserve=0)
        host = {"host_mem": int(hlo + host_frac * 4 * weights), "host_reserve": 0}
    plan, _ = compile_model(ckpt, **WORKLOAD, gpu_mem=gpu_mem, **host)  # the stated minimum is accepted
    with step_temporaries() as steps:
        tokens, stats = execute(plan, ckpt, tmp, "budgeted")
    assert tokens == expected, f"{family} {overrides} at --gpu-mem {gpu_mem}: tokens differ from the unbudgeted plan"
    peak = stats["engine"]["peak_device_bytes"]
    assert 0 < peak <= gpu_mem, f"peak device bytes {peak} > --gpu-mem {gpu_mem}"
    assert stats["engine"]["arena_bytes"] <= gpu_mem
    check_device_accounting(plan, stats, steps, gpu_mem)
