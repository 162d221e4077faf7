"""The runtime's compute kernels, one per plan op (gpt-fast style).

Legend: T = tokens in this call, H = hidden size, I = expert/MLP intermediate size,
E = experts, k = experts per token, V = vocabulary, n = query tokens of one sequence,
c = context tokens of one sequence, Hq / Hkv = query / key-value heads, G = Hq / Hkv,
B = sequences in one call, D = head dim.
Numerics follow transformers' eager modules (norms in fp32, routing softmax in fp32).
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moecc_runtime.contract.activations import ACTIVATIONS
from moecc_runtime.native import expert_amx, expert_fp32, expert_rows
from moecc_runtime.native import rope as native_rope
from moecc_runtime.native import rmsnorm as native_rmsnorm
from moecc_runtime.syncs import to_list



#: rows a host rmsnorm normalises at a time: its fp32 temporaries (rows x H x 4 bytes each)
#: stay in L2 instead of streaming a prefill step's [8192, H] through memory five times; twice
#: as many at a hidden size up to NORM_WIDE_H, where the per-op cost of small chunks weighs more
#: (a 2-core Xeon, 8,192 bf16 rows of 768: 5.9 ms at 128 rows, 4.4 at 256; of 2,048: 22.9 at 128,
#: 25.1 at 256)
NORM_ROWS = 128
NORM_WIDE_H = 1024


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: in fp32, rounded to x's dtype, times w. On a CPU, one native pass
    over each row where it applies (native/rmsnorm.py), else NORM_ROWS rows at a time; both with
    the same bits (each row's reduction is its own). Rows that are not contiguous (a column-major
    view) are normalised whole: torch sums across such rows together, in an order that depends
    on how many there are.
    x: [T, ..., H]  w: [H] -> [T, ..., H]"""
    out = native_rmsnorm.rmsnorm(x, w, eps)  # None off the host or where it does not apply
    if out is not None:
        return out
    T = x.shape[0] if x.dim() > 1 else 0
    rows = NORM_ROWS * (2 if x.numel() <= T * NORM_WIDE_H else 1)
    if x.device.type != "cpu" or T <= rows or x.stride(-1) != 1:
        return _rmsnorm(x, w, eps)
    out = torch.empty(x.shape, dtype=torch.promote_types(w.dtype, x.dtype))  # [T, ..., H]: w * x's dtype
    for s in range(0, T, rows):
        out[s:s + rows] = _rmsnorm(x[s:s + rows], w, eps)
    return out


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., H]  w: [H]
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dtype)


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    # positions: [T] -> [T, 2D] = cat(cos [T, D], sin [T, D])
    freqs = positions.float()[:, None] * inv_freq[None, :].to(positions.device)  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return torch.cat(((emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1), with
    the same bits (each product rounded, then their sum: -(x2 s) + a is a - x2 s exactly),
    computed by halves: no rotated copy, no negated one.
    x: [n, heads, D] (any strides)  cos/sin: [n, D] -> [n, heads, D]"""
    out = native_rope.rope(x, cos, sin)  # one pass on the host, same bits
    if out is not None:
        return out
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]  # [n, heads, D/2] each
    c1, c2 = cos[:, None, :h], cos[:, None, h:]  # [n, 1, D/2] each
    s1, s2 = sin[:, None, :h], sin[:, None, h:]
    if x.dtype == torch.bfloat16:  # bf16 in place on strided halves takes torch's slow path
        return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)
    out = x * cos[:, None, :]  # [n, heads, D]
    out[..., :h] -= x2 * s1
    out[..., h:] += x1 * s2
    return out


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T + b. w: a tensor, or a weight laid out for the host GEMM
    (memory/packed_weights.PackedLinear), which computes the same product.
    x: [T, in]  w: [out, in] -> [T, out]"""
    if not isinstance(w, torch.Tensor):
        return w(x, b)
    return F.linear(x, w, b)


def attention_qkv(x: torch.Tensor, w: dict[str, torch.Tensor], a: dict, rope: torch.Tensor):
    """Project, q/k-norm and rotate one micro-batch's tokens: q [T, Hq, D], k/v [T, Hkv, D]."""
    D, Hq, Hkv = a["head_dim"], a["num_heads"], a["num_kv_heads"]
    if w["k"] is None:  # q, k and v packed stacked (memory/packed_weights.py): one GEMM, then column views
        q, k, v = linear(x, w["q"]).split(w["q"].sections, dim=-1)  # [T, Hq*D], [T, Hkv*D] x2
    else:
        q = linear(x, w["q"], w.get("q_bias"))  # [T, Hq*D]
        k = linear(x, w["k"], w.get("k_bias"))  # [T, Hkv*D]
        v = linear(x, w["v"], w.get("v_bias"))
    full = a.get("qk_norm") == "full"  # OLMoE: over the whole projection, before the head split
    if "q_norm" in w and full:
        q = rmsnorm(q, w["q_norm"], a["qk_norm_eps"])
        k = rmsnorm(k, w["k_norm"], a["qk_norm_eps"])
    if "clip_qkv" in a:
        c = a["clip_qkv"]
        q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
    cos, sin = rope[:, :D], rope[:, D:]
    if _side_by_side(q, k) and "q_norm" not in w:  # packed q|k (no clip or full norm copied them): as one
        qk = apply_rope(q.as_strided((q.shape[0], Hq + Hkv, D), (q.stride(0), D, 1)), cos, sin)  # [T, Hq+Hkv, D]
        return qk[:, :Hq], qk[:, Hq:], v.view(-1, Hkv, D)  # [T, Hq, D], [T, Hkv, D] views
    q, k, v = q.view(-1, Hq, D), k.view(-1, Hkv, D), v.view(-1, Hkv, D)
    if "q_norm" in w and not full:  # Qwen3: per head
        q = rmsnorm(q, w["q_norm"], a["qk_norm_eps"])
        k = rmsnorm(k, w["k_norm"], a["qk_norm_eps"])
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _side_by_side(q: torch.Tensor, k: torch.Tensor) -> bool:
    """k's columns follow q's in one row-major buffer (the packed q|k|v GEMM's output split):
    q [T, Hq*D], k [T, Hkv*D] with one row stride and unit column strides, in one storage
    (two tensors that merely lie next to each other in memory are not)."""
    return (q.dim() == 2 and q.stride(1) == 1 and k.stride() == q.stride()
            and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
            and k.data_ptr() == q.data_ptr() + q.shape[1] * q.element_size())


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] pairs (x0, x1), (x2, x3)... -> evens then odds (DeepSeek's rope_interleave)."""
    d = x.shape[-1]
    return x.view(*x.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(*x.shape[:-1], d)


def mla_qkv(x: torch.Tensor, w: dict[str, torch.Tensor], a: dict, rope: torch.Tensor):
    """Multi-head latent attention, absorbed form. Returns the query [t, nh, kl+R] (latent
    query q_nope @ W_UK, then the rotated rope part), the cached key [t, 1, kl+R] (normed
    latent, then the rotated shared rope key), an empty value [t, 1, 0], and `finish`, which
    maps attention's latent output [t, nh*kl] through W_UV and o_proj to [t, H].
    Legend: nh heads, kl kv_lora_rank, R qk_rope_head_dim, n qk_nope_head_dim, v v_head_dim."""
    nh, kl, R = a["num_heads"], a["kv_lora_rank"], a["qk_rope_head_dim"]
    n, vd, eps = a["qk_nope_head_dim"], a["v_head_dim"], a["norm_eps"]
    if "q_a" in w:
        q = linear(rmsnorm(linear(x, w["q_a"], w.get("q_a_bias")), w["q_a_norm"], eps), w["q_b"])  # [t, nh*(n+R)]
    else:
        q = linear(x, w["q"], w.get("q_bias"))
    q = q.view(-1, nh, n + R)
    q_nope, q_rot = q[..., :n], q[..., n:]  # [t, nh, n], [t, nh, R]
    ckv = linear(x, w["kv_a"], w.get("kv_a_bias"))  # [t, kl+R]
    latent = rmsnorm(ckv[:, :kl], w["kv_a_norm"], eps)  # [t, kl]
    k_rot = ckv[:, None, kl:]  # [t, 1, R]
    if a.get("rope_interleave"):
        q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
    cos, sin = rope[:, :R], rope[:, R:]
    q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
    wkv = w["kv_b"].view(nh, n + vd, kl)  # [nh, n+v, kl]
    q_lat = torch.einsum("thn,hnk->thk", q_nope, wkv[:, :n])  # [t, nh, kl]
    query = torch.cat((q_lat, q_rot), dim=-1)  # [t, nh, kl+R]
    key = torch.cat((latent[:, None, :], k_rot), dim=-1)  # [t, 1, kl+R]
    value = key.new_empty(key.shape[0], 1, 0)  # [t, 1, 0]

    def finish(out: torch.Tensor) -> torch.Tensor:  # [t, nh*kl] -> [t, H]
        o = torch.einsum("thk,hvk->thv", out.view(-1, nh, kl), wkv[:, n:])  # [t, nh, v]
        return linear(o.reshape(-1, nh * vd), w["o"], w.get("o_bias"))

    return query, key, value, finish


def sink_softmax(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Softmax over each row of `scores` plus one extra logit per head (gpt-oss's attention
    sink) that takes probability mass but has no value; the sink's column is dropped.
    scores: [..., c] (masked positions -inf)  sink: broadcastable to [..., 1] -> [..., c]"""
    combined = torch.cat([scores, sink.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)  # [..., c+1]
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                   scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with sinks, written out (SDPA has no extra logit). q: [B, Hkv, G, n, D],
    k: [B, Hkv, 1, c, D], v: [B, Hkv, 1, c, Dv], allowed: bool, broadcastable to
    [B, Hkv, G, n, c], sinks: [Hkv*G] (query head h = kv head h // G) -> [B, Hkv, G, n, Dv]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hkv, G, n, c]
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    Hkv, G = q.shape[1], q.shape[2]
    probs = sink_softmax(scores, sinks.view(1, Hkv, G, 1, 1))
    return torch.matmul(probs.to(v.dtype), v)


# cuDNN's attention builds an execution plan for every new shape: on an H200 with torch 2.11 that
# cost ~7 ms of host time a call, and a step's ragged groups make most calls new shapes (the
# first device run's "device" placement spent 20 s of 28 there). These backends take any shape.
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """F.scaled_dot_product_attention(q, k, v, **kw), on CUDA without cuDNN's backend (above);
    every SDPA call of the runtime goes through here."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **kw)
    with sdpa_kernel(CUDA_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, a: dict,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence's n new queries at positions start..start+n-1 over
    its cache (which already holds their K/V), with gpt-oss's `sinks` [Hq] when given.
    q: [n, Hq, D]; caches: [Hkv, c, D] -> [n, Hq*D]."""
    n = q.shape[0]
    c = start + n
    window = a.get("sliding_window")
    qh = q.transpose(0, 1)[None]  # [1, Hq, n, D]
    kh, vh = k_cache[None, :, :c], v_cache[None, :, :c]  # [1, Hkv, c, D]
    mask = None
    causal = False
    if window is not None and c > window or (n > 1 and start > 0):
        qpos = torch.arange(start, c, device=q.device)[:, None]  # [n, 1]
        kpos = torch.arange(c, device=q.device)[None, :]  # [1, c]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        mask = allowed[None, None]
    elif n > 1:
        causal = True
    if sinks is not None:
        Hkv = k_cache.shape[0]
        G = q.shape[1] // Hkv
        if causal:
            allowed = torch.ones(n, c, dtype=torch.bool, device=q.device).tril(diagonal=c - n)
        else:
            allowed = mask[0, 0] if mask is not None else None  # [n, c]
        qg = q.view(n, Hkv, G, -1).permute(1, 2, 0, 3)[None]  # [1, Hkv, G, n, D]
        o = sink_attention(qg, k_cache[None, :, None, :c], v_cache[None, :, None, :c], allowed, a["scaling"], sinks)
        return o[0].permute(2, 0, 1, 3).reshape(n, -1)  # [n, Hq*Dv]
    out = sdpa(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=a["scaling"], enable_gqa=True)  # [1, Hq, n, D]
    return out[0].transpose(0, 1).reshape(n, -1)


#: fresh prompts batched into one SDPA call: at most this many query rows, padding included
PROMPT_BATCH_ROWS = 8192
#: a prompt joins a batch only if the batch's longest is at most this much longer (padding bound).
#: 1.0: equal lengths only. Padding changes the SDPA kernel's blocking, so a padded prompt's
#: bf16 attention rounds differently from its own call (transformers' one-prompt reference:
#: tests/runtime/formats/test_fp8.py holds the first step's logits to it bit for bit); on a
#: 32-token average it bought no measurable step time either (bench/results/README.md)
PROMPT_PAD_RATIO = 1.0


def prompt_batches(spans: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Fresh prompts (row spans [lo, hi)) grouped for attend_prompts: longest first, a group
    closed when the next is shorter than its longest / PROMPT_PAD_RATIO or the padded rows
    would pass PROMPT_BATCH_ROWS. Every span in exactly one group."""
    groups: list[list[tuple[int, int]]] = []
    for lo, hi in sorted(spans, key=lambda s: s[0] - s[1]):
        g = groups[-1] if groups else None
        if g is not None:
            longest = g[0][1] - g[0][0]
            if (hi - lo) * PROMPT_PAD_RATIO >= longest and (len(g) + 1) * longest <= PROMPT_BATCH_ROWS:
                g.append((lo, hi))
                continue
        groups.append([(lo, hi)])
    return groups


def attend_prompts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]],
                   scale: float, out: torch.Tensor) -> None:
    """Causal attention of fresh prompts (each span's rows are its whole context, positions 0..n-1)
    in one SDPA call per prompt_batches group: right-padded to the group's longest n (none with
    PROMPT_PAD_RATIO 1), so causality alone keeps every real query off the (zeroed) padding.
    Multi-head attention without sinks or a window shorter than the prompts.
    q: [t, Hq, D]  k/v: [t, Hkv, D] -> out[lo:hi] [n, Hq, D]."""
    for group in prompt_batches(spans):
        S, n = len(group), group[0][1] - group[0][0]
        rows = (torch.tensor([lo for lo, _ in group])[:, None] + torch.arange(n)).reshape(-1)  # [S*n] rows of q/k/v, out
        at = None  # [r] places of those rows in the batch where some are padding
        if any(hi - lo != n for lo, hi in group):  # padded: only each prompt's own rows
            real = (torch.arange(n) < torch.tensor([hi - lo for lo, hi in group])[:, None]).reshape(-1)  # [S*n]
            rows, at = rows[real], torch.arange(S * n)[real]  # [r]
        qb, kb, vb = (_padded(x, rows, at, S * n).view(S, n, *x.shape[1:]) for x in (q, k, v))  # [S, n, H*, D]
        o = sdpa(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                 is_causal=True, scale=scale, enable_gqa=True)  # [S, Hq, n, Dv]
        Hq, Dv = o.shape[1], o.shape[3]
        o = o.transpose(1, 2).reshape(S * n, Hq, Dv)  # [S*n, Hq, Dv]
        out.index_copy_(0, rows, (o if at is None else o.index_select(0, at)).to(out.dtype))


def _padded(x: torch.Tensor, rows: torch.Tensor, at: torch.Tensor | None, m: int) -> torch.Tensor:
    """x's `rows` placed at `at` of m rows, the others zero: [m, ...] (the gather alone where `at`
    is None: no row is padding)."""
    picked = x.index_select(0, rows)  # [r, ...]
    if at is None:
        return picked
    return x.new_zeros((m, *x.shape[1:])).index_copy_(0, at, picked)


def route(x: torch.Tensor, w: torch.Tensor, a: dict, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing. x: [T, H], w: [E, H] -> weights [T, k] (fp32, or the model dtype
    where the model's router returns that), index [T, k]. DeepSeek-V2 (`routed_scaling_factor`,
    `topk_method`): in fp32, optionally only within the top groups (a group scored by its best
    expert), scaled. `a["scoring"]` "sigmoid" is DeepSeek-V3's: see route_grouped."""
    if a.get("scoring", "softmax") == "sigmoid":
        return route_grouped(x, w, a, bias)
    if a.get("scoring") == "topk_softmax":  # gpt-oss: biased logits, top-k, softmax over those k
        top_v, top_i = torch.topk(linear(x, w, bias), a["top_k"], dim=-1)  # [T, k]
        return torch.softmax(top_v, dim=-1, dtype=top_v.dtype), top_i
    if "routed_scaling_factor" in a:  # DeepSeek-V2 routes in fp32
        logits = F.linear(x.float(), w.float())  # [T, E]
    else:
        logits = linear(x, w)  # [T, E]
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    if a.get("topk_method") == "group_limited_greedy":  # groups scored by their best expert
        T, E, G = probs.shape[0], probs.shape[1], int(a["num_groups"])
        group = probs.view(T, G, E // G).max(dim=-1).values  # [T, G]
        keep = torch.zeros_like(group).scatter_(1, torch.topk(group, int(a["topk_groups"]), dim=-1)[1], 1.0)
        probs = probs.masked_fill(~keep.unsqueeze(-1).expand(T, G, E // G).reshape(T, E).bool(), 0.0)
    top_w, top_i = torch.topk(probs, a["top_k"], dim=-1)  # [T, k]
    if a.get("norm_topk_prob", True):
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    if "routed_scaling_factor" in a:
        top_w = top_w * float(a["routed_scaling_factor"])
    if a.get("weights_in_model_dtype", False):
        top_w = top_w.to(x.dtype)
    return top_w, top_i


def route_grouped(x: torch.Tensor, w: torch.Tensor, a: dict, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing, in fp32: sigmoid scores; choice scores = scores + correction bias;
    experts in G groups, a group scored by the sum of its best two choice scores; only the
    top `topk_groups` groups compete; top-k by choice score, weighted by the plain score,
    renormalised (norm_topk_prob) and scaled by routed_scaling_factor.
    x: [T, H]  w: [E, H]  bias: [E] -> weights [T, k] fp32, index [T, k]."""
    T = x.shape[0]
    E, G = w.shape[0], int(a["num_groups"])
    scores = F.linear(x.float(), w.float()).sigmoid()  # [T, E]
    choice = scores + bias.float() if bias is not None else scores  # [T, E]
    group = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    keep = torch.zeros_like(group).scatter_(1, torch.topk(group, int(a["topk_groups"]), dim=-1)[1], 1.0)  # [T, G]
    allowed = keep.unsqueeze(-1).expand(T, G, E // G).reshape(T, E).bool()  # [T, E]
    top_i = torch.topk(choice.masked_fill(~allowed, float("-inf")), a["top_k"], dim=-1)[1]  # [T, k]
    top_w = scores.gather(1, top_i)  # [T, k]
    if a.get("norm_topk_prob", True):
        top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
    return top_w * float(a.get("routed_scaling_factor", 1.0)), top_i


def merged_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """gate and up [I, H] as one [2I, H] view when `up` lies right after `gate` in the same
    storage (a fused checkpoint's gate_up_proj, an expert streamed into a slot), else None.
    Never copies."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        return None
    if not (gate.is_contiguous() and up.is_contiguous()) or gate.dim() != 2:
        return None
    if gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr():
        return None
    if up.data_ptr() != gate.data_ptr() + gate.numel() * gate.element_size():
        return None
    return gate.as_strided((2 * gate.shape[0], gate.shape[1]), gate.stride())


def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None, down: torch.Tensor,
              act: str) -> torch.Tensor:
    """act(x @ gate^T) * (x @ up^T) @ down^T; gate and up in one GEMM where they are stored
    back to back (merged_gate_up) or packed stacked (`up` None: `gate` a PackedLinear of
    [2I, H] whose `split` is I). x: [T, H]  gate/up: [I, H]  down: [H, I] -> [T, H]"""
    gu = gate if up is None else merged_gate_up(gate, up)
    if gu is not None:
        both = linear(x, gu)  # [T, 2I]
        n = gate.split if up is None else gate.shape[0]
        h = expert_rows.silu_mul(both, n) if ACTIVATIONS[act] is F.silu else None  # [T, I]: one host pass, same bits
        if h is None:
            h = ACTIVATIONS[act](both[:, :n])  # [T, I]
            h.mul_(both[:, n:])
        return linear(h, down)
    h = ACTIVATIONS[act](linear(x, gate))  # [T, I]
    h.mul_(linear(x, up))  # in place: one [T, I] temporary fewer
    return linear(h, down)


def clamped_swiglu_mlp(x: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                       down_bias: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert: x @ gate_up + b with gate and up interleaved (even / odd columns),
    gate clamped above and up on both sides at `limit`, (up + 1) * gate * sigmoid(alpha * gate),
    then @ down + b. x: [T, H]  gate_up: [H, 2I]  gate_up_bias: [2I]  down: [I, H] -> [T, H]"""
    gu = x @ gate_up + gate_up_bias  # [T, 2I]
    gate, up = gu[..., ::2].clamp(max=limit), gu[..., 1::2].clamp(min=-limit, max=limit)  # [T, I]
    return ((up + 1) * (gate * torch.sigmoid(gate * alpha))) @ down + down_bias


def _gather_rows(x: torch.Tensor, tok: torch.Tensor, w: tuple) -> torch.Tensor:
    """x's rows `tok`; for an expert whose first weight is GEMM-packed, gathered straight into
    the input its GEMM runs (`input_rows`: padded with zero rows), so neither GEMM copies its
    input to pad it (each output row depends on its own input row alone). index_select: 2-4x
    x[tok]'s gather on a CPU. x: [T, H]  tok: [c] -> [>= c, H]"""
    input_rows = getattr(w[0], "input_rows", None)
    if input_rows is None:
        return x.index_select(0, tok)
    buf = input_rows(tok.shape[0], x)  # [rows, H]
    torch.index_select(x, 0, tok, out=buf[:tok.shape[0]])
    return buf


#: An expert's MLP over its rows: (x [c, H], the expert's weights in `expert_parts` order) -> [c, H]
ExpertMLP = Callable[[torch.Tensor, tuple], torch.Tensor]


def expert_parts(a: dict) -> tuple[str, ...]:
    """The per-expert weights an experts op holds, in the order its MLP takes them."""
    return tuple(a.get("parts", ("gate", "up", "down")))


def expert_mlp(a: dict) -> str | ExpertMLP:
    """The MLP every expert of an experts op with attributes `a` runs: the activation's name for
    a gated MLP (as `experts` takes it, which can then run a silu expert in one native call)."""
    if a["act"] == "clamped_swiglu":
        alpha, limit = float(a["swiglu_alpha"]), float(a["swiglu_limit"])
        return lambda x, w: clamped_swiglu_mlp(x, *w, alpha, limit)
    return str(a["act"])


#: The native call that runs a whole layer's silu experts, by compute dtype (each module's
#: `takes(weights)` and `layer(x, top_w, top_i, counts, weights, out)`)
_LAYER_KERNELS = {torch.bfloat16: expert_amx, torch.float32: expert_fp32}


def experts(
    x: torch.Tensor,
    top_w: torch.Tensor,
    top_i: torch.Tensor,
    fetch: Callable[[list[int]], Iterable[tuple[torch.Tensor, ...]]],
    num_experts: int,
    mlp: str | ExpertMLP,
    chunk: int,
    together: bool = False,
) -> tuple[torch.Tensor, int]:
    """Run every expert over all tokens routed to it, in chunks of at most `chunk` tokens,
    one expert after another; experts no token chose are skipped (never fetched).
    `fetch(used)` yields each used expert's weights in order (it may prefetch ahead: it
    learns the whole list first); `mlp` is what an expert computes from them (an activation
    name: the gated MLP over (gate, up, down); see expert_mlp). A silu expert whose weights
    are packed for oneDNN runs as one native call per 512 rows on a CPU with AMX
    (native/expert_amx.py: the gather, both GEMMs, silu * up and the weighted add, fused), and
    the whole layer as one such call where `together` says every fetched expert's weights stay
    valid at once (weights read in place): the same bits. In fp32 on a CPU with AVX-512 such a
    layer runs as one call of native/expert_fp32.py (fp32 sums in input order, its own exp).
    x: [T, H]  top_w/top_i: [T, k] -> ([T, H], experts run)."""
    fused = isinstance(mlp, str) and ACTIVATIONS.get(mlp) is F.silu  # one native call where it applies (expert_amx.py)
    if isinstance(mlp, str):
        act = mlp
        mlp = lambda rows, w: gated_mlp(rows, *w, act)  # noqa: E731
    T, k = top_i.shape
    out = torch.zeros_like(x)  # [T, H]
    flat = top_i.reshape(-1)  # [T*k]
    # [E] tokens per expert: scatter_add, not bincount, which on CUDA reads the max back first
    # (two syncs a layer on the first device run, where the read below is the only one needed)
    idx = flat.long()  # itself when int64 (topk's)
    tally = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, idx, torch.ones_like(idx))
    counts = to_list(tally, "route")  # [E]: the layer's one host read
    used = [e for e, count in enumerate(counts) if count]
    source = weights = iter(fetch(used))
    try:
        kernel = _LAYER_KERNELS.get(x.dtype)
        if fused and together and used and kernel is not None:
            held = {used[0]: next(source)}
            if kernel.takes(held[used[0]]):  # then every used expert's at once (in place: nothing copied)
                held.update(zip(used[1:], source))
                if kernel.layer(x, top_w, top_i, counts, held, out):
                    return out, len(used)
            weights = itertools.chain(held.values(), source)
        _run_experts(x, top_w, top_i, counts, used, weights, mlp, chunk, fused, out)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()  # a fetcher that prefetches ahead releases what it still holds
    return out, len(used)


def _run_experts(x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, counts: list[int], used: list[int],
                 weights: Iterator[tuple[torch.Tensor, ...]], mlp: ExpertMLP, chunk: int, fused: bool,
                 out: torch.Tensor) -> None:
    """experts' expert-by-expert loop: the T*k slots sorted by expert (stable: tokens in order
    within one), each used expert's rows in chunks added into out [T, H]."""
    k = top_i.shape[1]
    order = torch.argsort(top_i.reshape(-1), stable=True)  # [T*k] slots grouped by expert
    tok_sorted = order // k  # [T*k] the token of each slot, slots grouped by expert
    w_sorted = top_w.reshape(-1)[order].float()  # [T*k] its routing weight, widened once (exactly) for the layer
    starts = [0] * len(counts)
    acc = 0
    for e, count in enumerate(counts):
        starts[e] = acc
        acc += count
    for w, e in zip(weights, used):  # the fetcher first: it sees its own end
        count = counts[e]
        for s in range(starts[e], starts[e] + count, chunk):
            z = min(s + chunk, starts[e] + count)
            tok, tw = tok_sorted[s:z], w_sorted[s:z]  # [c] each: the chunk's tokens and weights
            if fused and len(w) == 3 and w[1] is None and expert_amx.expert(x, tok, tw, w[0], w[2], out):
                continue
            y = mlp(_gather_rows(x, tok, w), w)[:tok.shape[0]]  # [c, H]
            if not expert_rows.scale_add_rows(out, tok, y, tw):  # one pass on the host, same bits
                y.mul_(tw[:, None])
                out.index_add_(0, tok, y.to(out.dtype))
