"""kernels.experts: tokens grouped by expert and run in chunks give the same output as a
naive per-token loop; experts nobody chose are never fetched, each chosen one exactly once,
and every (token, expert) pair is computed exactly once.

Legend: T = tokens, H = hidden size, I = expert intermediate size, E = experts,
k = experts per token."""

from __future__ import annotations

import pytest
import torch

from moecc_runtime.worker import kernels

H, I, E, K = 8, 5, 6, 2
UNCHOSEN = (1, 4)  # experts no token picks in the random cases


def expert_bank(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Tiny random expert weights: (gate [I, H], up [I, H], down [H, I]) per expert."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(I, H, generator=g) * 0.5, torch.randn(I, H, generator=g) * 0.5,
             torch.randn(H, I, generator=g) * 0.5) for _ in range(E)]


def routing(T: int, seed: int, allowed: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H]; top_i [T, k] distinct per row, drawn from `allowed`; top_w [T, k] fp32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    top_i = torch.stack([torch.tensor(allowed)[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(T)]) \
        if T else torch.empty(0, K, dtype=torch.long)
    top_w = torch.rand(T, K, generator=g) + 0.1
    top_w = top_w / top_w.sum(-1, keepdim=True)
    return x, top_i, top_w


def reference(x, top_w, top_i, bank, act="silu") -> torch.Tensor:
    """The naive loop: out[t] = sum_j w[t, j] * gated_mlp(x[t], expert top_i[t, j])."""
    out = torch.zeros_like(x)  # [T, H]
    f = kernels.ACTIVATIONS[act]
    for t in range(x.shape[0]):
        for j in range(top_i.shape[1]):
            gate, up, down = bank[int(top_i[t, j])]
            xt = x[t]  # [H]
            out[t] += top_w[t, j] * (down @ (f(gate @ xt) * (up @ xt)))
    return out


class Fetches:
    """A fetch callback that records which experts were asked for (the list it is given
    up front, and the ones actually consumed)."""

    def __init__(self, bank):
        self.bank, self.calls, self.asked = bank, [], []

    def __call__(self, used: list[int]):
        self.asked.append(list(used))
        for e in used:
            self.calls.append(e)
            yield self.bank[e]


CASES = [  # (T, seed, experts the tokens pick from)
    (7, 0, [e for e in range(E) if e not in UNCHOSEN]),
    (13, 1, [e for e in range(E) if e not in UNCHOSEN]),
    (5, 2, [0, 5]),  # every token picks the same two experts: one group of T rows each
    (1, 3, [2, 3, 4]),  # a single token
    (20, 4, list(range(E))),
]


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("T,seed,allowed", CASES)
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_experts_match_naive_loop(T, seed, allowed, chunk, act):
    bank = expert_bank(seed)
    x, top_i, top_w = routing(T, seed, allowed)
    fetch = Fetches(bank)
    out, used = kernels.experts(x, top_w, top_i, fetch, E, act, chunk)  # [T, H]
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, reference(x, top_w, top_i, bank, act), atol=1e-5, rtol=1e-5)
    chosen = sorted(set(top_i.flatten().tolist()))
    assert sorted(fetch.calls) == chosen, "each chosen expert fetched exactly once, no other"
    assert fetch.asked in ([chosen], []) and fetch.calls == chosen, "told the whole list first, in order"
    assert len(fetch.calls) == len(set(fetch.calls))
    assert used == len(chosen)
    if allowed != list(range(E)):
        assert not set(fetch.calls) & (set(range(E)) - set(allowed)), "an expert nobody chose was fetched"


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_every_token_expert_pair_computed_once(monkeypatch, chunk):
    """Patch gated_mlp to log which (token, expert) rows it computes: each pair of top_i once,
    nothing else, in calls of at most `chunk` rows, each call for one expert only."""
    T = 11
    bank = expert_bank(7)
    x, top_i, top_w = routing(T, 7, [0, 2, 3, 5])
    x[:, 0] = torch.arange(T, dtype=x.dtype)  # column 0 names the token of each row
    expert_of = {id(w[0]): e for e, w in enumerate(bank)}  # gate tensor -> expert
    log: list[tuple[int, list[int]]] = []
    real = kernels.gated_mlp

    def spy(xs, gate, up, down, act):
        log.append((expert_of[id(gate)], xs[:, 0].round().long().tolist()))
        return real(xs, gate, up, down, act)

    monkeypatch.setattr(kernels, "gated_mlp", spy)
    out, used = kernels.experts(x, top_w, top_i, Fetches(bank), E, "silu", chunk)
    pairs = sorted((t, e) for e, toks in log for t in toks)
    want = sorted((t, int(top_i[t, j])) for t in range(T) for j in range(K))
    assert pairs == want
    assert all(0 < len(toks) <= chunk for _, toks in log)
    rows = torch.zeros(E, dtype=torch.long)
    for e, toks in log:
        rows[e] += len(toks)
    assert torch.equal(rows, torch.bincount(top_i.flatten(), minlength=E))
    # the experts run one after another: each expert's calls are consecutive
    order = [e for e, _ in log]
    assert order == sorted(order)
    assert used == 4
    torch.testing.assert_close(out, reference(x, top_w, top_i, bank), atol=1e-5, rtol=1e-5)


def test_pair_contributions_are_isolated():
    """Without patching: experts whose MLP output is a constant one-hot direction per expert
    (gate/up fixed, down picks column e) make out[t] the sum of w[t, j] on expert top_i[t, j]'s
    column, so a pair computed twice or dropped shows up exactly."""
    T, Hh = 9, E
    gate = torch.zeros(1, Hh)
    up = torch.zeros(1, Hh)
    # with x[:, 0] = 20 every token's hidden unit is silu(gate @ x) * (up @ x) = silu(20) * 1
    gate[0, 0] = 1.0
    up[0, 0] = 0.05
    bank = []
    for e in range(E):
        down = torch.zeros(Hh, 1)
        down[e, 0] = 1.0
        bank.append((gate, up, down))
    g = torch.Generator().manual_seed(3)
    x = torch.zeros(T, Hh)
    x[:, 0] = 20.0
    top_i = torch.stack([torch.tensor([0, 2, 3, 5])[torch.randperm(4, generator=g)[:K]] for _ in range(T)])
    top_w = torch.rand(T, K, generator=g)
    unit = torch.nn.functional.silu(torch.tensor(20.0))  # the hidden unit, for every token
    want = torch.zeros(T, Hh)
    for t in range(T):
        for j in range(K):
            want[t, top_i[t, j]] += top_w[t, j] * unit
    for chunk in (1, 2, 100):
        out, used = kernels.experts(x, top_w, top_i, Fetches(bank), E, "silu", chunk)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-6)
        assert used == len(set(top_i.flatten().tolist()))


def test_no_tokens():
    bank = expert_bank()
    fetch = Fetches(bank)
    x = torch.empty(0, H)  # [0, H]
    out, used = kernels.experts(x, torch.empty(0, K), torch.empty(0, K, dtype=torch.long), fetch, E, "silu", 4)
    assert out.shape == (0, H) and used == 0 and fetch.calls == []


def test_bf16_activations_with_fp32_weights_accumulate_in_x_dtype():
    """x in bf16 and routing weights in fp32 (the router's default): the output keeps x's dtype
    and is close to the fp32 reference."""
    bank = [tuple(w.to(torch.bfloat16) for w in ws) for ws in expert_bank(5)]
    x, top_i, top_w = routing(6, 5, [0, 2, 3])
    xb = x.to(torch.bfloat16)
    out, used = kernels.experts(xb, top_w, top_i, Fetches(bank), E, "silu", 2)
    assert out.dtype == torch.bfloat16 and used == 3
    ref = reference(xb.float(), top_w, top_i, [tuple(w.float() for w in ws) for ws in bank])
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=5e-2)
