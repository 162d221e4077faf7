"""Pinning that cannot break a run, and the weight path rule (runtime/memory/pinned.py,
pinned_weights.py, weight_path.py, kv.fit_to_host), checked on the CPU with the driver calls
replaced:

* the rule: which path streamed weights take for (device, lockable memory, streamed bytes,
  pinning allowed);
* big ranges register in pieces cut at tensor boundaries; a refused piece stays pageable
  with one warning naming how much and what it costs; nothing over the lockable memory is
  tried; a failed runtime-API registration clears CUDA's last error; huge pages are asked
  for before registration faults the pages;
* the streamed weights of a real checkpoint: registered in place (read-only) where the driver
  takes it, copied into pinned memory (same bytes) where it refuses the mapping, staged
  where pinning is off or memory short;
* the KV pool fitted to this machine's memory at run time: shrunk with a warning, refused
  below the plan's batch, untouched when it fits or when blocks are given.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from moecc.compiler import compile_model
from moecc_runtime.memory import huge_pages, pinned, pinned_weights
from moecc_runtime.contract.kv_geometry import KVGeometry
from moecc_runtime.memory.kv import HostMemoryWarning, KVFitError, fit_to_host
from moecc_runtime.memory.weight_path import PIN_SHARE, WeightPath, choose_weight_path, pin_room
from moecc_runtime.memory.weights import WeightStore

GiB = 1 << 30


def test_weight_path_rule():
    assert choose_weight_path("cpu", None, 10 * GiB) == WeightPath.HOST_MEMCPY
    assert choose_weight_path("cuda", 100 * GiB, 10 * GiB) == WeightPath.REGISTERED_MMAP
    assert choose_weight_path("cuda", None, 10 * GiB) == WeightPath.REGISTERED_MMAP  # unknown: the plan's word
    assert choose_weight_path("cuda", 100 * GiB, 10 * GiB, mapping_registrable=False) == WeightPath.PINNED_COPY
    assert choose_weight_path("cuda", 100 * GiB, 10 * GiB, pinning_allowed=False) == WeightPath.STAGED
    assert choose_weight_path("cuda", 12 * GiB, 10 * GiB) == WeightPath.STAGED  # over PIN_SHARE of the room
    assert choose_weight_path("cuda", 100 * GiB, 0) == WeightPath.STAGED  # nothing streams
    assert choose_weight_path("cuda", int(10 * GiB / PIN_SHARE), 10 * GiB) == WeightPath.REGISTERED_MMAP
    assert pin_room(100 * GiB, 30 * GiB) == 70 * GiB and pin_room(None, 1) is None and pin_room(1, 5) == 0
    assert str(WeightPath.PINNED_COPY) == "pinned-copy" and WeightPath("staged") is WeightPath.STAGED


@pytest.fixture
def fake_register(monkeypatch):
    """pinned.register / unregister recorded; `refuse` (a set of piece offsets or True) makes
    pieces fail; MemAvailable pinned at 64 GiB."""
    log = {"register": [], "unregister": [], "refuse": set(), "code": 2}

    def register(ptr, n, flags=0):
        if log["refuse"] is True or ptr in log["refuse"]:
            raise pinned.PinError(f"cuMemHostRegister of {n} B failed: CUDA_ERROR_{log['code']}", log["code"])
        log["register"].append((ptr, n, flags))

    monkeypatch.setattr(pinned, "register", register)
    monkeypatch.setattr(pinned, "unregister", lambda ptr: log["unregister"].append(ptr))
    monkeypatch.setattr(pinned, "available_bytes", lambda meminfo=None: 64 * GiB)
    monkeypatch.delenv("MOECC_NO_PIN", raising=False)
    return log


def test_ranges_register_in_pieces_cut_at_tensor_boundaries():
    P = 4096
    assert pinned._pieces(10 * P, 4 * P, None) == [(0, 4 * P), (4 * P, 8 * P), (8 * P, 10 * P)]
    assert pinned._pieces(10 * P, 4 * P, [3 * P, 5 * P, 9 * P]) == [(0, 3 * P), (3 * P, 5 * P), (5 * P, 9 * P),
                                                                   (9 * P, 10 * P)]
    assert pinned._pieces(10 * P, 6 * P, [2 * P, 3 * P, 7 * P]) == [(0, 3 * P), (3 * P, 7 * P), (7 * P, 10 * P)]
    # a tensor longer than a piece stays whole (one DMA); only a range without tensors is cut inside
    assert pinned._pieces(37 * P, 5 * P, [4 * P, 13 * P, 30 * P]) == [(0, 4 * P), (4 * P, 13 * P), (13 * P, 30 * P),
                                                                      (30 * P, 37 * P)]
    for n, piece, cuts in ((37 * P, 5 * P, [4 * P, 13 * P, 30 * P]), (8 * P, 8 * P, []), (9 * P, 2 * P, None)):
        got = pinned._pieces(n, piece, cuts)
        assert got[0][0] == 0 and got[-1][1] == n and all(a[1] == b[0] for a, b in zip(got, got[1:]))
        assert all(lo % P == 0 for lo, hi in got)
        if cuts is None:
            assert all(hi - lo <= piece for lo, hi in got)


def test_refused_pieces_stay_pageable_with_one_warning(fake_register, monkeypatch):
    base = 1 << 40
    fake_register["refuse"] = {base + 2 * GiB}
    with pytest.warns(pinned.PinningWarning, match=r"KV pool: 1\.00 GiB of 4\.00 GiB could not be page-locked "
                                                   r"\(1 of 4 pieces.*synchronous"):
        got = pinned.register_range(base, 4 * GiB, "KV pool")
    assert got == [(base, GiB), (base + GiB, GiB), (base + 3 * GiB, GiB)]
    assert pinned.pinned_bytes() >= 3 * GiB
    pinned.unregister_pieces(got)
    assert len(fake_register["unregister"]) == 3 and not got
    # over the lockable memory now: not even tried; MOECC_NO_PIN: nothing tried
    monkeypatch.setattr(pinned, "available_bytes", lambda meminfo=None: GiB)  # 0.8 GiB lockable: no piece
    failures: list = []
    assert pinned.register_range(base, 4 * GiB, "big", failures=failures) == [] and len(failures) == 4
    assert "available now" in failures[0][2] and len(fake_register["register"]) == 3
    monkeypatch.setenv("MOECC_NO_PIN", "1")
    failures = []
    assert pinned.register_range(base, GiB, "x", failures=failures) == [] and "MOECC_NO_PIN" in failures[0][2]


def test_a_failed_registration_leaves_no_cuda_error(monkeypatch):
    """The runtime API's failure is cleared at once (cudaGetLastError); the driver API's leaves
    none and names the error."""
    cleared = []

    class Cudart:
        def cudaHostRegister(self, ptr, n, flags):
            return 2

        def cudaHostUnregister(self, ptr):
            return 1

    monkeypatch.setattr(pinned, "_driver", lambda: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(pinned, "_clear_runtime_error", lambda: cleared.append(1))
    with pytest.raises(pinned.PinError, match="CUDA error 2") as e:
        pinned._cuda_register(4096, 4096, pinned.READ_ONLY)
    assert e.value.code == 2 and cleared == [1]
    pinned._cuda_unregister(4096)
    assert cleared == [1, 1]

    class Driver:
        def cuMemHostRegister_v2(self, ptr, n, flags):
            return 801

        def cuCtxGetCurrent(self, out):
            out._obj.value = 1234
            return 0

        def cuGetErrorName(self, rc, out):
            out._obj.value = b"CUDA_ERROR_NOT_SUPPORTED"
            return 0

    monkeypatch.setattr(pinned, "_driver", lambda: Driver())
    with pytest.raises(pinned.PinError, match="CUDA_ERROR_NOT_SUPPORTED") as e:
        pinned._cuda_register(4096, 4096, pinned.READ_ONLY)
    assert e.value.code == 801 and cleared == [1, 1]
    pinned._clear_runtime_error()  # the real one: no libcudart in this process, nothing to do


def test_huge_pages_are_asked_for_before_registration(fake_register, monkeypatch):
    order = []
    monkeypatch.setattr(huge_pages, "advise", lambda t: order.append(("advise", t.data_ptr())) or True)
    real = pinned.register

    def register(ptr, n, flags=0):
        order.append(("register", ptr))
        real(ptr, n, flags)

    monkeypatch.setattr(pinned, "register", register)
    t = pinned.host_empty((80 << 20,), torch.uint8, pin=True, what="KV pool", huge=True)
    assert [k for k, _ in order] == ["advise", "register"] and order[0][1] == order[1][1] == t.data_ptr()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0 and pinned.is_registered(t)
    pinned.release(t)
    assert fake_register["unregister"] == [t.data_ptr()]


@pytest.fixture(scope="module")
def store_keys(checkpoints):
    path = checkpoints("mixtral", "per_expert")
    plan, _ = compile_model(path, prompt_tokens=24, output_tokens=8, max_batch=4, gpu_mem=700_000)
    keys = [k for k in plan["weights"] if ".mlp_experts.e" in k]
    return plan, path, keys


def _store(plan, path) -> WeightStore:
    return WeightStore(plan["weights"], path, torch.device("cuda"), compute_dtype=torch.float32)


def test_streamed_weights_registered_in_place(store_keys, fake_register):
    plan, path, keys = store_keys
    store = _store(plan, path)
    try:
        assert store.read_only
        pins = pinned_weights.pin_streamed(store, keys, torch.device("cuda"), pinned_weights.other_host_bytes(plan))
        assert pins.path == WeightPath.REGISTERED_MMAP and pins.report()["path"] == "registered-mmap"
        assert fake_register["register"] and all(f == pinned.READ_ONLY and p % 4096 == 0 and n % 4096 == 0
                                                 for p, n, f in fake_register["register"])
        srcs = [t for k in keys for t in store.stored(k).values()]
        covered = sum(pins.covers(t) for t in srcs)
        assert covered == len(srcs)  # one file, pieces under 1 GiB: no tensor straddles
        assert pins.pinned_bytes == pins.streamed_bytes == sum(t.numel() * t.element_size() for t in srcs)
        assert not pins.covers(torch.empty(4))
        pins.close()
        assert len(fake_register["unregister"]) == len(fake_register["register"])
    finally:
        store.close()


def test_no_tensor_straddles_two_pieces_when_the_range_is_cut(store_keys, fake_register, monkeypatch):
    """Pieces far smaller than the file (as 1 GiB pieces are against a real checkpoint), tensors
    not on page boundaries (safetensors' data offset): every streamed tensor still lies inside one
    registered piece. Cutting at the page under each tensor's start left the tensor before each
    cut in two pieces, staged every step (the first device run: 0.94 of 11.3 GB)."""
    plan, path, keys = store_keys
    monkeypatch.setattr(pinned, "PIECE_BYTES", 2 * 4096)
    store = _store(plan, path)
    try:
        srcs = [t for k in keys for t in store.stored(k).values()]
        assert any(t.data_ptr() % 4096 for t in srcs)  # the case: tensors off page boundaries
        pins = pinned_weights.pin_streamed(store, keys, torch.device("cuda"), pinned_weights.other_host_bytes(plan))
        assert len(fake_register["register"]) > 1  # the range was cut
        assert all(pins.covers(t) for t in srcs)
        assert pins.pinned_bytes == pins.streamed_bytes
        pins.close()
    finally:
        store.close()


def test_cuts_fall_only_where_no_tensor_spans_them():
    P = 4096
    base = torch.empty(40 * P, dtype=torch.uint8)
    b0 = base.data_ptr()
    run = [base[100:3 * P], base[3 * P:5 * P + 7], base[5 * P + 7:9 * P], base[11 * P + 5:12 * P]]
    # a page-aligned start (3P); none inside the page 5P..6P that two tensors share; a gap (9P..11P+5)
    assert pinned_weights._cuts(run, b0, 0) == [3 * P, 9 * P]


def test_streamed_weights_copied_when_the_mapping_is_refused(store_keys, fake_register, monkeypatch):
    plan, path, keys = store_keys
    store = _store(plan, path)
    monkeypatch.setattr(pinned, "REGISTER_BYTES", 0)  # the pinned copy is small here: register it too
    try:
        before = {k: store.stored(k)["data"].clone() for k in keys}
        maps = {store.mapping(store.stored(k)["data"])[0] for k in keys}
        real = pinned.register

        def register(ptr, n, flags=0):
            if flags & pinned.READ_ONLY:  # the file mapping: refused as unsupported
                raise pinned.PinError("CUDA_ERROR_NOT_SUPPORTED", 801)
            real(ptr, n, flags)

        monkeypatch.setattr(pinned, "register", register)
        pins = pinned_weights.pin_streamed(store, keys, torch.device("cuda"))
        assert pins.path == WeightPath.PINNED_COPY and pins.pinned_bytes == pins.streamed_bytes
        for k in keys:
            now = store.stored(k)["data"]
            assert torch.equal(now, before[k]) and pins.covers(now) and store.mapping(now) is None
        assert len(maps) == 1
        pins.close()
        assert fake_register["unregister"]
    finally:
        store.close()


def test_streamed_weights_staged_when_pinning_is_off_or_memory_short(store_keys, fake_register, monkeypatch):
    plan, path, keys = store_keys
    store = _store(plan, path)
    try:
        assert pinned_weights.pin_streamed(store, keys, torch.device("cpu")).path == WeightPath.HOST_MEMCPY
        monkeypatch.setenv("MOECC_NO_PIN", "1")
        assert pinned_weights.pin_streamed(store, keys, torch.device("cuda")).path == WeightPath.STAGED
        monkeypatch.delenv("MOECC_NO_PIN")
        monkeypatch.setattr(pinned, "available_bytes", lambda meminfo=None: 1000)
        assert pinned_weights.pin_streamed(store, keys, torch.device("cuda")).path == WeightPath.STAGED
        monkeypatch.setattr(pinned, "available_bytes", lambda meminfo=None: 64 * GiB)
        fake_register["refuse"] = True
        fake_register["code"] = 2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pins = pinned_weights.pin_streamed(store, keys, torch.device("cuda"))
        assert pins.path == WeightPath.STAGED and pins.pinned_bytes == 0
        assert any("streamed weights: 0.00 of" in str(w.message) and "staged" in str(w.message) for w in caught)
        assert not fake_register["register"]
    finally:
        store.close()


def test_kv_pool_fitted_to_this_machine():
    """The plan's pool (2 GiB of weights beside it, B=4 sequences of 64 tokens) on machines of less memory."""
    geo = KVGeometry(2, 2, 8, 8, 16, 1000, bytes_per_block=1 << 20)
    fit = functools.partial(fit_to_host, geo, 4, 64, 2 * GiB)  # B, seq_len, the plan's other host bytes
    assert fit(available=8 * GiB) == geo  # fits: unchanged
    with pytest.warns(HostMemoryWarning, match=r"1000 blocks, 0\.98 GiB\) does not fit.*using 512 blocks"):
        small = fit(available=2 * GiB + 512 * (1 << 20))
    assert small.num_blocks == 512 and small.block_size == 16
    floor = 4 * (64 // 16 + 1)
    with pytest.raises(KVFitError, match=rf"room for 3 blocks, fewer than the {floor} .*--host-mem"):
        fit(available=2 * GiB + 3 * (1 << 20))


def test_the_plan_prediction_and_the_run_agree(store_keys):
    """The rule's figures for a plan (weight_path.streamed_keys / plan_streamed_bytes) are the
    weights the runtime streams and pins; on this CPU the run takes "host-memcpy"."""
    from moecc_runtime.memory.weight_path import plan_streamed_bytes, predict_weight_path, streamed_keys
    from moecc_runtime.worker.worker import Worker

    plan, path, keys = store_keys
    w = Worker(plan, path, "cpu")
    try:
        assert set(streamed_keys(plan)) >= set(keys) and w.weights._streamed_keys() == streamed_keys(plan)
        assert w.weights.weight_path == WeightPath.HOST_MEMCPY
        assert w.weights.pins.streamed_bytes == plan_streamed_bytes(plan) > 0
    finally:
        w.close()
    assert predict_weight_path(plan, "cpu", None) == WeightPath.HOST_MEMCPY
    assert predict_weight_path(plan, "cuda", 64 * GiB) == WeightPath.REGISTERED_MMAP
    assert predict_weight_path(plan, "cuda", 64 * GiB, pinning_allowed=False) == WeightPath.STAGED
    assert predict_weight_path({**plan, "arena": None}, "cuda", 64 * GiB) == WeightPath.STAGED  # nothing streams


def test_far_apart_tensors_register_as_separate_ranges(monkeypatch):
    """Resident tensors between two streamed ones are not locked when the gap is large."""
    base = torch.empty(1000)
    a, b, c = base[0:10], base[12:20], base[500:510]  # gaps of 8 B and 1920 B
    monkeypatch.setattr(pinned_weights, "GAP_BYTES", 64)
    assert [[t.data_ptr() for t in r] for r in pinned_weights._runs([a, b, c])] == \
        [[a.data_ptr(), b.data_ptr()], [c.data_ptr()]]
