"""The batched sampler (runtime/sampling/): every row of a step drawn at once, exact in
distribution against a reference that sorts and truncates each row by itself, and a seeded
request's tokens independent of what else is in the step (issue 29, item 5)."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moecc_runtime.sampling import DrawParams, SamplingParams, draw, request_generator, sample
import moecc_runtime.sampling.draw_rows as draw_module
from moecc_runtime import native


@pytest.fixture(params=["native", "tensors"])
def first_tier(request, monkeypatch):
    """Each draw test twice: the first tier in the native kernel (where it was built) and in
    tensor ops (as on a GPU)."""
    if request.param == "native" and not native.sampling_available():
        pytest.skip("the sampler's native pass was not built")
    if request.param == "tensors":
        monkeypatch.setattr(draw_module.native, "sampling_available", lambda: False)
    return request.param


def reference_probs(logits: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """[V] float64: softmax(logits / t) truncated by top-k, then top-p (the crossing token
    kept), then min-p, renormalised: the distribution each row must be drawn from."""
    p = torch.softmax(logits.double() / t, dim=-1)
    order = torch.argsort(p, descending=True, stable=True)
    ps = p[order]
    keep = torch.ones_like(ps, dtype=torch.bool)
    if 0 < top_k < ps.numel():
        keep[top_k:] = False
    if top_p < 1.0:
        keep &= (ps.cumsum(0) - ps) < top_p
    keep &= ps >= min_p * ps[0]
    keep[0] = True
    out = torch.zeros_like(p)
    out[order[keep]] = ps[keep] / ps[keep].sum()
    return out


def grid_histogram(logits: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """Draw one row at n evenly spaced uniforms: the share of each token [V]."""
    R = n
    x = logits.float().repeat(R, 1)
    u = (torch.arange(R, dtype=torch.float32) + 0.5) / R
    p = DrawParams([kw.get("t", 1.0)] * R, [kw.get("top_k", 0)] * R, [kw.get("top_p", 1.0)] * R,
                   [kw.get("min_p", 0.0)] * R)
    tok = draw(x, p, u)
    return torch.bincount(tok, minlength=logits.numel()).double() / R


def peaked(V: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * scale


CASES = [dict(t=1.0), dict(t=0.7), dict(t=1.0, top_k=5), dict(t=0.8, top_p=0.9), dict(t=1.3, min_p=0.05),
         dict(t=1.0, top_k=200, top_p=0.97), dict(t=2.0, top_p=0.999)]


def test_each_truncation_draws_the_reference_distribution(first_tier) -> None:
    V, n = 500, 8000  # V > the first tier's 64 candidates: the second settles the rest
    for case in CASES:
        logits = peaked(V, 1)
        want = reference_probs(logits, case.get("t", 1.0), case.get("top_k", 0), case.get("top_p", 1.0),
                               case.get("min_p", 0.0))
        got = grid_histogram(logits, n, **case)
        assert (got - want).abs().max() <= 2.0 / n + 1e-6, case
        assert not bool((got > 0)[want == 0].any()), f"{case}: a token outside the kept set was drawn"


def test_past_the_last_tier_the_tail_and_the_sorted_path_draw_the_reference(first_tier, monkeypatch) -> None:
    """A nearly flat row over more tokens than the last tier: untruncated, u past the tier's
    mass draws in the rest of the vocabulary; a 0.999 nucleus sorts the whole row. (Tiers
    made small so a small vocabulary passes them.)"""
    monkeypatch.setattr(draw_module, "TIERS", (8, 32))
    V, n = 500, 6000
    logits = peaked(V, 2, scale=0.3)
    for case in (dict(t=1.0), dict(t=1.0, top_p=0.999)):
        want = reference_probs(logits, 1.0, 0, case.get("top_p", 1.0), 0.0)
        got = grid_histogram(logits, n, **case)
        assert (got - want).abs().max() <= 2.0 / n + 1e-6, case
        assert not bool((got > 0)[want == 0].any())


def test_a_seeded_request_draws_the_same_whatever_else_runs(first_tier) -> None:
    """Request "a" (seed 7) alone, then at another row among others, for 5 steps: the same tokens."""
    V = 2000
    logits = [peaked(V, s) for s in range(5)]
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=0)
    others = [SamplingParams(temperature=t, top_p=1.0, top_k=k) for t, k in ((0.0, 0), (1.2, 0), (0.5, 40))]

    def run(rows_before: int) -> list[int]:
        g = request_generator(7, "a")
        gens = [request_generator(i, f"o{i}") for i in range(3)]
        got = []
        for step in range(5):
            ps = others[:rows_before] + [params] + others[rows_before:]
            gs = gens[:rows_before] + [g] + gens[rows_before:]
            x = torch.stack([peaked(V, 100 + step + i) for i in range(rows_before)] + [logits[step]]
                            + [peaked(V, 200 + step + i) for i in range(3 - rows_before)])
            got.append(int(sample(x, ps, gs)[rows_before]))
        return got

    assert run(0) == run(2) == run(3)


@settings(max_examples=60, deadline=None)
@given(V=st.integers(2, 300), t=st.floats(1e-3, 5.0), top_k=st.integers(0, 80), top_p=st.floats(0.05, 1.0),
       min_p=st.sampled_from([0.0, 0.01, 0.2]), u=st.floats(0.0, 0.999999), seed=st.integers(0, 1000))
def test_a_drawn_token_is_always_one_the_reference_keeps(V, t, top_k, top_p, min_p, u, seed) -> None:
    logits = peaked(V, seed, scale=4.0)
    want = reference_probs(logits, t, top_k, top_p, min_p)
    tok = int(draw(logits.float()[None].clone(), DrawParams([t], [top_k], [top_p], [min_p]),
                   torch.tensor([u]))[0])
    assert want[tok] > 0, (tok, float(want[tok]))


def test_greedy_rows_and_non_finite_rows() -> None:
    x = torch.randn(6, 300)
    x[2, 7] = x[4, 9] = float("nan")
    x[3] = x[5] = float("-inf")
    ps = [SamplingParams(temperature=0.0, top_p=1.0, top_k=0), SamplingParams(temperature=0.9, top_p=0.9, top_k=0)] * 3
    gens = [None, request_generator(1, "x"), None, request_generator(2, "y"), None, request_generator(3, "z")]
    out = sample(x, ps, gens).tolist()
    assert out[0] == int(x[0].argmax()) and 0 <= out[1] < 300 and out[2:] == [-1, -1, -1, -1]
    drawn = sample(x[[1, 4, 5]], [ps[1]] * 3, [request_generator(1, "x"), None, None]).tolist()
    assert drawn == [out[1], -1, -1]  # every row drawn, the non-finite ones among them
