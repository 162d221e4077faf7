"""The GPU path as offloading needs it, checked on the CPU (no GPU here or in CI):

* values between device modules stay in the arena's staging area (`keep_on_device`, the
  default on CUDA only): the same tokens and bit-identical logits as the host-buffer round
  trip, with host, device and split attention, steps switching between the two, and only
  the first step (which learns the row shapes) writing host buffers;
* which values may stay, and that they fit the plan's staging area;
* the KV pool is pageable on every device (nothing DMAs from it: KV goes through pinned
  staging); asked to pin, it registers K and V in place and falls back to pageable memory
  with a warning when pinning fails;
* a plan without a device arena is refused on CUDA (runtime), and `moecc exec` recompiles it
  in memory for the device's free memory (the free-memory query replaced).

The CUDA-only code itself (streams, events, pinned copies) needs a GPU:
bench/gpu_offload_check.py runs it when one is lent.
"""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path

import pytest
import torch

from moecc.compiler import compile_model
from moecc_runtime.engine import Engine, generate
from moecc_runtime.memory import pinned
from moecc_runtime.contract.kv_geometry import KVGeometry
from moecc_runtime.memory.kv import KVPool
from moecc_runtime.plan import PlanError, load_plan, save_plan
from moecc_runtime.scheduler.sequence import GenRequest
from moecc_runtime.contract.plan_types import Module, Op, PlanView
from moecc_runtime.worker.worker import Worker, _assign_slots, _device_slots

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BUDGET = 1_100_000  # the tiny Mixtral streams some weights through slots under this --gpu-mem


def _compile(path: Path, **kw):
    # `attention` (--attention) is new in the compiler; older ones place attention themselves
    if "attention" in kw and "attention" not in inspect.signature(compile_model).parameters:
        kw.pop("attention")
    plan, _ = compile_model(path, prompt_tokens=24, output_tokens=8, max_batch=4, **kw)
    return plan


@pytest.fixture(scope="module")
def tiny(checkpoints):
    path = checkpoints("mixtral", "per_expert")
    return path, _compile(path, gpu_mem=BUDGET, attention="device")


def _requests() -> list[GenRequest]:
    rng = random.Random(0)
    return [GenRequest(f"r{i}", [rng.randrange(3, 200) for _ in range(rng.randint(3, 30))], 6) for i in range(7)]


def _run(plan, path, keep: bool, attention: str | None = None, share: float | None = None, patch=None):
    eng = Engine(plan, path, "cpu", expert_chunk=3, attn_micro_batch=2, attention=attention, keep_on_device=keep)
    if share is not None:  # a split: this share of each step's sequences attend on the host
        eng.worker._host_share = {"decode": share, "prefill": share}
    if patch is not None:
        patch(eng.worker)
    w, real = eng.worker, eng.worker.execute
    w.writes = []  # host-buffer writes so far, after each step

    def execute(step):
        out = real(step)
        w.writes.append(w.host_buffer_writes)
        return out

    w.execute = execute
    out = {}
    try:
        generate(eng, _requests(), lambda r: out.__setitem__(r.key, r), max_batch=3, record_logits=True)
    finally:
        eng.close()
    return out, eng.worker


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        a[k].token_ids == b[k].token_ids and len(a[k].logits) == len(b[k].logits)
        and all(torch.equal(x, y) for x, y in zip(a[k].logits, b[k].logits)) for k in a)


@pytest.mark.parametrize("attention,share", [("host", None), pytest.param("device", None, marks=pytest.mark.slow),
                                                 pytest.param(None, 0.5, marks=pytest.mark.slow)],
                         ids=["host", "device", "split"])
def test_values_kept_on_the_device_give_identical_results(tiny, attention, share):
    path, plan = tiny
    assert plan["arena"]["kv_buffer_tokens"] > 0 or attention == "host"
    ref, w0 = _run(plan, path, False, attention, share)
    got, w1 = _run(plan, path, True, attention, share)
    assert _same(ref, got)
    assert w0.steps_on_device == 0 and w0.host_buffer_writes > 0
    steps = w1.stats.steps
    assert w1.steps_on_device == steps - 1, "every step after the first keeps its values on the device"
    # only the first step wrote host buffers (each value once, or once per micro-batch)
    first = sum(1 for m in plan["schedule"] for op in m["ops"] if op["op"] == "host_buffer")
    assert w1.writes[0] >= first and set(w1.writes) == {w1.writes[0]}
    assert all(b > a for a, b in zip(w0.writes, w0.writes[1:]))
    assert not w1._host_bufs, "the host buffers are freed while the values stay on the device"


def test_steps_switch_between_device_values_and_host_buffers(tiny):
    """A step whose values do not fit the stage goes through host buffers again (here: every
    other step), and the results stay identical."""
    path, plan = tiny

    def patch(worker):
        real = worker._layout

        def layout(T):
            return real(T) if worker._step_no % 2 else None

        worker._layout = layout

    ref, _ = _run(plan, path, False)
    got, w = _run(plan, path, True, patch=patch)
    assert _same(ref, got)
    assert 0 < w.steps_on_device < w.stats.steps


def test_device_slots_of_a_plan_and_their_fit(tiny):
    """Every value between modules may stay on the device; the residual stream hands one
    slot on from module to module, the rope table (read by every attention module, rows of
    another size) has its own; both fit the plan's stage at its largest step."""
    path, plan = tiny
    kept = _device_slots(PlanView.of(plan).schedule)
    values = [op["name"] for m in plan["schedule"] for op in m["ops"] if op["op"] == "host_buffer"]
    assert list(kept) == values
    eng = Engine(plan, path, "cpu", keep_on_device=True)
    try:
        w = eng.worker
        assert w._layout(8) is None, "row shapes are learned by the first step"
        H, D2 = plan["model"]["info"]["hidden_size"], 2 * plan["model"]["info"]["head_dim"]
        w._widths = {v: ((D2 if v == "buf.rope" else H,), torch.float32) for v in values}
        slots = _assign_slots(kept, {v: 4 * w._widths[v][0][0] for v in values})
        assert len(set(slots.values())) == 2 and all(slots[v] == slots["buf.embed"] for v in values if v != "buf.rope")
        B, tps = plan["batch"]["decode"]["B"], plan["batch"]["prefill"]["tokens_per_step"]
        lay = w._layout(B + tps)
        assert lay is not None and lay.top <= plan["arena"]["stage_bytes"]
        assert lay.top == (B + tps) * 4 * (H + D2)
        assert w._layout(10 * (B + tps)) is None, "a step bigger than the stage keeps the host buffers"
    finally:
        eng.close()


def _mod(kind, ops, layer=None):
    return Module(f"{kind}{layer}", kind, layer, None, tuple(ops))


def _op(op, name, inputs):
    return Op(op, name, tuple(inputs), {}, {})


def test_device_slots_rules():
    """Hand-over only to a value the last reader writes; a value read again later keeps its
    own slot; one read inside its own module, or by nothing, stays in a host buffer."""
    sched = [
        _mod("stem", [_op("embed", "e", []), _op("host_buffer", "buf.e", ["e"]),
                      _op("host_buffer", "buf.unused", ["e"])]),
        _mod("attn", [_op("add", "a", ["buf.e"]), _op("host_buffer", "buf.a", ["a"])], 0),
        _mod("moe", [_op("add", "m", ["buf.a"]), _op("host_buffer", "buf.m", ["m"]),
                     _op("mul", "x", ["buf.m"])], 0),
        _mod("moe", [_op("add", "n", ["buf.a"]), _op("host_buffer", "buf.n", ["n"])], 1),
        _mod("head", [_op("lm_head", "h", ["buf.n"])]),
    ]
    kept = _device_slots(sched)
    assert "buf.unused" not in kept and "buf.m" not in kept  # read by nothing / inside its module
    assert kept == {"buf.e": (0, 1), "buf.a": (1, 3), "buf.n": (3, 4)}
    slots = _assign_slots(kept, {"buf.e": 256, "buf.a": 256, "buf.n": 256})
    assert slots["buf.a"] == slots["buf.e"]  # module 1 is the last reader of buf.e
    assert slots["buf.n"] == slots["buf.a"]  # module 3 is the last reader of buf.a
    other = _assign_slots(kept, {"buf.e": 128, "buf.a": 256, "buf.n": 256})
    assert other["buf.a"] != other["buf.e"], "rows of another size: no hand-over"


def _geo(blocks: int) -> KVGeometry:
    return KVGeometry(layers=2, heads=2, key_dim=8, value_dim=8, block_size=4, num_blocks=blocks)


@pytest.fixture
def fake_pinning(monkeypatch):
    calls: dict[str, list] = {"register": [], "unregister": []}
    monkeypatch.setattr(pinned, "register", lambda ptr, n, flags=0: calls["register"].append((ptr, n)))
    monkeypatch.setattr(pinned, "unregister", lambda ptr: calls["unregister"].append(ptr))
    return calls


def _pinned_pool(blocks: int) -> KVPool:
    g = _geo(blocks)
    return KVPool(g.layers, g.heads, g.key_dim, block_size=g.block_size, num_blocks=g.num_blocks, dtype=torch.float32,
                  v_head_dim=g.value_dim, pin=True)


def test_kv_pool_is_pageable_and_pins_only_when_asked(fake_pinning):
    big = pinned.REGISTER_BYTES // (2 * 2 * 4 * 8 * 4) + 1  # blocks: K alone over the registration size
    for dev in ("cpu", "cuda"):  # nothing DMAs from the pool: pinning it would only lock memory
        pool = KVPool.of(_geo(big), torch.float32, compute_device=torch.device(dev))
        assert fake_pinning["register"] == [] and not pool.pinned
    pool = _pinned_pool(big)
    assert pool.k.device.type == "cpu" and pool.pinned
    assert len(fake_pinning["register"]) == 2  # K and V, each registered in place
    for (ptr, n), t in zip(fake_pinning["register"], (pool.k, pool.v)):
        assert ptr == t.data_ptr() and ptr % 4096 == 0 and n >= t.numel() * t.element_size()
    # the pool works as ever, and close() unpins it
    blocks, offs = torch.tensor([1, 1]), torch.tensor([0, 3])
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    pool.store(1, blocks, offs, k, v)
    out_k, out_v = torch.empty(2, 1, 4, 8), torch.empty(2, 1, 4, 8)
    pool.gather(1, torch.tensor([1]), out_k, out_v)
    assert torch.equal(out_k[:, 0, 0], k[0]) and torch.equal(out_v[:, 0, 3], v[1])
    pool.close()
    assert sorted(fake_pinning["unregister"]) == sorted(p for p, _ in fake_pinning["register"])


def test_kv_pool_falls_back_to_pageable_memory_when_pinning_fails(monkeypatch):
    def refuse(ptr, n, flags=0):
        raise pinned.PinError("cuMemHostRegister of 1 B failed: CUDA_ERROR_OUT_OF_MEMORY", 2)

    monkeypatch.setattr(pinned, "register", refuse)
    big = pinned.REGISTER_BYTES // (2 * 2 * 4 * 8 * 4) + 1
    with pytest.warns(pinned.PinningWarning, match=r"KV pool: .* GiB of .* GiB could not be page-locked"):
        pool = _pinned_pool(big)
    assert not pool.pinned and pool.k.shape[2] == big
    # a small pool goes through torch's pinned allocator, which a CPU-only torch does not have
    with pytest.warns(pinned.PinningWarning, match="using pageable memory instead"):
        small = _pinned_pool(4)
    assert not small.pinned
    small.zero([1, 2])


def test_runtime_refuses_a_plan_without_arena_on_cuda(checkpoints, tmp_path):
    path = checkpoints("mixtral", "per_expert")
    plan = _compile(path)
    assert plan["arena"] is None
    with pytest.raises(PlanError, match=r"no device arena .*--gpu-mem"):
        Worker(plan, path, torch.device("cuda"))  # refused before anything touches CUDA
    with pytest.raises(PlanError, match="--gpu-mem"):
        Engine(plan, path, "cuda")
    # exec (the runtime's job runner, as the Ray path and direct callers use it): before any file
    from moecc_runtime.job.exec import run_job

    plan_path, prompts, out = tmp_path / "plan.pt", tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    save_plan(plan, plan_path)
    prompts.write_text(json.dumps({"prompt": [5, 6, 7], "max_tokens": 2}) + "\n")
    with pytest.raises(PlanError, match="--gpu-mem"):
        run_job(plan_path, prompts, out, device="cuda", log=None)
    assert not out.exists()


def test_replan_decision_and_budget(checkpoints, monkeypatch):
    from moecc import replan

    path = checkpoints("mixtral", "per_expert")
    plan = _compile(path)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert replan.needs_replan(plan, cuda) and not replan.needs_replan(plan, cpu)
    assert replan.replan_for_device(plan, path, cpu) is None
    free = replan.HEADROOM_MIN_BYTES + 3_000_000
    assert replan.budget_for(free) == (3_000_000, replan.HEADROOM_MIN_BYTES)
    assert replan.budget_for(100 << 30) == (90 << 30, 10 << 30)  # 10% once that is more than 1 GiB
    asked = []
    monkeypatch.setattr(replan, "device_free_bytes", lambda d: asked.append(d) or free)
    lines: list[str] = []
    new = replan.replan_for_device(plan, path, cuda, plan_path="p.pt", log=lines.append)
    assert asked == [cuda]
    assert new is not None and new["arena"] is not None and new["arena"]["bytes"] <= 3_000_000
    assert new["batch"]["decode"]["B"] <= plan["batch"]["decode"]["B"]
    assert replan.replan_for_device(new, path, cuda) is None  # a plan with an arena runs as it is
    assert len(lines) == 1 and "p.pt has no device budget" in lines[0] and "recompiled it in memory" in lines[0]
    # too little free memory, or a budget below the model's working set: PlanError naming --gpu-mem
    with pytest.raises(PlanError, match="--gpu-mem"):
        replan.replan_for_device(plan, path, cuda, free_bytes=lambda d: replan.HEADROOM_MIN_BYTES // 2)
    with pytest.raises(PlanError, match="could not be recompiled here.*--gpu-mem"):
        replan.replan_for_device(plan, path, cuda, free_bytes=lambda d: replan.HEADROOM_MIN_BYTES + 1000)
    quantized = {**plan, "model": {**plan["model"], "fingerprint": {**plan["model"]["fingerprint"],
                                                                   "sidecar": {"file": "x"}}}}
    with pytest.raises(PlanError, match="quantized weights"):
        replan.replan_for_device(quantized, path, cuda, free_bytes=lambda d: free)


@pytest.mark.slow
def test_exec_recompiles_an_unbudgeted_plan_for_the_device(checkpoints, tmp_path, monkeypatch):
    """`moecc exec` (in-process): the CLI hands run_job its replan hook; pretending this CPU
    is a device that needs it, the job runs on the recompiled plan (with an arena), says so
    in one line, and its results carry the plan file's identity."""
    from typer.testing import CliRunner

    from moecc import replan
    from moecc.cli import app
    from moecc_runtime.job.results import plan_identity

    path = checkpoints("mixtral", "per_expert")
    plan_path, prompts = tmp_path / "plan.pt", tmp_path / "in.jsonl"
    out, stats = tmp_path / "o.jsonl", tmp_path / "s.json"
    save_plan(_compile(path), plan_path)
    prompts.write_text("".join(json.dumps({"custom_id": f"q{i}", "prompt": [5 + i, 6, 7], "max_tokens": 3}) + "\n"
                               for i in range(3)))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(replan, "needs_replan", lambda plan, device: not plan.get("arena"))
    monkeypatch.setattr(replan, "device_free_bytes", lambda d: replan.HEADROOM_MIN_BYTES + 3_000_000)
    res = CliRunner().invoke(app, ["exec", str(plan_path), str(prompts), "-o", str(out), "--device", "cpu",
                                   "--stats", str(stats), "-q"])
    assert res.exit_code == 0, res.output
    assert res.stderr.count("recompiled it in memory") == 1, res.stderr
    assert json.loads(stats.read_text())["engine"]["arena_bytes"] > 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    ident = plan_identity(load_plan(plan_path), path)
    assert len(lines) == 3 and all(ident in json.dumps(x["moecc"]) for x in lines)


# -- the CUDA-only branches of the copy paths, run against a fake torch.cuda --------------------
# (events complete at once and streams run nothing: what is checked is the control flow, the
# bytes copied and which events each stream and the host wait on, not timing)

class _FakeEvent:
    def __init__(self, enable_timing: bool = False, blocking: bool = False):
        self.timing, self.stream, self.syncs, self.t = enable_timing, None, 0, 0.0

    def record(self, stream=None):
        import time

        self.stream, self.t = stream, time.perf_counter()

    def query(self):
        return True

    def synchronize(self):
        self.syncs += 1

    def elapsed_time(self, other):
        return (other.t - self.t) * 1000.0


class _FakeStream:
    def __init__(self, device=None, name="side", priority=0):
        self.name, self.waited = name, []

    def wait_event(self, ev):
        self.waited.append(ev)

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def fake_cuda(monkeypatch, fake_pinning):
    import contextlib
    import threading
    import warnings

    compute = _FakeStream(name="compute")
    local = threading.local()

    def current_stream(device=None):
        return getattr(local, "s", compute)

    @contextlib.contextmanager
    def stream(s):
        old = current_stream()
        local.s = s
        try:
            yield
        finally:
            local.s = old

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pinned.PinningWarning)  # small staging: no pinned allocator here
        yield compute


def test_cuda_copier_chunks_through_two_staging_buffers(fake_cuda, monkeypatch):
    """Weights go to the arena in chunks through two staging buffers used in turn, all enqueued
    on the copy stream; the host waits on a buffer's event only when it comes back to it;
    compute's release of the slot is waited for by the copy stream, not the host."""
    from moecc_runtime.memory.copy_engine import CopyEngine
    from moecc_runtime.memory.streaming import Copier, _Slot

    monkeypatch.setattr(Copier, "CHUNK", 1024)
    cuda = torch.device("cuda")
    copier = Copier(cuda, 1 << 20)
    assert copier.chunk == 1024 and len(copier.ring.bufs) == 2 and set(copier.rings) == {"normal", "urgent"}
    src = [torch.randn(700), torch.randn(33)]  # 2800 B (3 chunks) and 132 B
    dst = [torch.empty(700), torch.empty(33)]
    engine = CopyEngine(cuda)
    release = _FakeEvent()
    slot = _Slot(0, None, 0, 4096)
    t = engine.submit("w", 2932, lambda: copier.copy(list(zip(src, dst)), slot), kind="fetch", after=[release])
    t.wait()
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
    assert release in engine.stream.waited and release.syncs == 0  # the copy stream waited, not the host
    assert [e.syncs for e in copier.ring.events] == [2, 2]  # 4 chunks: each buffer taken twice
    assert all(e.stream is engine.stream for e in copier.ring.events)
    assert fake_cuda.waited, "the compute stream waits for the job's event"
    assert engine.copy_s >= 0 and engine.wait_s >= 0 and engine.copies == 1
    engine.drain()
    engine.close()
    copier.close()


def test_cuda_kv_staging_and_deferred_stores(fake_cuda):
    """KV staging gathers into its buffer's pinned staging and copies from there; K/V stored
    from the device wait in the pool until a flush (or zero) writes them, in order."""
    from moecc_runtime.memory.arena import DeviceArena
    from moecc_runtime.memory.copy_engine import CopyEngine
    from moecc_runtime.memory.streaming import KVStaging

    pool = KVPool.of(_geo(8), torch.float32, compute_device=torch.device("cuda"))
    pool.k.normal_()
    pool.v.normal_()
    engine = CopyEngine(torch.device("cuda"))
    region = DeviceArena(KVStaging.region_bytes(pool, 4), "cpu").region("kv", KVStaging.region_bytes(pool, 4))
    st = KVStaging(pool, torch.device("cuda"), engine, region, 4)
    assert all(b.staging is not None and b.staging.numel() == 2 * 4 * 2 * 4 * 8 for b in st.bufs)
    blocks = torch.tensor([3, 1])
    k, v = st.acquire(("s", 0, 0), 0, blocks)
    assert torch.equal(k, pool.k[0][:, blocks]) and torch.equal(v, pool.v[0][:, blocks])
    st.release(("s", 0, 0))
    engine.drain()
    engine.close()
    st.close()

    class D2H:  # DeviceToHost's contract: host copies and an event
        def start(self, *xs):
            return [x.clone() for x in xs], _FakeEvent()

    pool.d2h = D2H()
    nk = torch.randn(2, 2, 8)
    pool.defer(1, torch.tensor([5, 5]), torch.tensor([0, 1]), nk, nk + 1, _FakeEvent())
    assert pool.pending == 1
    pool.flush(layer=0)
    assert pool.pending == 1, "a flush of another layer leaves it"
    pool.zero([5])  # a late store must land before its block is zeroed for a new owner
    assert pool.pending == 0 and torch.count_nonzero(pool.k[:, :, 5]) == 0
    pool.defer(1, torch.tensor([5]), torch.tensor([2]), nk[:1], nk[:1], _FakeEvent())
    pool.flush(wait=False)
    assert pool.pending == 0 and torch.equal(pool.k[1][:, 5, 2], nk[0])



def test_cuda_copier_dmas_pinned_weights_without_staging(fake_cuda):
    """A source inside the page-locked streamed weights (registered-mmap / pinned-copy) is one
    copy straight into the arena; the others still go through the lane's staging ring."""
    from moecc_runtime.memory.copy_engine import CopyEngine
    from moecc_runtime.memory.pinned_weights import WeightPins
    from moecc_runtime.memory.streaming import Copier
    from moecc_runtime.memory.weight_path import WeightPath

    cuda = torch.device("cuda")
    copier = Copier(cuda, 1 << 20)
    pinned_src, other = torch.randn(300), torch.randn(40)
    pins = WeightPins(WeightPath.REGISTERED_MMAP, 1360)
    pins.add([(pinned_src.data_ptr(), pinned_src.numel() * 4)])
    copier.pins = pins
    dst = [torch.empty(300), torch.empty(40)]
    engine = CopyEngine(cuda)
    t = engine.submit("w", 1360, lambda: copier.copy(list(zip([pinned_src, other], dst)), None, "urgent"),
                      lane="urgent")
    t.wait()
    assert torch.equal(dst[0], pinned_src) and torch.equal(dst[1], other)
    assert copier.direct_bytes == 1200 and copier.staged_bytes == 160
    assert [e.syncs for e in copier.rings["urgent"].events] == [1, 0]  # one staged chunk, urgent ring
    assert [e.syncs for e in copier.rings["normal"].events] == [0, 0]
    assert copier.rings["urgent"].events[0].stream is engine.lanes["urgent"].stream
    assert engine.lanes["urgent"].stream is not engine.stream
    engine.drain()
    engine.close()
    copier.close()


def test_replan_keeps_the_users_attention_hardware_and_dtype(checkpoints):
    """A recompile for the device's free memory keeps --attention, --hardware, --dtype and the
    other budgets (the plan records them as compiled_with; issues 29, 30)."""
    from moecc import replan
    from moecc.compiler import compile_model

    path = checkpoints("mixtral", "per_expert")
    plan, _ = compile_model(path, prompt_tokens=8, output_tokens=4, max_batch=8, attention="device",
                            hardware="cpu", dtype="float32")
    assert plan["compiled_with"] == {"attention": "device", "hardware": "cpu", "dtype": "float32", "gpu_mem": None,
                                     "host_mem": None, "host_reserve": None, "device_reserve": None, "max_batch": 8}
    free = replan.HEADROOM_MIN_BYTES + 3_000_000
    new = replan.replan_for_device(plan, path, torch.device("cuda"), free_bytes=lambda d: free)
    kept = {k: v for k, v in plan["compiled_with"].items() if k != "gpu_mem"}
    assert new is not None and {k: v for k, v in new["compiled_with"].items() if k != "gpu_mem"} == kept
    assert new["compiled_with"]["gpu_mem"] == replan.budget_for(free)[0]
    assert all(new["batch"][ph]["attention"]["host_fraction"] == 0.0 for ph in ("decode", "prefill"))
