"""A layer's routed experts in fp32 on AVX-512 (runtime/native/expert_fp32.c) compute what the
unfused path does (kernels.gated_mlp over PackedLinear + expert_rows.scale_add_rows): against
the exact result (fp64 from the same weights) no less accurate than that path; its silu within
2 ulps of torch's (the edges of exp's range included); it reads oneDNN's packed fp32 weights
in the layout the probe found; where it does not apply it does nothing and says so; and
kernels.experts runs it for an fp32 layer whose weights are read in place.

Legend: T = tokens, H = hidden size, I = intermediate size, E = experts, k = experts a token.
Skipped where the kernel does not run (not built, or a CPU without AVX-512)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moecc_runtime.memory.packed_weights import PackedLinear, packing_available
from moecc_runtime.native import expert_fp32
from moecc_runtime.worker import kernels

pytestmark = pytest.mark.skipif(expert_fp32._module() is None or not packing_available(),
                                reason="the fp32 expert kernel does not run here (not built, or no AVX-512)")


def dense_weights(H: int, I: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert's gate and up stacked [2I, H] and its down [H, I], fp32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * I, H, generator=g) / 8, torch.randn(H, I, generator=g) / 8


def packed(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[PackedLinear, None, PackedLinear]:
    """The weights as the runtime holds them: (gate and up stacked, None, down)."""
    I = down.shape[1]
    return PackedLinear(gate_up, 1024, split=I, sections=(I, I)), None, PackedLinear(down, 1024)


def routing(T: int, E: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_w [T, k] fp32, top_i [T, k]: a softmax router's top-k, the last expert never chosen."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    logits[:, E - 1] = -1e9
    return torch.topk(torch.softmax(logits, -1), k)


def run(x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, ws: list, E: int, native: bool) -> torch.Tensor:
    """kernels.experts over a layer read in place (`together`), the fp32 kernel on (and then
    checked to have run) or off."""
    saved, ran = kernels._LAYER_KERNELS.pop(torch.float32), []
    if native:
        kernels._LAYER_KERNELS[torch.float32] = SimpleNamespace(
            takes=saved.takes, layer=lambda *a: ran.append(saved.layer(*a)) or ran[-1])
    try:
        out = kernels.experts(x, top_w, top_i, lambda used: (ws[e] for e in used), E, "silu", 64, together=True)[0]
    finally:
        kernels._LAYER_KERNELS[torch.float32] = saved
    assert ran == ([True] if native else [])
    return out


def exact(x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, dense: list) -> torch.Tensor:
    """The layer in fp64 from the same weights: [T, H]."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e, (gate_up, down) in enumerate(dense):
        t, s = (top_i == e).nonzero(as_tuple=True)
        if t.numel():
            z = x[t].double() @ gate_up.double().T  # [n, 2I]
            I = down.shape[1]
            y = (torch.nn.functional.silu(z[:, :I]) * z[:, I:]) @ down.double().T  # [n, H]
            out.index_add_(0, t, top_w[t, s].double()[:, None] * y)
    return out


@settings(max_examples=20, deadline=None)
@given(H=st.sampled_from([64, 128, 192]), I=st.sampled_from([64, 128, 192, 256]), T=st.integers(1, 300),
       E=st.integers(2, 9), k=st.integers(1, 3), seed=st.integers(0, 2**16))
@example(H=768, I=1152, T=256, E=8, k=2, seed=0)  # the bench model's shapes, 64 rows an expert
@example(H=64, I=64, T=1, E=2, k=1, seed=1)  # one row: a row group of one
def test_as_accurate_as_the_unfused_path(H: int, I: int, T: int, E: int, k: int, seed: int) -> None:
    k = min(k, E - 1)
    dense = [dense_weights(H, I, seed + e) for e in range(E)]
    ws = [packed(*d) for d in dense]
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed))  # [T, H]
    top_w, top_i = routing(T, E, k, seed)
    want = exact(x, top_w, top_i, dense)
    got, ref = run(x, top_w, top_i, ws, E, True), run(x, top_w, top_i, ws, E, False)
    err, ref_err = (got.double() - want).abs(), (ref.double() - want).abs()  # [T, H]
    scale = want.abs().max().item()
    assert err.max().item() <= max(2 * ref_err.max().item(), 1e-6 * scale)
    assert err.mean().item() <= max(1.5 * ref_err.mean().item(), 1e-7 * scale)


def test_silu_within_two_ulps_of_torch_at_the_edges_of_exp() -> None:
    """h = silu(x[j]) * x[32 + j] (j < 32) read out through a one-hot gate, up and down (every product but
    one zero, so the sums add nothing): against torch's F.silu for values where exp(-x)
    overflows, underflows or is near 1, and silu itself is subnormal."""
    H, I = 64, 64
    gate_up = torch.zeros(2 * I, H)
    n = 32  # values tried: gate j < 32 reads x[j], up j reads x[32 + j]; gate and up j >= 32 read nothing
    gate_up[torch.arange(n), torch.arange(n)] = 1.0
    gate_up[I + torch.arange(n), n + torch.arange(n)] = 1.0
    down = torch.zeros(H, I)
    down[torch.arange(n), torch.arange(n)] = 1.0  # out[c] = h[c] for c < 32
    ws = [packed(gate_up, down), packed(gate_up, down)]
    v = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 0.5, -0.5, 1.0, -1.0, 3.7, -3.7, 15.0, -15.0, 80.0,
                      -80.0, 87.5, -87.5, 88.8, -88.8, 89.5, -89.5, 103.0, -103.0, 110.0, -110.0, 1e30, -1e30, 20.25,
                      -20.25, 0.3466, -0.3466])  # [32]
    x = torch.cat([v, torch.ones(n)])[None]  # [1, H]
    got = run(x, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int64), ws, 2, True)[0, :n]
    want = torch.nn.functional.silu(v)
    ulp = torch.maximum((torch.nextafter(want.abs(), torch.tensor(float("inf"))) - want.abs()),
                        torch.tensor(torch.finfo(torch.float32).tiny))
    assert ((got - want).abs() <= 2 * ulp).all(), (got, want)  # a zero's sign is the output's add's (both paths)


@pytest.mark.parametrize("T,E,k", [(1100, 2, 1), (700, 3, 2)])
def test_more_rows_than_a_part_run_as_several(T: int, E: int, k: int) -> None:
    """Prefill's thousands of rows an expert: parts of MAX_ROWS, as accurate as the unfused path."""
    H, I = 64, 128
    dense = [dense_weights(H, I, e) for e in range(E)]
    ws = [packed(*d) for d in dense]
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    top_w, top_i = routing(T, E + 1, k, T)  # E + 1 experts routed, the last never chosen: E used
    ws.append(None)
    want = exact(x, top_w, top_i, dense)
    got, ref = run(x, top_w, top_i, ws, E + 1, True), run(x, top_w, top_i, ws, E + 1, False)
    assert (got.double() - want).abs().max() <= 2 * (ref.double() - want).abs().max() + 1e-7


def test_kernels_experts_runs_it_for_a_layer_read_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 with `together`: one native call for the layer, experts no token chose never fetched;
    without `together` (weights streamed into slots) the path expert by expert."""
    E, H, I, T = 6, 64, 128, 40
    ws = [packed(*dense_weights(H, I, e)) for e in range(E)]
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    top_w, top_i = routing(T, E, 2, 2)
    calls, fetched = [], []
    original = expert_fp32.layer
    monkeypatch.setattr(expert_fp32, "layer", lambda *a: calls.append(1) or original(*a))

    def fetch(used: list[int]):
        fetched.append(used)
        return (ws[e] for e in used)

    on = kernels.experts(x, top_w, top_i, fetch, E, "silu", 64, together=True)[0]
    assert calls == [1] and E - 1 not in fetched[-1]
    off = kernels.experts(x, top_w, top_i, fetch, E, "silu", 64, together=False)[0]
    assert calls == [1]
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("out_features,in_features", [(2304, 768), (768, 1152), (128, 64)])
def test_layout_probe_finds_onednn_blocks(out_features: int, in_features: int) -> None:
    assert expert_fp32.blocked(out_features, in_features, 1024)


def test_declines_without_writing(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 rows, unpacked weights, an intermediate or a hidden size not a multiple of 64, the
    switch off: False and `out` untouched."""
    E, T = 3, 10
    top_w, top_i = routing(T, E, 2, 5)
    counts = torch.bincount(top_i.reshape(-1), minlength=E).tolist()

    def declines(H: int, I: int, weights=None, dtype=torch.float32) -> bool:
        ws = weights or {e: packed(*dense_weights(H, I, e)) for e in range(E)}
        x, out = torch.randn(T, H).to(dtype), torch.zeros(T, H, dtype=dtype)
        return not expert_fp32.layer(x, top_w, top_i, counts, ws, out) and not out.any()

    assert declines(64, 128, dtype=torch.bfloat16)
    assert declines(64, 128, {e: (torch.zeros(256, 64), None, torch.zeros(64, 128)) for e in range(E)})
    assert declines(64, 96)
    assert declines(96, 64)
    assert not declines(64, 128)  # the case itself runs
    monkeypatch.setenv("MOECC_EXPERT_FP32", "0")
    assert declines(64, 128)
