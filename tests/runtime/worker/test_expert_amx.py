"""The fused routed expert on AMX tiles (runtime/native/expert_amx.c) computes what the unfused
path does (kernels.gated_mlp over PackedLinear + expert_rows.scale_add_rows): the same bits where
oneDNN's GEMM sums the inputs in order (up to 224 inputs here at any row count), within one bf16
step of the sum elsewhere (oneDNN splits 768-1,152 inputs between its threads); it reads oneDNN's
packed weights in the layout the probe found; where it does not apply it does nothing and says
so; and kernels.experts gives the same bits with it and without it.

Legend: T = tokens, H = hidden size, I = intermediate size, n = rows routed to the expert.
Skipped where the kernel does not run (not built, or a CPU without AMX)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moecc_runtime.memory.packed_weights import PackedLinear, packing_available
from moecc_runtime.native import expert_amx, expert_rows
from moecc_runtime.worker import kernels

pytestmark = pytest.mark.skipif(expert_amx._module() is None or not packing_available(),
                                reason="the AMX expert kernel does not run here (not built, or no AMX)")

BF16 = torch.bfloat16


def expert_weights(H: int, I: int, seed: int) -> tuple[PackedLinear, None, PackedLinear]:
    """A silu expert's packed weights as the runtime holds them: (gate and up stacked, None, down)."""
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(2 * I, H, generator=g) / 8).to(BF16)  # [2I, H]
    down = (torch.randn(H, I, generator=g) / 8).to(BF16)  # [H, I]
    return PackedLinear(gate_up, 128, split=I, sections=(I, I)), None, PackedLinear(down, 128)


def unfused(x, tok, tw, w, out) -> torch.Tensor:
    """The path the kernel replaces, on a copy of `out`."""
    out = out.clone()
    y = kernels.gated_mlp(kernels._gather_rows(x, tok, w), w[0], None, w[2], "silu")[:tok.shape[0]]  # [n, H]
    assert expert_rows.scale_add_rows(out, tok, y, tw)
    return out


def case(T: int, H: int, I: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, H, generator=g).to(BF16)  # [T, H]
    tok = torch.randperm(T, generator=g)[:n]  # [n] distinct
    tw = torch.rand(n, generator=g)  # [n] fp32
    out = torch.randn(T, H, generator=g).to(BF16)  # [T, H]: the kernel adds into it
    return x, tok, tw, out


@settings(max_examples=25, deadline=None)
@given(H=st.sampled_from([32, 64, 96, 128]), I=st.sampled_from([32, 64, 96, 128, 224]), n=st.integers(1, 512),
       seed=st.integers(0, 2**16))
@example(H=128, I=224, n=512, seed=0)  # the demo model's shapes, the kernel's most rows
@example(H=32, I=32, n=17, seed=1)  # a last row tile of one row
def test_same_bits_as_the_unfused_path(H: int, I: int, n: int, seed: int) -> None:
    w = expert_weights(H, I, seed)
    x, tok, tw, out = case(max(n, 600), H, I, n, seed)
    ref = unfused(x, tok, tw, w, out)
    assert expert_amx.expert(x, tok, tw, w[0], w[2], out)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


def test_subnormal_results_round_as_torch_rounds() -> None:
    """Where a product or sum of the epilogue is subnormal (AVX512-BF16's conversion would flush
    it), the kernel rounds it as torch does: down weights near the bottom of the normal range,
    routing weights of 1e-4 and an output already subnormal."""
    H, I, n = 64, 64, 40
    w = list(expert_weights(H, I, 3))
    g = torch.Generator().manual_seed(4)
    w[2] = PackedLinear((torch.randn(H, I, generator=g) * 1e-36).to(BF16), 128)  # [H, I]: y ~ 1e-35, normal
    x, tok, _, out = case(600, H, I, n, 3)
    tw = torch.full((n,), 1e-4)  # y * tw ~ 1e-39: subnormal in fp32 and bf16
    out = (out.float() * 1e-39).to(BF16)  # [T, H] subnormal
    ref = unfused(x, tok, tw, w, out)
    assert expert_amx.expert(x, tok, tw, w[0], w[2], out)
    rows = out[tok].float().abs()
    assert bool(((rows > 0) & (rows < torch.finfo(torch.float32).tiny)).any())  # the case is exercised
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("n", [16, 128, 512])
def test_as_close_as_the_unfused_path_where_onednn_splits_the_sum(n: int) -> None:
    """At the bench model's shapes oneDNN's GEMM splits the inputs between threads (another fp32
    summation order), so the bits may differ: against the exact result (fp64 from the same bf16
    weights, no intermediate rounding) the kernel's error is the unfused path's, mean and max."""
    H, I, seed = 768, 1152, 7
    w = expert_weights(H, I, seed)
    x, tok, tw, out = case(600, H, I, n, seed)
    ref = unfused(x, tok, tw, w, out).double()
    g = torch.Generator().manual_seed(seed)  # expert_weights' dense weights again
    gate_up = (torch.randn(2 * I, H, generator=g) / 8).to(BF16).double()  # [2I, H]
    down = (torch.randn(H, I, generator=g) / 8).to(BF16).double()  # [H, I]
    z = x[tok].double() @ gate_up.T  # [n, 2I]
    exact = out.double().index_add(0, tok, tw.double()[:, None] * ((torch.nn.functional.silu(z[:, :I]) * z[:, I:]) @ down.T))
    assert expert_amx.expert(x, tok, tw, w[0], w[2], out)
    err, ref_err = (out.double() - exact).abs(), (ref - exact).abs()  # [T, H]
    assert err.mean() <= 1.05 * ref_err.mean() and err.max() <= 1.25 * ref_err.max()


@pytest.mark.parametrize("H,I,n", [(64, 3584, 300), (3584, 64, 300), (32, 4096, 512)])
def test_rows_in_blocks_have_the_bits_of_rows_run_alone(H: int, I: int, n: int) -> None:
    """Past amx_gemm.h's ROWS_L2 a pass runs its rows in blocks (down's 3,584 inputs at 300 rows:
    two blocks; gate/up's at H 3,584 likewise): each routed row has the bits it has in a run of
    its own 16 rows (one block), so the blocks change no sum."""
    w = expert_weights(H, I, 11)
    x, tok, tw, out = case(n + 40, H, I, n, 11)
    alone = out.clone()
    for r in range(0, n, 16):
        assert expert_amx.expert(x, tok[r:r + 16], tw[r:r + 16], w[0], w[2], alone)
    assert expert_amx.expert(x, tok, tw, w[0], w[2], out)
    assert torch.equal(out.view(torch.int16), alone.view(torch.int16))


def test_untouched_rows_stay() -> None:
    """Only the routed tokens' rows of `out` change."""
    w = expert_weights(64, 96, 3)
    x, tok, tw, out = case(40, 64, 96, 9, 3)
    before = out.clone()
    assert expert_amx.expert(x, tok, tw, w[0], w[2], out)
    others = torch.ones(40, dtype=torch.bool)
    others[tok] = False
    assert torch.equal(out[others], before[others])


@pytest.mark.parametrize("out_features,in_features", [(2304, 768), (768, 1152), (448, 128), (64, 32)])
def test_layout_probe_finds_onednn_blocks(out_features: int, in_features: int) -> None:
    assert expert_amx.layout(out_features, in_features, 128) in (32, 64)


def test_layout_probe_declines_what_the_kernel_cannot_read() -> None:
    assert expert_amx.layout(48, 40, 128) is None  # inputs not a multiple of 32


def test_declines_without_writing(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32, int32 tokens, unpacked weights, a stacked width it does not take, rows of another
    width than the weights', the switch off: False and `out` untouched."""
    w = expert_weights(64, 96, 5)
    x, tok, tw, out = case(600, 64, 96, 8, 5)
    before = out.clone()
    assert not expert_amx.expert(x.float(), tok, tw, w[0], w[2], out.float())
    assert not expert_amx.expert(x, tok.int(), tw, w[0], w[2], out)
    assert not expert_amx.expert(x, tok, tw, torch.zeros(192, 64, dtype=BF16), w[2], out)
    plain = PackedLinear(torch.zeros(192, 64, dtype=BF16), 128)  # not stacked: no split
    assert not expert_amx.expert(x, tok, tw, plain, w[2], out)
    wide = torch.zeros(600, 96, dtype=BF16)  # [T, 96]: not the weights' 64 inputs
    assert not expert_amx.expert(wide, tok, tw, w[0], w[2], wide.clone())
    monkeypatch.setenv("MOECC_EXPERT_AMX", "0")
    assert not expert_amx.expert(x, tok, tw, w[0], w[2], out)
    assert torch.equal(out, before)


@pytest.mark.parametrize("n", [expert_amx.MAX_ROWS + 1, 3 * expert_amx.MAX_ROWS - 5])
def test_more_rows_than_a_call_run_as_several(n: int) -> None:
    """Prefill's thousands of rows: one call per MAX_ROWS rows, the same bits as the unfused path."""
    w = expert_weights(64, 96, 9)
    x, tok, tw, out = case(2000, 64, 96, n, 9)
    ref = unfused(x, tok, tw, w, out)
    assert expert_amx.expert(x, tok, tw, w[0], w[2], out)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("T", [1, 37, 300])
def test_experts_same_bits_with_and_without_it(T: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.experts over 8 packed silu experts, top-2, chunks of 64 rows: the fused kernel on
    and off give the same output bits."""
    E, H, I = 8, 64, 96
    ws = [expert_weights(H, I, e) for e in range(E)]
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(BF16)  # [T, H]
    top_w, top_i = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), 2)  # [T, 2]

    def run() -> torch.Tensor:
        return kernels.experts(x, top_w.to(BF16), top_i, lambda used: (ws[e] for e in used), E, "silu", 64)[0]

    calls = []
    original = expert_amx.expert
    monkeypatch.setattr(expert_amx, "expert", lambda *a: calls.append(1) or original(*a))
    on = run()
    assert calls  # the fused kernel ran
    monkeypatch.setenv("MOECC_EXPERT_AMX", "0")
    assert torch.equal(run().view(torch.int16), on.view(torch.int16))


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (300, 8, 2), (1100, 4, 2), (700, 3, 1), (64, 16, 4)])
def test_layer_call_same_bits_as_one_call_an_expert(T: int, E: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.experts with `together` (the layer-wide call: the slots sorted in C, every expert
    in one call, runs of MAX_ROWS past 512 rows an expert) gives the bits of one call an
    expert, experts no token chose never fetched; fp32 and bf16 routing weights alike."""
    H, I = 64, 96
    ws = [expert_weights(H, I, e) for e in range(E)]
    g = torch.Generator().manual_seed(T + E)
    x = torch.randn(T, H, generator=g).to(BF16)  # [T, H]
    logits = torch.randn(T, E, generator=g)
    logits[:, E - 1] = -1e9  # the last expert: no token's choice
    top_w, top_i = torch.topk(torch.softmax(logits, -1), k)  # [T, k]
    fetched: list[list[int]] = []

    def run(together: bool, w: torch.Tensor) -> torch.Tensor:
        def fetch(used: list[int]):
            fetched.append(used)
            return (ws[e] for e in used)
        return kernels.experts(x, w, top_i, fetch, E, "silu", 64, together=together)[0]

    layers = []
    original = expert_amx.layer
    monkeypatch.setattr(expert_amx, "layer", lambda *a: layers.append(1) or original(*a))
    for w in (top_w, top_w.to(BF16)):
        one_by_one = run(False, w)
        assert not layers
        assert torch.equal(run(True, w).view(torch.int16), one_by_one.view(torch.int16))
        assert layers.pop()
    assert all(E - 1 not in used for used in fetched)


@pytest.mark.parametrize("T,threads", [(1100, 2), (2300, 2), (1100, 1)])
def test_layer_call_splits_an_experts_rows_between_threads_with_the_same_bits(T: int, threads: int) -> None:
    """Past MAX_ROWS rows an expert, `layer` splits the expert's rows between the threads (chunks
    of about equal size, each thread its own scratch): the bits of one call an expert, whatever
    the thread count; `scratch_rows` sizes the scratch for it."""
    E, H, I = 2, 64, 96
    ws = [expert_weights(H, I, e) for e in range(E)]
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(BF16)  # [T, H]
    top_w, top_i = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), 1)  # [T, 1]
    counts = torch.bincount(top_i.flatten(), minlength=E).tolist()
    assert max(counts) > expert_amx.MAX_ROWS
    ref = torch.zeros_like(x)
    for e in range(E):
        tok = (top_i[:, 0] == e).nonzero()[:, 0]  # [n]: the expert's tokens, in order
        assert expert_amx.expert(x, tok, top_w[tok, 0], ws[e][0], ws[e][2], ref)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.zeros_like(x)
        assert expert_amx.layer(x, top_w, top_i, counts, dict(enumerate(ws)), out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    assert expert_amx.scratch_rows(max(counts), 2) == 2 * expert_amx.MAX_ROWS
    assert expert_amx.scratch_rows(100, 2) == expert_amx.scratch_rows(100, 1) == 112


def test_layer_call_declines_without_writing() -> None:
    """An index outside the layer's experts, or experts of two shapes: False, `out` untouched."""
    H, I, T = 64, 96, 20
    ws = {0: expert_weights(H, I, 0), 1: expert_weights(H, I, 1)}
    x, out = torch.randn(T, H).to(BF16), torch.randn(T, H).to(BF16)
    before = out.clone()
    top_w = torch.full((T, 2), 0.5)
    bad = torch.tensor([[0, 2]] * T)  # expert 2 of 2
    assert not expert_amx.layer(x, top_w, bad, [T, T], ws, out)
    other = {0: ws[0], 1: expert_weights(H, 2 * I, 1)}
    assert not expert_amx.layer(x, top_w, torch.tensor([[0, 1]] * T), [T, T], other, out)
    assert torch.equal(out.view(torch.int16), before.view(torch.int16))


def test_the_layer_call_is_one_timed_job_of_the_measured_timeline(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 Mixtral read in place runs each layer's experts as one native call: the measured
    timeline (`moecc explain --measured`) gets one compute job for them a layer, timed around the
    call, not per-expert jobs cut at weight hand-outs that no longer bracket any work."""
    from moecc.compiler import compile_model
    from moecc.testing.checkpoints import write_checkpoint
    from moecc_runtime.engine import Engine, generate
    from moecc_runtime.scheduler.sequence import GenRequest

    path = write_checkpoint(tmp_path / "mixtral", "mixtral", dtype="bfloat16")
    plan, _ = compile_model(path)
    layers = []
    original = expert_amx.layer
    monkeypatch.setattr(expert_amx, "layer", lambda *a: layers.append(1) or original(*a))
    engine = Engine(plan, path, "cpu", record_steps=True)  # the timeline is kept with step records
    try:
        generate(engine, [GenRequest(str(i), [1, 5 + i, 9, 13 + i], 6) for i in range(8)], lambda r: None)
        timeline = engine.stats.timeline
    finally:
        engine.close()
    assert layers and timeline
    for phase, trace in timeline.items():
        assert not any(".expert." in j[0] for j in trace["jobs"]), phase
        jobs = [j for j in trace["jobs"] if j[0].endswith(".experts")]
        assert len(jobs) == trace["layers"] and all(j[1:3] == ["compute", "gemm"] and j[5] > 0 for j in jobs), phase


class _Spy:
    """The extension with its `layer` calls recorded (whether each was dealt: its y pointer)."""

    def __init__(self, mod) -> None:
        self.mod, self.dealt = mod, []

    def layer(self, *args):
        self.dealt.append(args[20] != 0)
        return self.mod.layer(*args)


@settings(max_examples=25, deadline=None)
@given(E=st.integers(4, 9), k=st.integers(1, 3), T=st.integers(1, 400), empty=st.integers(0, 2),
       seed=st.integers(0, 2**16))
@example(E=8, k=2, T=400, empty=0, seed=0)  # a decode step of bench768's routing, 100 rows an expert
def test_experts_dealt_to_threads_have_the_bits_of_experts_in_order(E: int, k: int, T: int, empty: int,
                                                                    seed: int) -> None:
    """A decode step's experts dealt whole to the two threads (each thread its own experts, their
    weighted rows added into `out` after them, each token's in expert order): the bits of the
    experts run one after another, over an `out` that already holds values; empty experts and
    experts of one row included."""
    k = min(k, E - empty)
    H, I = 64, 96
    ws = {e: expert_weights(H, I, e) for e in range(E)}
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(BF16)  # [T, H]
    logits = torch.randn(T, E, generator=g)
    logits[:, E - empty:] = -1e9  # experts no token picks
    top_w, top_i = torch.topk(torch.softmax(logits, -1), k)  # [T, k]
    counts = torch.bincount(top_i.flatten(), minlength=E).tolist()
    start = torch.randn(T, H, generator=g).to(BF16)  # [T, H]: what `out` holds before the layer
    spy = _Spy(expert_amx._module())
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = []
        for deal in (expert_amx.DEAL_EXPERTS, 10**9):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(expert_amx, "DEAL_EXPERTS", deal)
                mp.setattr(expert_amx, "_module", lambda: spy)
                out = start.clone()
                assert expert_amx.layer(x, top_w, top_i, counts, ws, out)
                outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert spy.dealt == [sum(c > 0 for c in counts) >= 2 * expert_amx.DEAL_EXPERTS, False]
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_dealt_layer_declines_an_expert_past_a_run() -> None:
    """Asked to deal (y and pos given) a layer with an expert of more than MAX_ROWS rows, the C
    entry declines and writes nothing; `layer` never asks it to."""
    H, I, E = 64, 96, 4
    T = expert_amx.MAX_ROWS + 20
    ws = [expert_weights(H, I, e) for e in range(E)]
    top_i = torch.tensor([[0, 1 + t % 3] for t in range(T)])  # expert 0: every token
    top_w = torch.full((T, 2), 0.5)
    x, out = torch.randn(T, H).to(BF16), torch.zeros(T, H).to(BF16)
    mod = expert_amx._module()
    from moecc_runtime.native.expert_rows import _silu_table
    from moecc_runtime.native.packed_layout import raw

    at = torch.tensor([raw(w[0].packed) for w in ws] + [raw(w[2].packed) for w in ws], dtype=torch.int64)
    nb = expert_amx._weights(ws[0][0], ws[0][2])
    rows = 2 * expert_amx.MAX_ROWS
    a, h, y = x.new_empty((rows, H)), x.new_empty((rows, I)), x.new_empty((2 * T, H))
    tok, tw, pos = torch.empty(2 * T, dtype=torch.int64), torch.empty(2 * T), torch.empty(2 * T, dtype=torch.int64)
    rc = mod.layer(x.data_ptr(), H, T, 2, top_i.data_ptr(), top_w.data_ptr(), E, at.data_ptr(), at.data_ptr() + 8 * E,
                   H, I, nb[0], nb[1], _silu_table().data_ptr(), tok.data_ptr(), tw.data_ptr(), a.data_ptr(),
                   h.data_ptr(), out.data_ptr(), H, y.data_ptr(), pos.data_ptr(), 2)
    assert rc == 1 and not bool(out.view(torch.int16).any())
