"""Races made visible on a CPU: the copy engine's race amplification (MOECC_RACE_AMPLIFY=1:
random delays before every copy and on every release, free slots and KV buffers poisoned with
NaN bytes) must not change a single greedy token or logit of a streamed plan (experts and
dense modules through slots, KV through the two buffers) or of a split-attention plan, in two
model families; and it has teeth: the same run with one missing wait does change them.

Also the copy order compute needs, on the CPU engine itself: expert fetches after routing go
on their own lane, ahead of a blocked dense prefetch or KV gather; a slot's fill on one lane
waits for its previous fill on the other; a fetch cancelled before it ran fills nothing; a
cached slot is handed out with the ticket of the copy that filled it; KVStaging.submit leaves
no buffer claimed when it raises.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from moecc.compiler import compile_model
from moecc_runtime.engine import Engine, generate
from moecc_runtime.memory import copy_engine, streaming
from moecc_runtime.memory.arena import ArenaError, DeviceArena
from moecc_runtime.memory.copy_engine import CopyEngine, RaceAmplifier
from moecc_runtime.memory.kv import KVPool
from moecc_runtime.scheduler.sequence import GenRequest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ("mixtral", "qwen3_moe")


_PLANS: dict = {}


def _streamed_plan(path):
    """A plan whose budget streams the experts (no `L*.experts` group resident) with device
    attention: the smallest of a few budgets that compiles (the model's weights times a share).
    Compiled once per checkpoint."""
    if path not in _PLANS:
        _PLANS[path] = _compile_streamed(path)
    return _PLANS[path]


def _compile_streamed(path):
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    for share in (0.5, 0.65, 0.8):
        try:
            plan, _ = compile_model(path, prompt_tokens=24, output_tokens=8, max_batch=4,
                                    gpu_mem=int(weights * share), attention="device")
        except Exception:  # below the working set: try a larger budget
            continue
        lay = plan["arena"]
        if lay and lay["kv_buffer_tokens"] > 0 and not any(g.endswith(".experts") for g in lay["resident"]):
            return plan
    pytest.fail(f"no budget streams the experts of {path.name}")


@pytest.fixture(scope="module", params=FAMILIES)
def streamed(request, checkpoints):
    path = checkpoints(request.param, "per_expert")
    return path, _streamed_plan(path)


def _requests() -> list[GenRequest]:
    rng = random.Random(1)
    return [GenRequest(f"r{i}", [rng.randrange(3, 200) for _ in range(rng.randint(3, 28))], 5) for i in range(6)]


def _run(plan, path, share: float | None, race: bool, monkeypatch, patch=None, seed: int = 7, device: str = "cpu",
         info: dict | None = None):
    """Greedy results {key: (tokens, logits)} and the worker's copy engine (`info`: filled
    with the weight path the run took)."""
    if race:
        monkeypatch.setenv("MOECC_RACE_AMPLIFY", "1")
        monkeypatch.setenv("MOECC_RACE_SEED", str(seed))
    else:
        monkeypatch.delenv("MOECC_RACE_AMPLIFY", raising=False)
    eng = Engine(plan, path, device, expert_chunk=3, attn_micro_batch=2, attention="device" if share is None else None)
    if share is not None:  # a split: this share of each step's sequences attend on the host
        eng.worker._host_share = {"decode": share, "prefill": share}
    if patch is not None:
        patch(eng)
    if info is not None:
        info["weight_path"] = str(eng.worker.weights.weight_path)
    out: dict = {}
    try:
        generate(eng, _requests(), lambda r: out.__setitem__(r.key, (r.token_ids, r.logits)), max_batch=3,
                 record_logits=True)
    finally:
        eng.close()
    return out, eng.worker.copy


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        a[k][0] == b[k][0] and len(a[k][1]) == len(b[k][1]) and all(torch.equal(x, y) for x, y in zip(a[k][1], b[k][1]))
        for k in a)


@pytest.mark.parametrize("share", [None, 0.5], ids=["streamed", "split"])
@pytest.mark.slow
def test_race_amplification_changes_no_token(streamed, share, monkeypatch):
    path, plan = streamed
    ref, plain = _run(plan, path, share, False, monkeypatch)
    assert plain.race is None
    for seed in (7, 8):  # two schedules of delays
        got, amp = _run(plan, path, share, True, monkeypatch, seed=seed)
        assert amp.race is not None and amp.race.poisoned > 0, "the mode poisoned freed slots / KV buffers"
        assert _same(ref, got), f"seed {seed}"
        assert all(len(t) for t, _ in got.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("share", [None, 0.5], ids=["streamed", "split"])
def test_race_amplification_on_cuda(streamed, share, monkeypatch):
    """The same on a GPU: spin kernels on the copy and compute streams, poisoned slots, KV
    buffers and staging; greedy tokens as the unperturbed CUDA run's, weights DMA'd from
    page-locked memory."""
    path, plan = streamed
    info: dict = {}
    ref, _ = _run(plan, path, share, False, monkeypatch, device="cuda", info=info)
    assert info["weight_path"] in ("registered-mmap", "pinned-copy"), info
    got, amp = _run(plan, path, share, True, monkeypatch, device="cuda")
    assert amp.race is not None and amp.race.poisoned > 0
    assert {k: v[0] for k, v in ref.items()} == {k: v[0] for k, v in got.items()}


def _no_wait(monkeypatch):
    """The bug: experts after routing handed to compute before their copy landed."""
    real = streaming.StreamedWeights._submit_unit

    def submit(self, pool, unit, keys, what, layer, lane="normal"):
        slot, t, views = real(self, pool, unit, keys, what, layer, lane)
        if lane == "urgent":
            t.wait = lambda: None
        return slot, t, views

    monkeypatch.setattr(streaming.StreamedWeights, "_submit_unit", submit)


def _early_release(monkeypatch):
    """The bug: a micro-batch's KV buffer released before its attention ran."""
    real = streaming.KVStaging.acquire

    def acquire(self, key, layer, blocks):
        kv = real(self, key, layer, blocks)
        self.release(key)
        return kv

    monkeypatch.setattr(streaming.KVStaging, "acquire", acquire)


@pytest.mark.parametrize("bug", [_no_wait, _early_release], ids=["missing-wait", "early-release"])
def test_race_amplification_catches_a_bug(checkpoints, monkeypatch, bug):
    """The mode has teeth: with one ordering bug, poisoned or half-copied memory changes the
    output (or makes the logits NaN, which stops the sampler)."""
    path = checkpoints("mixtral", "per_expert")
    plan = _streamed_plan(path)
    ref, _ = _run(plan, path, None, False, monkeypatch)
    bug(monkeypatch)
    try:
        got, _ = _run(plan, path, None, True, monkeypatch)
    except Exception:  # NaN logits stop the sampler: caught too
        return
    assert not _same(ref, got), "an ordering bug went unnoticed under race amplification"


# -- the copy order, on the CPU engine -----------------------------------------------------------

def test_urgent_lane_is_not_queued_behind_normal_copies():
    eng = CopyEngine(torch.device("cpu"))
    try:
        gate, order = threading.Event(), []
        slow = eng.submit("dense prefetch (blocked)", 8, lambda: (gate.wait(5), order.append("dense")))
        kv = eng.submit("KV gather", 8, lambda: order.append("kv"))
        expert = eng.submit("expert after routing", 8, lambda: order.append("expert"), lane="urgent")
        expert.wait()
        assert order == ["expert"] and not slow.done and not kv.done
        gate.set()
        kv.wait()
        assert order == ["expert", "dense", "kv"]
    finally:
        eng.close()


def test_cross_lane_dependency_and_cancel():
    eng = CopyEngine(torch.device("cpu"))
    try:
        gate, order = threading.Event(), []
        first = eng.submit("fill on normal", 8, lambda: (gate.wait(5), order.append("first")))
        second = eng.submit("refill on urgent", 8, lambda: order.append("second"), lane="urgent", deps=[first])
        threading.Timer(0.05, gate.set).start()
        second.wait()
        assert order == ["first", "second"], "the refill waited for the slot's previous fill"
        gate2 = threading.Event()
        eng.submit("blocker", 0, lambda: gate2.wait(5))
        dropped = eng.submit("expert ahead of routing", 8, lambda: order.append("dropped"))
        assert dropped.cancel() and dropped.done and dropped.skipped
        after = eng.submit("refill", 8, lambda: order.append("refill"), lane="urgent", deps=[dropped])
        after.wait()  # not held up by the blocked lane: the cancelled fill is no dependency
        gate2.set()
        eng.drain()
        assert "dropped" not in order and order[-1] == "refill"
        assert not after.cancel(), "a transfer that ran cannot be cancelled"
    finally:
        eng.close()


def test_cached_slot_comes_with_the_ticket_of_its_fill():
    region = DeviceArena(4096, "cpu").region("slots", 2048)
    pool = streaming._SlotPool(region, 2, 1024)
    eng = CopyEngine(torch.device("cpu"))
    try:
        gate = threading.Event()
        slot, cached = pool.acquire("expert 3")
        assert cached is None
        slot.fill = eng.submit("fill", 8, lambda: gate.wait(5))
        pool.release(slot)  # dropped while its copy still runs
        again, cached = pool.acquire("expert 3")
        assert again is slot and cached is slot.fill and not cached.done
        gate.set()
        cached.wait()
        pool.release(again)
        blocker = threading.Event()
        eng.submit("blocker", 0, lambda: blocker.wait(5))
        slot.fill = eng.submit("refill", 8, lambda: None)
        assert slot.fill.cancel()  # cancelled before it ran: the slot holds nothing of it
        again, cached = pool.acquire("expert 3")
        assert cached is None, "a cancelled fill is no cache"
        blocker.set()
    finally:
        eng.close()


def test_kv_staging_submit_leaves_nothing_claimed_when_it_raises():
    pool = KVPool(1, 1, 8, block_size=4, num_blocks=8, dtype=torch.float32)
    eng = CopyEngine(torch.device("cpu"))
    try:
        nbytes = streaming.KVStaging.region_bytes(pool, 2)
        st = streaming.KVStaging(pool, torch.device("cpu"), eng, DeviceArena(nbytes, "cpu").region("kv", nbytes), 2)
        with pytest.raises(ArenaError, match="needs 3 KV blocks"):
            st.submit(("s", 0, 0), 0, torch.tensor([1, 2, 3]))
        assert all(b.key is None and b.ticket is None for b in st.bufs)
        k, _ = st.acquire(("s", 0, 0), 0, torch.tensor([1, 2]))
        assert k.shape == (1, 2, 4, 8)
        st.release(("s", 0, 0))
    finally:
        eng.close()


def test_race_mode_switches(monkeypatch):
    def race_of(**kw):
        eng = CopyEngine(torch.device("cpu"), **kw)
        eng.close()
        return eng.race

    monkeypatch.delenv("MOECC_RACE_AMPLIFY", raising=False)
    assert race_of() is None
    assert isinstance(race_of(race=True), RaceAmplifier)
    monkeypatch.setenv("MOECC_RACE_AMPLIFY", "1")
    race = race_of()
    assert race is not None and race_of(race=False) is None
    t = torch.ones(4)
    race.poison(t)
    assert torch.isnan(t).all() and race.poisoned == 1
    race.delay(None)  # no CUDA here: a host sleep only
    assert not copy_engine._real_cuda()
