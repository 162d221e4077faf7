"""Logprobs (issue 23, item 2): chat `logprobs` / `top_logprobs`, the legacy completions
`logprobs: N` and the moecc format's `logprobs`, each the fp32 log-softmax of the step's raw
logits (before penalties and temperature), checked against transformers and against the
openai client's own response types; requests that do not ask are written exactly as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moecc.compiler import compile_model
from moecc_runtime.engine import Engine, generate
from moecc_runtime.job.exec import run_job
from moecc_runtime.plan import save_plan
from moecc_runtime.scheduler.sequence import GenRequest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 6
PROMPTS = ["the kettle clicked off", "a pulley is a wheel on an axle that turns with rope", "rope",
           "and a pulley is", "the wheel turns"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tiny(checkpoints, tmp_path_factory):
    """A tiny fp32 Mixtral, its plan (saved), transformers' model and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = checkpoints("mixtral", "per_expert")
    plan, _ = compile_model(path)
    root = tmp_path_factory.mktemp("logprobs")
    save_plan(plan, root / "plan.pt")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, plan, root / "plan.pt", model, AutoTokenizer.from_pretrained(str(path))


def _reference(model, ids: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(ids):].tolist(), [torch.log_softmax(l[0].float(), -1) for l in out.logits]


def test_greedy_logprobs_match_transformers_log_softmax(tiny):
    path, plan, _, model, tok = tiny
    tops = [5, 0, 3, None, 20]  # None: this request does not ask (it runs in the same batches)
    reqs = [GenRequest(str(i), tok(p)["input_ids"], NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=n)
            for i, (p, n) in enumerate(zip(PROMPTS, tops))]
    engine = Engine(plan, path, "cpu")
    got = {}
    try:
        generate(engine, reqs, lambda r: got.__setitem__(r.key, r), max_batch=3)
    finally:
        engine.close()
    worst = 0.0
    for req, n in zip(reqs, tops):
        r = got[req.key]
        if n is None:
            assert r.logprobs is None
            continue
        ref_ids, ref_lps = _reference(model, req.prompt_ids)
        assert r.token_ids == ref_ids
        assert len(r.logprobs) == len(r.token_ids) == NEW_TOKENS
        for tok_id, (lp, top), ref in zip(r.token_ids, r.logprobs, ref_lps):
            worst = max(worst, abs(lp - ref[tok_id].item()))
            assert len(top) == n
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True)
            if n:
                assert top[0][0] == tok_id and top[0][1] == lp  # greedy: the chosen token is the most likely
            assert lp == pytest.approx(ref.max().item(), abs=1e-4)
            for i, v in top:
                worst = max(worst, abs(v - ref[i].item()))
    assert worst < 1e-4, worst


def test_logprobs_are_of_the_raw_logits_before_penalties(tiny):
    """A logit_bias changes what is chosen, not the reported distribution."""
    path, plan, _, model, tok = tiny
    ids = tok(PROMPTS[0])["input_ids"]
    _, ref_lps = _reference(model, ids)
    banned = int(ref_lps[0].argmax())
    engine = Engine(plan, path, "cpu")
    got = []
    try:
        generate(engine, [GenRequest("b", ids, 1, logit_bias=((banned, -100.0),), logprobs=2)], got.append)
    finally:
        engine.close()
    (r,) = got
    assert r.token_ids[0] != banned
    lp, top = r.logprobs[0]
    assert top[0][0] == banned and lp == pytest.approx(ref_lps[0][r.token_ids[0]].item(), abs=1e-4)


def _chat(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "the kettle"}], "max_tokens": 5,
                     **body}}


def _cmpl(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "a pulley is", "max_tokens": 5, **body}}


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_openai_outputs_validate_with_the_openai_types(tiny, tmp_path):
    try:  # the openai client's response types, where it is installed (moecc does not need it)
        from openai.types import Completion
        from openai.types.chat import ChatCompletion
    except ImportError:
        Completion = ChatCompletion = None

    _, _, plan_path, _, _ = tiny
    prompts = _write(tmp_path / "p.jsonl", [
        _chat("chat-lp", logprobs=True, top_logprobs=3), _chat("chat-lp0", logprobs=True),
        _chat("chat-plain", logprobs=False), _cmpl("cmpl-lp", logprobs=2), _cmpl("cmpl-plain"),
        _chat("bad-top", logprobs=True, top_logprobs=21), _cmpl("bad-cmpl", logprobs=6)])
    out, errors = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    summary = run_job(plan_path, prompts, out, errors_path=errors, device="cpu", log=None, fmt="openai")
    assert (summary.succeeded, summary.failed) == (5, 2)
    rows = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(out)}
    for cid in ("chat-lp", "chat-lp0", "chat-plain"):
        body = rows[cid]
        parsed = ChatCompletion.model_validate(body).choices[0].logprobs if ChatCompletion is not None else None
        lps = body["choices"][0]["logprobs"]
        if cid == "chat-plain":
            assert lps is None
            continue
        assert set(lps) == {"content", "refusal"} and lps["refusal"] is None
        assert len(lps["content"]) == body["usage"]["completion_tokens"]
        for e in lps["content"]:
            assert e["bytes"] == list(e["token"].encode("utf-8")) and e["logprob"] <= 0
            assert len(e["top_logprobs"]) == (3 if cid == "chat-lp" else 0)
            values = [t["logprob"] for t in e["top_logprobs"]]
            assert values == sorted(values, reverse=True)
            if values:
                assert e["logprob"] == values[0] and e["top_logprobs"][0]["token"] == e["token"]
        if ChatCompletion is not None:
            assert parsed is not None and len(parsed.content) == len(lps["content"])
    for cid in ("cmpl-lp", "cmpl-plain"):
        body = rows[cid]
        if Completion is not None:
            Completion.model_validate(body)
        lps = body["choices"][0]["logprobs"]
        if cid == "cmpl-plain":
            assert lps is None
            continue
        n = body["usage"]["completion_tokens"]
        assert set(lps) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert len(lps["tokens"]) == len(lps["token_logprobs"]) == len(lps["top_logprobs"]) == n
        assert lps["text_offset"][0] == 0
        for a, b, t in zip(lps["text_offset"], lps["text_offset"][1:], lps["tokens"]):
            assert b - a == len(t)
        for t, lp, top in zip(lps["tokens"], lps["token_logprobs"], lps["top_logprobs"]):
            assert 1 <= len(top) <= 2 and top.get(t) == lp and max(top.values()) == lp
        if Completion is not None:
            assert Completion.model_validate(body).choices[0].logprobs.tokens == lps["tokens"]
    errs = {r["custom_id"]: r["response"]["body"]["error"] for r in read_jsonl(errors)}
    assert errs["bad-top"]["param"] == "body.top_logprobs" and "[0, 20]" in errs["bad-top"]["message"]
    assert errs["bad-cmpl"]["param"] == "body.logprobs" and "[0, 5]" in errs["bad-cmpl"]["message"]


def test_moecc_format_logprobs_and_untouched_lines(tiny, tmp_path):
    _, _, plan_path, _, _ = tiny
    plain_rows = [{"custom_id": f"p{i}", "prompt": p, "max_tokens": 5} for i, p in enumerate(PROMPTS)]
    asking = [{"custom_id": "lp", "prompt": PROMPTS[1], "max_tokens": 5, "logprobs": True, "top_logprobs": 2},
              {"custom_id": "lp0", "prompt": PROMPTS[2], "max_tokens": 5, "logprobs": True},
              {"custom_id": "off", "prompt": PROMPTS[3], "max_tokens": 5, "logprobs": False, "top_logprobs": 0}]
    before, after = tmp_path / "before.jsonl", tmp_path / "after.jsonl"
    run_job(plan_path, _write(tmp_path / "a.jsonl", plain_rows), before, device="cpu", log=None, max_batch=1)
    run_job(plan_path, _write(tmp_path / "b.jsonl", plain_rows + asking), after, device="cpu", log=None,
            max_batch=1)
    old = before.read_bytes().splitlines()
    new = after.read_bytes().splitlines()
    assert new[:len(old)] == old  # byte-identical lines for the requests that do not ask
    rows = {r["custom_id"]: r for r in read_jsonl(after)}
    for cid in [r["custom_id"] for r in plain_rows] + ["off"]:
        assert set(rows[cid]) == {"custom_id", "text", "token_ids", "finish_reason", "usage", "moecc"}
    for cid, n in (("lp", 2), ("lp0", 0)):
        r = rows[cid]
        assert [e["token_id"] for e in r["logprobs"]] == r["token_ids"]
        for e in r["logprobs"]:
            assert set(e) == {"token_id", "logprob", "top"} and len(e["top"]) == n
            if n:
                assert e["top"][0] == [e["token_id"], e["logprob"]]
                assert e["top"][0][1] >= e["top"][1][1]


def test_token_text_keeps_a_sentencepiece_tokens_leading_space(tmp_path):
    """A SentencePiece ("▁the") token decoded alone loses its space; logprobs' token text
    keeps it, so the tokens' texts join into the completion's text."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from moecc_runtime.tokenizer import Tokenizer

    raw = RawTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    raw.train_from_iterator([" ".join(PROMPTS)] * 20, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path)
    tok = Tokenizer(tmp_path)
    ids = tok.tok("the wheel turns", add_special_tokens=False)["input_ids"]
    assert [tok.tok.decode([i]) for i in ids][1:] != [tok.token_str(i) for i in ids][1:]  # alone: no space
    assert "".join(tok.token_str(i) for i in ids) == " the wheel turns"
    assert tok.token_str(tok.tok.eos_token_id) == "</s>"


def test_echo_returns_the_prompt_and_its_logprobs_as_transformers_scores_it(tiny, tmp_path):
    """/v1/completions with echo: the text is the prompt then the completion; with logprobs, the
    prompt's tokens come first, the first one null, each other the fp32 log-softmax of
    transformers' logits at the position before it (within 1e-4); max_tokens 0 scores the
    prompt alone (what evaluation harnesses send)."""
    _, _, plan_path, model, tok = tiny
    prompt = PROMPTS[1]
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)  # [L, V]
    rows = [_cmpl("echo-lp", prompt=prompt, echo=True, logprobs=2, max_tokens=3),
            _cmpl("echo-0", prompt=prompt, echo=True, logprobs=0, max_tokens=0),
            _cmpl("echo-plain", prompt=prompt, echo=True, max_tokens=3), _cmpl("plain", prompt=prompt, max_tokens=3),
            _cmpl("zero-without-echo", prompt=prompt, max_tokens=0)]
    out, errors = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    summary = run_job(tiny[2], _write(tmp_path / "p.jsonl", rows), out, errors_path=errors, device="cpu", log=None,
                      fmt="openai")
    assert (summary.succeeded, summary.failed) == (4, 1)
    assert read_jsonl(errors)[0]["response"]["body"]["error"]["param"] == "body.max_tokens"
    from openai.types import Completion

    body = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(out)}
    for b in body.values():  # the echoed first token's null logprob (as OpenAI's API and vLLM send it, and
        lp = b["choices"][0]["logprobs"]  # evaluation harnesses index by it) is one the openai types refuse
        if lp is not None and lp["token_logprobs"][0] is None:
            assert lp["top_logprobs"][0] is None
            lp["token_logprobs"][0], lp["top_logprobs"][0] = float("nan"), {}
    choice = {k: Completion.model_validate(b).choices[0] for k, b in body.items()}
    assert choice["echo-plain"].text == prompt + choice["plain"].text
    assert choice["echo-0"].text == prompt and body["echo-0"]["usage"]["completion_tokens"] == 0
    for cid, new in (("echo-lp", 3), ("echo-0", 0)):
        lp = choice[cid].logprobs
        assert len(lp.tokens) == len(ids) + new
        assert lp.token_logprobs[0] != lp.token_logprobs[0] and lp.top_logprobs[0] == {}  # null, stood in for
        for p in range(1, len(ids)):
            assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < 1e-4, (cid, p)
            if cid == "echo-lp":
                best = ref[p - 1].topk(2)
                assert max(lp.top_logprobs[p].values()) == pytest.approx(best.values[0].item(), abs=1e-4)
                assert 1 <= len(lp.top_logprobs[p]) <= 2  # keyed by text: two tokens of one text keep one
    assert choice["echo-lp"].text.startswith(prompt)


def test_prompt_logprobs_survive_chunked_prefill_and_preemption(tiny):
    """Prompt logprobs recorded once per position, whether the prompt is prefilled in chunks
    of 3 or recomputed after a preemption in a 10-block pool of 2 positions."""
    from unittest import mock

    from moecc_runtime.scheduler.scheduler import Scheduler

    path, plan, _, model, tok = tiny
    reqs = [GenRequest(str(i), tok(p)["input_ids"], 4, min_tokens=4, prompt_logprobs=1) for i, p in enumerate(PROMPTS)]
    preempted, real = [], Scheduler._preempt
    engine = Engine(plan, path, "cpu", kv_blocks=16, block_size=2)
    got = {}
    try:
        with mock.patch.object(Scheduler, "_preempt", lambda s, short: (preempted.append(1), real(s, short))):
            generate(engine, reqs, lambda r: got.__setitem__(r.key, r), max_batch=3, max_prefill_tokens=3)
    finally:
        engine.close()
    assert preempted, "the small pool must force preemption"
    for r in reqs:
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([r.prompt_ids])).logits[0].float(), -1)
        lps = got[r.key].prompt_logprobs
        assert len(lps) == len(r.prompt_ids) and lps[0] is None
        for p in range(1, len(r.prompt_ids)):
            assert abs(lps[p][0] - ref[p - 1, r.prompt_ids[p]].item()) < 1e-4
            assert lps[p][1][0][0] == int(ref[p - 1].argmax())
