"""Host attention over the paged KV pool in place (runtime/native/paged_attention.c through
moecc_runtime.native, and runtime/worker/host_attention.py's HostAttention):

1. the native kernel against a plain softmax(q k^T * scale) v over the gathered positions
   (property test: GQA shapes, MLA's values as a view of the keys, block sizes, windows,
   sinks, fp32 and bf16 pools, strided views, a subset of the rows, 1 and 2 threads);
2. its argument checks;
3. engine level (fp32): attention="host" gives transformers' greedy tokens and logits, and
   the same tokens as attention="device", for Mixtral, MLA (DeepSeek-V3), gpt-oss (sinks,
   sliding layers) and a sliding-window Mixtral; a plan compiled for a small --gpu-mem too,
   with host, device and a split placement;
4. HostAttention's fallback without the native kernel gives the same tokens;
5. bf16: host attention's first decode logits are close to device attention's;
6. the kernel was built (unless MOECC_NO_NATIVE says not to use it).

Legend: t = query rows, Hq / Hkv = query / key-value heads, G = Hq / Hkv, D / Dv = key /
value head dim, bs = block size, NB = blocks in the pool, c = context of one row.
"""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moecc_runtime import native
from moecc_runtime.worker import host_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")

needs_native = pytest.mark.skipif(not native.available(), reason="the paged attention kernel is not built "
                                  "(or MOECC_NO_NATIVE is set)")


# -- 1. the kernel against a plain reference ---------------------------------------------------

def reference(q, k, v, rows, tables, table_off, ctx, lo, scale, sinks):
    """{row: ([Hq, Dv], largest |logit|)} in float64: softmax over positions lo..ctx-1 gathered
    through the row's block table (sinks: one extra logit column per query head, dropped after
    the softmax)."""
    Hkv, _, bs, D = k.shape
    Hq = q.shape[1]
    G = Hq // Hkv
    out = {}
    for r in rows.tolist():
        c, l0, off = int(ctx[r]), int(lo[r]), int(table_off[r])
        pos = torch.arange(l0, c)
        blk = tables[off + pos // bs]
        ks = k[:, blk, pos % bs].double()  # [Hkv, n, D]
        vs = v[:, blk, pos % bs].double()  # [Hkv, n, Dv]
        qr = q[r].double().view(Hkv, G, D)
        s = torch.einsum("hgd,hnd->hgn", qr, ks) * scale  # [Hkv, G, n]
        if sinks is not None:
            s = torch.cat([s, sinks.double().view(Hkv, G, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :len(pos)]
        out[r] = torch.einsum("hgn,hnd->hgd", p, vs).reshape(Hq, -1), s.abs().max().item()
    return out


# (D, Dv): multi-head shapes (Dv = D, and one Dv != D), 13 for the kernel's scalar tail, and
# latent attention (576 = 512 latent + 64 rope; the values are a view of the keys' latent part)
HEAD_DIMS = [(8, 8), (13, 13), (24, 24), (64, 64), (80, 80), (128, 128), (24, 40), (576, 512)]


@st.composite
def attention_cases(draw):
    D, Dv = draw(st.sampled_from(HEAD_DIMS))
    mla = D == 576
    Hkv = 1 if mla else draw(st.integers(1, 4))
    G = draw(st.integers(1, 8))
    bs = draw(st.integers(1, 32))
    t = draw(st.integers(1, 5))
    ctx = draw(st.lists(st.integers(1, 300), min_size=t, max_size=t))
    lo = [draw(st.integers(0, c - 1)) if draw(st.booleans()) else 0 for c in ctx]  # a window or not
    rows = draw(st.lists(st.integers(0, t - 1), unique=True, max_size=t))  # any subset, any order
    return dict(D=D, Dv=Dv, mla=mla, Hkv=Hkv, G=G, bs=bs, ctx=ctx, lo=lo, rows=rows,
                sinks=draw(st.booleans()), dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
                threads=draw(st.sampled_from([1, 2])), layout=draw(st.sampled_from(["dense", "padded", "block_major"])),
                sharp=draw(st.sampled_from([0.5, 1.0, 4.0, 40.0])), spare=draw(st.integers(0, 7)),
                seed=draw(st.integers(0, 2**31 - 1)))


def build_case(case):
    """Tensors for one case: a pool with random contents, random non-contiguous block tables
    (consecutive pieces of a random permutation of the pool, handed to the rows in a random
    order), q / out as views with the case's layout."""
    g = torch.Generator().manual_seed(case["seed"])
    rnd = random.Random(case["seed"])
    Hkv, G, D, Dv, bs = case["Hkv"], case["G"], case["D"], case["Dv"], case["bs"]
    Hq, t = Hkv * G, len(case["ctx"])
    need = [-(-c // bs) for c in case["ctx"]]
    NB = sum(need) + case["spare"]
    pad = 3 if case["layout"] == "padded" else 0
    kd = D  # the keys' width (latent attention: latent and rope key)
    if case["layout"] == "block_major":  # storage [NB, Hkv, bs, D]: head stride < block stride
        kst = torch.randn((NB, Hkv, bs, kd), generator=g).transpose(0, 1)
        vst = torch.randn((NB, Hkv, bs, Dv), generator=g).transpose(0, 1)
    else:
        kst = torch.randn((Hkv, NB, bs, kd + pad), generator=g)[..., :kd]
        vst = torch.randn((Hkv, NB, bs, Dv + pad), generator=g)[..., :Dv]
    if case["dtype"] == torch.bfloat16:  # the same layout, bf16 values
        kb, vb = torch.empty_like(kst, dtype=torch.bfloat16), torch.empty_like(vst, dtype=torch.bfloat16)
        if case["layout"] == "padded":
            kb = torch.empty((Hkv, NB, bs, kd + pad), dtype=torch.bfloat16)[..., :kd]
            vb = torch.empty((Hkv, NB, bs, Dv + pad), dtype=torch.bfloat16)[..., :Dv]
        kb.copy_(kst), vb.copy_(vst)
        kst, vst = kb, vb
    k = kst
    v = k[..., :Dv] if case["mla"] else vst  # latent attention: values are the keys' first Dv elements
    perm = torch.randperm(NB, generator=g)
    order = list(range(t))
    rnd.shuffle(order)
    pieces, at = {}, 0
    for r in order:
        pieces[r] = perm[at:at + need[r]]
        at += need[r]
    tables, table_off = [], [0] * t
    for r in order:  # concatenated in the shuffled order: table_off is not monotonic in r
        table_off[r] = sum(len(x) for x in tables)
        tables.append(pieces[r])
    tables = torch.cat(tables).long()
    ctx = torch.tensor(case["ctx"], dtype=torch.long)
    lo = torch.tensor(case["lo"], dtype=torch.long)
    rows = torch.tensor(case["rows"], dtype=torch.long)
    qst = torch.randn((t, Hq, D + pad), generator=g)
    q = qst[..., :D]  # padded: row and head strides larger than dense
    ost = torch.full((t, Hq, Dv + pad), 7.25)
    out = ost[..., :Dv]
    sinks = torch.randn(Hq, generator=g) * 2 if case["sinks"] else None
    scale = case["sharp"] / D ** 0.5
    return q, k, v, rows, tables, torch.tensor(table_off, dtype=torch.long), ctx, lo, scale, out, ost, sinks


@needs_native
@settings(max_examples=int(os.environ.get("MOECC_PROPERTY_EXAMPLES", "300")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=attention_cases())
def test_kernel_matches_reference(case):
    q, k, v, rows, tables, table_off, ctx, lo, scale, out, ost, sinks = build_case(case)
    before = ost.clone()
    native.paged_attention(q, k, v, rows, tables, table_off, ctx, lo, scale, out, sinks, threads=case["threads"])
    ref = reference(q, k, v, rows, tables, table_off, ctx, lo, scale, sinks)
    listed = set(case["rows"])
    for r in range(q.shape[0]):
        if r not in listed:  # untouched, the padding included
            assert torch.equal(ost[r], before[r]), f"row {r} is not in rows but was written"
            continue
        want, top = ref[r]
        # 2e-6 absolute on O(1) data (outputs and logits), scaled up with the outputs' and the
        # logits' magnitude (an fp32 logit s carries ~1e-7 |s| rounding into its exp; torch's
        # own fp32 softmax(q k^T) v is off the float64 reference by as much). bf16 pools: the
        # reference reads the same bf16 values (widening is exact), so the same bound holds
        # (measured over ~1,200 cases, sharp logits included: at most a quarter of it, fp32 and bf16 alike)
        tol = 2e-6 * max(1.0, want.abs().max().item()) * max(1.0, top / 4)
        err = (out[r].double() - want).abs().max().item()
        assert err <= tol, f"row {r} (ctx {case['ctx'][r]}, lo {case['lo'][r]}): max abs error {err:.3g} > {tol:.3g}"
        if ost.shape[-1] > out.shape[-1]:
            assert torch.equal(ost[r, :, out.shape[-1]:], before[r, :, out.shape[-1]:]), "padding past Dv written"


@needs_native
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=attention_cases())
def test_bf16_output_is_the_fp32_output_rounded(case):
    """A bf16 `out` holds exactly the fp32 output as torch rounds it to bf16 (a bf16 model's
    attention output: no fp32 buffer widened and narrowed again); rows not asked stay as they were."""
    q, k, v, rows, tables, table_off, ctx, lo, scale, out, _, sinks = build_case(case)
    native.paged_attention(q, k, v, rows, tables, table_off, ctx, lo, scale, out, sinks, threads=case["threads"])
    half = torch.full(out.shape, 3.0, dtype=torch.bfloat16)  # [t, Hq, Dv]
    native.paged_attention(q, k, v, rows, tables, table_off, ctx, lo, scale, half, sinks, threads=case["threads"])
    listed = sorted(set(case["rows"]))
    unlisted = [r for r in range(q.shape[0]) if r not in listed]
    assert torch.equal(half[listed], out[listed].to(torch.bfloat16))
    assert bool((half[unlisted] == 3.0).all())


@needs_native
def test_kernel_threads_agree_bitwise():
    """Work items are whole (row, KV head) pairs: any thread count gives the same bits."""
    case = dict(D=64, Dv=64, mla=False, Hkv=4, G=2, bs=16, ctx=[300, 1, 77, 129, 16, 250], lo=[0, 0, 10, 100, 0, 0],
                rows=[5, 0, 3, 2, 1, 4], sinks=True, dtype=torch.float32, threads=1, layout="dense", sharp=1.0,
                spare=2, seed=7)
    q, k, v, rows, tables, table_off, ctx, lo, scale, out, _, sinks = build_case(case)
    outs = []
    for threads in (1, 2, 5, 64):
        o = torch.empty_like(out)
        native.paged_attention(q, k, v, rows, tables, table_off, ctx, lo, scale, o, sinks, threads=threads)
        outs.append(o)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_native
@pytest.mark.parametrize("G,dtype,window,qdtype", [
    (4, torch.float32, None, torch.float32), (3, torch.bfloat16, None, torch.float32),
    (4, torch.bfloat16, 50, torch.float32), (16, torch.float32, None, torch.float32),
    (4, torch.bfloat16, None, torch.bfloat16), (3, torch.bfloat16, 50, torch.bfloat16)])
def test_prompt_rows_in_groups_equal_each_row_alone(G, dtype, window, qdtype):
    """A prompt chunk's consecutive rows (one table, one position more each) run as groups
    sharing each key load, their causal mask each row's own ctx: the bits of each row alone.
    Two chunks (one past its start) and a decoding row in one call; a window moves lo. bf16
    queries over a bf16 pool: scored by vdpbf16ps where the avx512bf16 build runs."""
    bs, start, n = 8, 40, 150
    case = dict(D=96, Dv=96, mla=False, Hkv=2, G=G, bs=bs, ctx=[start + n, n, 400], lo=[0, 0, 0], rows=[0, 1, 2],
                sinks=False, dtype=dtype, threads=2, layout="dense", sharp=4.0, spare=1, seed=G)
    _, k, v, _, tables, table_off, _, _, scale, _, _, _ = build_case(case)
    t = 2 * n + 1  # chunk A's rows, chunk B's rows, one decoding row
    g = torch.Generator().manual_seed(1)
    q = torch.randn(t, 2 * G, 96, generator=g).to(qdtype)
    seq = [0] * n + [1] * n + [2]
    first = [start] * n + [0] * n + [399]
    ctx = torch.tensor([first[r] + 1 + (r % n if r < 2 * n else 0) for r in range(t)])
    lo = (ctx - window).clamp(min=0) if window else torch.zeros(t, dtype=torch.long)
    off = table_off[torch.tensor(seq)]
    together = torch.full((t, 2 * G, 96), float("nan"))
    native.paged_attention(q, k, v, torch.arange(t), tables, off, ctx, lo, scale, together)
    alone = torch.full_like(together, float("nan"))
    for r in range(t):
        native.paged_attention(q, k, v, torch.tensor([r]), tables, off, ctx, lo, scale, alone)
    assert torch.equal(together, alone)
    ref = reference(q.float(), k, v, torch.arange(t), tables, off, ctx, lo, scale, None)
    assert max((together[r].double() - want).abs().max().item() for r, (want, _) in ref.items()) < 1e-4


# -- 2. argument checks ------------------------------------------------------------------------

def _small():
    case = dict(D=8, Dv=8, mla=False, Hkv=2, G=2, bs=4, ctx=[5, 9], lo=[0, 0], rows=[0, 1], sinks=False,
                dtype=torch.float32, threads=1, layout="dense", sharp=1.0, spare=0, seed=0)
    q, k, v, rows, tables, table_off, ctx, lo, scale, out, _, _ = build_case(case)
    return dict(q=q, k=k, v=v, rows=rows, tables=tables, table_off=table_off, ctx=ctx, lo=lo, scale=scale, out=out)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """The same shape and values with last stride 2."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


@needs_native
@pytest.mark.parametrize("name", ["q", "out", "k", "v"])
def test_non_unit_last_stride_is_refused(name):
    args = _small()
    args[name] = _strided(args[name])
    assert args[name].stride(-1) == 2
    with pytest.raises(ValueError, match=rf"\b{name}\b.*unit last stride"):
        native.paged_attention(**args)


@needs_native
@pytest.mark.parametrize("name,dtype,says", [
    ("q", torch.float64, r"\bq\b"), ("q", torch.float16, r"\bq\b"), ("out", torch.float64, r"\bout\b"),
    ("k", torch.float16, r"\bK\b"), ("v", torch.bfloat16, r"\bV\b"), ("k", torch.float64, r"\bK\b"),
    ("rows", torch.int32, r"\brows\b"), ("tables", torch.int32, r"\btables\b"),
    ("table_off", torch.int32, r"\btable_off\b"), ("ctx", torch.int32, r"\bctx\b"), ("lo", torch.int32, r"\blo\b")])
def test_wrong_dtype_is_refused(name, dtype, says):
    args = _small()
    args[name] = args[name].to(dtype)
    with pytest.raises(ValueError, match=says) as err:
        native.paged_attention(**args)
    assert str(err.value).startswith("paged_attention:")


# -- 3./4. engine level, fp32 ----------------------------------------------------------------

NEW_TOKENS = 8


def _prompts(n: int) -> list[str]:
    words = (Path(__file__).parents[3] / "moecc/testing/corpus.txt").read_text().split()
    rng = random.Random(99)
    out = []
    for i in range(n):
        start = rng.randrange(len(words) - 60)
        out.append(" ".join(words[start:start + 1 + (i * 11) % 41]))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (checkpoint path, transformers model, tokenizer), written once per module."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moecc.testing.checkpoints import write_checkpoint

    specs = {"mixtral": ("mixtral", {}), "deepseek_v3": ("deepseek_v3", {}), "gpt_oss": ("gpt_oss", {}),
             "mixtral_sw": ("mixtral", {"sliding_window": 6})}
    root = tmp_path_factory.mktemp("host_attn")
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            family, over = specs[name]
            path = write_checkpoint(root / name, family, **over)
            m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
            m.eval()
            cache[name] = (path, m, AutoTokenizer.from_pretrained(str(path)))
        return cache[name]

    return get


def _reference(model, ids: list[int]):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(ids):].tolist(), [l[0].float() for l in out.logits]


class _Counting:
    """A backend (its `forward`) or a function that counts its calls; anything else goes to
    the wrapped one."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner.forward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _run(plan, path, requests, *, attention=None, fallback=False, expect=None, poison=False, **kw):
    """{key: GenResult}; `fallback`: HostAttention without the native kernel. `expect`: which
    paths must have run ("host", "device", "kernel"), the others must not have. `poison`: the
    KV pool starts as NaN (what a freed block may hold after a request whose K/V overflowed)."""
    from moecc_runtime.engine import Engine, generate
    from moecc_runtime.worker.attention_backends import Where

    engine = Engine(plan, path, "cpu", expert_chunk=kw.pop("expert_chunk", 7), attn_micro_batch=kw.pop("b_a", 3),
                    attention=attention)
    results = {}
    w = engine.worker
    if poison:
        w.kv.k.fill_(float("nan"))
        w.kv.v.fill_(float("nan"))
    if fallback:
        w.backends[Where.HOST].native = False
    else:
        assert w.backends[Where.HOST].native == native.supports(w.kv.k.dtype)
    counts = {"host": _Counting(w.backends[Where.HOST]), "device": _Counting(w.backends[Where.DEVICE]),
              "kernel": _Counting(native.paged_attention)}
    w.backends[Where.HOST], w.backends[Where.DEVICE] = counts["host"], counts["device"]
    native.paged_attention = counts["kernel"]  # host_attention.py calls it as native.paged_attention
    try:
        generate(engine, requests, lambda r: results.__setitem__(r.key, r), record_logits=True, **kw)
    finally:
        native.paged_attention = counts["kernel"].inner
        engine.close()
    assert set(results) == {r.key for r in requests}
    if expect is not None:
        ran = {k for k, c in counts.items() if c.calls}
        expect = set(expect) - (set() if native.available() else {"kernel"})  # MOECC_NO_NATIVE: the fallback
        assert ran == expect, f"attention={attention} fallback={fallback}: ran {sorted(ran)}, expected {sorted(expect)}"
    return results


def _requests(tok, n: int):
    from moecc_runtime.scheduler.sequence import GenRequest

    return [GenRequest(str(i), tok(p)["input_ids"], NEW_TOKENS) for i, p in enumerate(_prompts(n))]


def _placed(plan: dict, where: str, fraction: float) -> dict:
    """A copy of `plan` with both phases' attention placed `where`."""
    p = copy.copy(plan)
    p["batch"] = copy.deepcopy(plan["batch"])
    for phase in ("decode", "prefill"):
        p["batch"][phase]["attention"] = {"where": where, "host_fraction": fraction}
    return p


def _tokens(results) -> dict[str, list[int]]:
    return {k: r.token_ids for k, r in results.items()}


@pytest.mark.parametrize("name", ["mixtral", *(pytest.param(n, marks=pytest.mark.slow)
                                               for n in ("deepseek_v3", "gpt_oss", "mixtral_sw"))])
def test_host_attention_matches_device_and_transformers(name, models, monkeypatch):
    """Greedy tokens of attention="host" == attention="device" == transformers; host logits
    within 1e-4 of transformers'; the fallback without the native kernel, host attention
    with prompts split into small chunks and with every prompt chunk of 8 rows or more in the
    kernel (row groups, windows included), the same tokens (6 prompts of 1..34 words, 3..116
    tokens with the Mixtral tokenizer; micro-batches of 3, a batch limit of 4 so slots are refilled)."""
    from moecc.compiler import compile_model

    path, model, tok = models(name)
    plan, _ = compile_model(path)
    if name == "mixtral_sw":
        attn = [op for m in plan["schedule"] for op in m["ops"] if op["op"] == "attention"]
        assert attn and all(op["attrs"]["sliding_window"] == 6 for op in attn)
    reqs = _requests(tok, 6)
    host = _run(plan, path, reqs, attention="host", max_batch=4, expect=["host", "kernel"])
    device = _run(plan, path, reqs, attention="device", max_batch=4, expect=["device"])
    fallback = _run(plan, path, reqs, attention="host", fallback=True, max_batch=4, expect=["host"])
    # prompts in chunks of at most 13 tokens: chunks that start mid-sequence and mid-block,
    # 1-token remnants that take the kernel's decode path
    chunked = _run(plan, path, reqs, attention="host", max_batch=4, max_prefill_tokens=13, expect=["host", "kernel"])
    monkeypatch.setattr(host_attention, "NATIVE_PROMPT_ROWS", 8)
    in_kernel = _run(plan, path, reqs, attention="host", max_batch=4, expect=["host", "kernel"])
    worst = 0.0
    for r in reqs:
        ref_ids, ref_logits = _reference(model, r.prompt_ids)
        assert host[r.key].token_ids == ref_ids, f"{name} prompt {r.key} ({len(r.prompt_ids)} tokens): host"
        assert device[r.key].token_ids == ref_ids, f"{name} prompt {r.key}: device"
        assert fallback[r.key].token_ids == ref_ids, f"{name} prompt {r.key}: host without the native kernel"
        assert chunked[r.key].token_ids == ref_ids, f"{name} prompt {r.key}: host, prompts in chunks of 13"
        assert in_kernel[r.key].token_ids == ref_ids, f"{name} prompt {r.key}: host, prompt chunks in the kernel"
        assert len(host[r.key].logits) == len(ref_logits)
        for a, b in zip(host[r.key].logits + in_kernel[r.key].logits, ref_logits + ref_logits):
            worst = max(worst, (a - b).abs().max().item())
    assert worst < 1e-4, f"{name}: host attention's max logit difference to transformers {worst}"


def test_nan_filled_pool_gives_transformers_tokens(models):
    """A pool that starts as NaN (what a freed block may hold after a request whose K/V
    overflowed) gives transformers' tokens on every path: the kernel reads no position a
    sequence has not written, and new blocks are zeroed for the paths that read whole blocks
    (attention="host" with and without the kernel, and "device")."""
    from moecc.compiler import compile_model

    path, model, tok = models("mixtral")
    plan, _ = compile_model(path)
    reqs = _requests(tok, 4)
    runs = {"host": _run(plan, path, reqs, attention="host", max_batch=3, poison=True),
            "fallback": _run(plan, path, reqs, attention="host", fallback=True, max_batch=3, poison=True),
            "device": _run(plan, path, reqs, attention="device", max_batch=3, poison=True)}
    for r in reqs:
        ref_ids, _ = _reference(model, r.prompt_ids)
        for how, results in runs.items():
            assert results[r.key].token_ids == ref_ids, f"prompt {r.key}: {how} over a NaN-filled pool"


BUDGET = dict(gpu_mem=900_000, prompt_tokens=24, output_tokens=8, max_batch=4)  # below the weights (1.5 MB); above the working set with the step's logits and sampler temporaries


def _compile(path, **kw):
    """compile_model, passing `attention` ("auto" / "host" / "device") only where the compiler
    takes it (None where it does not: that plan cannot be had)."""
    import inspect

    from moecc.compiler import compile_model

    if "attention" in kw and "attention" not in inspect.signature(compile_model).parameters:
        return None
    return compile_model(path, **kw)[0]


def _kv_tokens(plan) -> int:
    return int(plan["arena"]["kv_buffer_tokens"])


def _where(plan) -> list[str | None]:
    return [(plan["batch"][ph].get("attention") or {}).get("where") for ph in ("decode", "prefill")]


@pytest.fixture(scope="module")
def budgeted(models):
    """Mixtral plans compiled for a device budget below the weights (an arena: streamed
    weights): the planner's own choice ("auto"), and one with device KV buffers (the auto plan
    when it has them, else one compiled with attention="device"); checkpoint and tokenizer."""
    path, _, tok = models("mixtral")
    auto = _compile(path, **BUDGET)
    assert auto["arena"] is not None and auto["arena"]["bytes"] <= BUDGET["gpu_mem"]
    buffered = auto if _kv_tokens(auto) else _compile(path, **BUDGET, attention="device")
    if buffered is not None:
        assert _kv_tokens(buffered) > 0 and buffered["arena"]["bytes"] <= BUDGET["gpu_mem"]
    return auto, buffered, path, tok


@pytest.mark.slow
def test_budgeted_plan_host_device_and_split_agree(budgeted, models):
    """A budgeted plan with device KV buffers: attention on the host, on the device, and a 50%
    split of each step's sequences (both phases; with and without the native kernel), the
    placements set by Engine(attention=...) or written into the plan, give transformers'
    tokens; so does the planner's own budgeted plan with its own placement."""
    auto, plan, path, tok = budgeted
    _, model, _ = models("mixtral")
    reqs = _requests(tok, 6)
    expected = {r.key: _reference(model, r.prompt_ids)[0] for r in reqs}
    kw = dict(b_a=None, expert_chunk=None)  # the plan's own sizes (its arena was sized for them)
    runs = {"auto plan, its own placement " + str(_where(auto)): _run(auto, path, reqs, **kw)}
    if plan is None:
        pytest.fail(f"the budgeted plan has no device KV buffers (arena.kv_buffer_tokens 0, attention "
                    f"{_where(auto)}) and compile_model takes no attention='device' to get one")
    split = _placed(plan, "split", 0.5)
    runs |= {"host": _run(plan, path, reqs, attention="host", expect=["host", "kernel"], **kw),
             "device": _run(plan, path, reqs, attention="device", expect=["device"], **kw),
             "split": _run(split, path, reqs, expect=["host", "device", "kernel"], **kw),
             "split, fallback": _run(split, path, reqs, fallback=True, expect=["host", "device"], **kw),
             "placed host": _run(_placed(plan, "host", 1.0), path, reqs, expect=["host", "kernel"], **kw),
             "placed device": _run(_placed(plan, "device", 0.0), path, reqs, expect=["device"], **kw)}
    for how, got in runs.items():
        assert _tokens(got) == expected, f"budgeted plan, attention {how}"


@pytest.mark.slow
def test_plan_without_kv_buffers_refuses_device_attention(budgeted):
    """A plan with host attention and arena.kv_buffer_tokens 0 cannot run attention on the
    device (Engine(attention="device") and a split written into the plan both raise, naming
    kv_buffer_tokens) and runs on the host; tested only where the planner emits such plans."""
    auto, _, path, tok = budgeted
    found = [p for p in (auto, _compile(path, **BUDGET, attention="host")) if p is not None
             and _kv_tokens(p) == 0 and _where(p) == ["host", "host"]]
    if not found:
        pytest.skip("the planner emits no host-attention plan with arena.kv_buffer_tokens 0 "
                    f"(budgeted plan: kv_buffer_tokens {_kv_tokens(auto)}, attention {_where(auto)})")
    from moecc_runtime.engine import Engine

    plan = found[0]
    with pytest.raises(Exception, match="kv_buffer_tokens"):
        Engine(plan, path, "cpu", attention="device")
    with pytest.raises(Exception, match="kv_buffer_tokens"):
        Engine(_placed(plan, "split", 0.5), path, "cpu")
    got = _run(plan, path, _requests(tok, 3), attention="host", b_a=None, expert_chunk=None, expect=["host", "kernel"])
    assert all(len(r.token_ids) == NEW_TOKENS for r in got.values())


# -- 5. bf16 ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_bf16_host_attention_close_to_device(tmp_path):
    """bf16 Mixtral: host attention (fp32 accumulation over bf16 K/V, rounded once) runs to
    completion, and its prompt's and first decode step's logits differ from device
    attention's by less than 2e-2 of the largest logit (measured: at most 1.14e-2, i.e. one or
    two bf16 roundings of logits near 2.4; host and device are equally far from an fp32 run)."""
    from moecc.compiler import compile_model
    from transformers import AutoTokenizer

    from moecc.testing.checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path / "bf16", "mixtral", dtype="bfloat16")
    plan, _ = compile_model(path)
    assert plan["model"]["info"]["dtype"] == "bfloat16"
    tok = AutoTokenizer.from_pretrained(str(path))
    reqs = _requests(tok, 6)
    host = _run(plan, path, reqs, attention="host", expect=["host", "kernel"])
    device = _run(plan, path, reqs, attention="device", expect=["device"])
    ratios = []
    for r in reqs:
        h, d = host[r.key], device[r.key]
        assert len(h.token_ids) == NEW_TOKENS and h.finish_reason == "length"
        assert len(h.logits) == NEW_TOKENS and all(torch.isfinite(x).all() for x in h.logits)
        # logits[0] comes from the prompt's last row; logits[1] from the first decode step, whose
        # input token may differ where a near-tie broke differently (then compare step 0 only)
        steps = [0, 1] if h.token_ids[0] == d.token_ids[0] else [0]
        for s in steps:
            ratios.append(((h.logits[s] - d.logits[s]).abs().max() / d.logits[s].abs().max()).item())
    print(f"bf16 host vs device logits: max abs diff / max abs logit {max(ratios):.3g}")
    assert max(ratios) < 2e-2, f"bf16 host vs device logits: max abs diff / max abs logit {max(ratios):.3g}"


# -- 6. the build -----------------------------------------------------------------------------

def test_native_kernel_was_built():
    """CI builds the extension at install: the kernel is there unless MOECC_NO_NATIVE is set."""
    if os.environ.get("MOECC_NO_NATIVE"):
        assert not native.available()
        pytest.skip("MOECC_NO_NATIVE is set")
    assert native.available(), "moecc_runtime.native._paged_attention was not built (pip install -e . builds it)"
    assert native.supports(torch.float32) and native.supports(torch.bfloat16)
    assert not native.supports(torch.float16)


def test_prompt_rows_stay_off_the_kernel_on_a_cpu_with_amx(monkeypatch):
    """Where the CPU has AMX tiles torch's SDPA runs prompts faster than the kernel (0.23-0.37x in
    bf16 on an AMX Xeon), so prompt chunks stay on SDPA; elsewhere chunks of 256 rows and more go
    through the kernel. MOECC_NATIVE_PROMPT_ROWS overrides either way (0: none)."""
    from moecc_runtime.native import isa

    monkeypatch.delenv("MOECC_NATIVE_PROMPT_ROWS", raising=False)
    monkeypatch.setattr(host_attention, "cpu_flags", lambda: frozenset({"avx512f", "amx_tile", "amx_bf16"}))
    assert host_attention._native_prompt_rows() is None
    monkeypatch.setattr(host_attention, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert host_attention._native_prompt_rows() == 256
    monkeypatch.setenv("MOECC_NATIVE_PROMPT_ROWS", "64")
    assert host_attention._native_prompt_rows() == 64
    monkeypatch.setenv("MOECC_NATIVE_PROMPT_ROWS", "0")
    assert host_attention._native_prompt_rows() is None
    assert isinstance(isa.cpu_flags(), frozenset)
