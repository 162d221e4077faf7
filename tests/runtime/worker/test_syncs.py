"""Host reads of compute-device tensors, counted per step through the one helper that makes
them (runtime/syncs.py; issue 29, item 4): a decode step reads the device once for its tokens
(site "sample") and once per MoE layer for the experts' row counts (site "route"), and nothing
else; and no module of the step's path reads a tensor back any other way."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from moecc.compiler import compile_model
from moecc_runtime.engine import Engine, generate
from moecc_runtime.scheduler.sequence import GenRequest
from moecc_runtime.syncs import HostReads

RUNTIME = Path(__file__).resolve().parent.parent.parent.parent / "runtime"
ALLOWED = {"sample", "route"}


def _steps(plan, mdir, requests) -> list[Counter]:
    engine = Engine(plan, mdir)
    per_step: list[Counter] = []
    try:
        with HostReads() as reads:
            last = Counter()

            def on_step(_tokens: int, _running: int) -> None:
                nonlocal last
                now = reads.snapshot()
                per_step.append(now - last)
                last = now

            generate(engine, requests, lambda r: None, on_step=on_step)
    finally:
        engine.close()
    return per_step


def test_a_step_reads_the_device_once_for_tokens_and_once_per_moe_layer(checkpoints) -> None:
    mdir = checkpoints("mixtral")
    plan, _ = compile_model(mdir, prompt_tokens=8, output_tokens=4, max_batch=8)
    moe_layers = sum(1 for m in plan["schedule"] for op in m["ops"] if op["op"] == "experts")
    reqs = [GenRequest(f"r{i}", [1 + i, 2, 3, 4], 4, temperature=0.7 if i % 2 else 0.0, seed=i, logprobs=2)
            for i in range(4)]
    steps = _steps(plan, mdir, reqs)
    assert len(steps) == 4  # one prefill step, three decode steps
    for n, c in enumerate(steps):
        assert set(c) <= ALLOWED, f"step {n}: host reads at {sorted(set(c) - ALLOWED)}"
        assert c["sample"] == 1, f"step {n}: {c['sample']} reads for the sampled tokens and logprobs"
        assert c["route"] == moe_layers, f"step {n}: {c['route']} routing reads for {moe_layers} MoE layers"


#: what may read a tensor back without syncs.to_host, and why (file: pattern on that line)
_HOST_ONLY = {
    "worker/host_attention.py": ['q.to("cpu")', 'sinks.to("cpu")'],  # a CPU-only run; the sinks once per op
    "worker/worker.py": ['x.to("cpu")'],  # host buffers written from a CPU run (CUDA: DeviceToHost)
    "sampling/draw_rows.py": ["rows.tolist()"],  # the native pass: it runs on host tensors only
}


def test_no_other_host_read_in_the_step_path() -> None:
    """The worker, the engine and the sampler read device tensors only through syncs.to_host
    (a new `.tolist()`, `.item()` or `.cpu()` there must either go through it or be listed above)."""
    pattern = re.compile(r"\.(tolist|item|cpu)\(\)|\.to\(\"cpu\"\)")
    files = [RUNTIME / "engine.py", *sorted((RUNTIME / "worker").glob("*.py")), *sorted((RUNTIME / "sampling").glob("*.py"))]
    found = []
    for f in files:
        rel = str(f.relative_to(RUNTIME))
        for no, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if pattern.search(code) and not any(ok in code for ok in _HOST_ONLY.get(rel, [])):
                found.append(f"{rel}:{no}: {line.strip()}")
    assert not found, "host reads outside syncs.to_host:\n" + "\n".join(found)
