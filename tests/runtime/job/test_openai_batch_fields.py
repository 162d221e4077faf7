"""Real batch files run (issue 23, first piece): lines written for the OpenAI Batch API or vLLM
`run-batch` carry fields that do not change generation (accepted, ignored), content as text
parts (joined), penalties / logit_bias / min_tokens (implemented in the sampler), and some
things moecc does not do (each fails its line alone, naming the field)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moecc.compiler import compile_model
from moecc.testing.checkpoints import write_checkpoint
from moecc_runtime.job.exec import run_job
from moecc_runtime.job.requests import RequestFieldError, iter_request_lines, parse_request
from moecc_runtime.plan import save_plan
from moecc_runtime.sampling import SamplingParams, adjust_logits, choose, is_neutral

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def chat(body: dict, cid: str = "a") -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], **body}}


def cmpl(body: dict, cid: str = "a") -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", **body}}


REAL_BODY = {
    "model": "meta-llama/Meta-Llama-3-8B-Instruct", "presence_penalty": 0, "frequency_penalty": 0.0,
    "user": "user-123", "metadata": {"batch": "7"}, "service_tier": "auto", "store": False,
    "stream": False, "n": 1, "logprobs": False, "response_format": {"type": "text"},
    "parallel_tool_calls": True, "temperature": 0, "top_p": 1, "max_tokens": 8, "stop": None,
    "logit_bias": None, "top_logprobs": None, "seed": 1,
}


def parse(line: dict):
    return parse_request(line, path="p", line=1)


def refused(line: dict) -> RequestFieldError:
    with pytest.raises(RequestFieldError) as e:
        parse(line)
    return e.value


# --------------------------------------------------------------------------- parsing


def test_a_real_batch_file_parses_with_no_failed_line() -> None:
    lines = [chat(REAL_BODY, "c1"), chat({**REAL_BODY, "stream": None, "n": None}, "c2"),
             cmpl({k: v for k, v in REAL_BODY.items() if k != "parallel_tool_calls"}, "p1"),
             cmpl({"echo": False, "best_of": 1, "suffix": None, "logprobs": None}, "p2")]
    items = list(iter_request_lines((json.dumps(x).encode() + b"\n" for x in lines), path="b.jsonl"))
    assert [type(i).__name__ for i in items] == ["Request"] * 4, [str(i) for i in items]
    req = items[0]
    assert req.model == "meta-llama/Meta-Llama-3-8B-Instruct" and req.max_tokens == 8 and req.seed == 1
    assert is_neutral(req) and req.logit_bias == ()


def test_content_parts_are_joined_in_order() -> None:
    req = parse(chat({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
    ]}))
    assert req.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "one\ntwo"})
    simple = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})
    assert simple.messages == ({"role": "user", "content": "x"},)


@pytest.mark.parametrize(("line", "field", "fragment"), [
    (chat({"messages": [{"role": "user", "content": "a"},
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
     "body.messages[1].content[0].type", "'image_url' is not supported"),
    (chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]}),
     "body.messages[0].content[1].type", "'input_audio' is not supported"),
    (chat({"messages": [{"role": "user", "content": [{"type": "text"}]}]}), "body.messages[0].content[0].text",
     "missing"),
    (chat({"messages": [{"role": "user", "content": ["a"]}]}), "body.messages[0].content[0]", "content part"),
    (chat({"stream": True}), "body.stream", "streaming is not supported"),
    (chat({"tools": [{"type": "function"}]}), "body.tools", "tool calling is not supported"),
    (chat({"tool_choice": "auto"}), "body.tool_choice", "tool calling is not supported"),
    (chat({"functions": []}), "body.functions", "function calling is not supported"),
    (chat({"n": 0}), "body.n", "an integer in [1, 128]"),
    (cmpl({"n": 129}), "body.n", "an integer in [1, 128]"),
    (chat({"logprobs": "yes"}), "body.logprobs", "true or false"),
    (chat({"top_logprobs": 3}), "body.top_logprobs", "needs body.logprobs: true"),
    (chat({"logprobs": True, "top_logprobs": 21}), "body.top_logprobs", "[0, 20]"),
    (cmpl({"logprobs": 6}), "body.logprobs", "[0, 5]"),
    (cmpl({"top_logprobs": 2}), "body.top_logprobs", "logprobs: N"),
    (chat({"response_format": {"type": "grammar"}}), "body.response_format.type",
     'expected one of "text", "json_object", "json_schema"'),
    (chat({"presence_penalty": 2.5}), "body.presence_penalty", "[-2, 2]"),
    (chat({"frequency_penalty": -3}), "body.frequency_penalty", "[-2, 2]"),
    (chat({"frequency_penalty": "1"}), "body.frequency_penalty", "[-2, 2]"),
    (chat({"repetition_penalty": 0}), "body.repetition_penalty", "> 0"),
    (chat({"logit_bias": {"12": 101}}), "body.logit_bias.12", "[-100, 100]"),
    (chat({"logit_bias": {"abc": 1}}), "body.logit_bias.abc", "token id"),
    (chat({"logit_bias": [1]}), "body.logit_bias", "object"),
    (chat({"min_tokens": -1}), "body.min_tokens", ">= 0"),
    (chat({"min_tokens": 9, "max_tokens": 4}), "body.min_tokens", "at most max_tokens"),
    ({"prompt": "a", "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
])
def test_each_refusal_names_its_field(line: dict, field: str, fragment: str) -> None:
    err = refused(line)
    assert err.field == field and fragment in err.message, (err.field, err.message)


def test_a_refused_line_fails_alone() -> None:
    lines = [chat({"stream": True}, "bad"), chat({}, "good")]
    items = list(iter_request_lines((json.dumps(x).encode() for x in lines), path="b.jsonl"))
    assert type(items[0]).__name__ == "RequestError" and items[0].field == "body.stream"
    assert "b.jsonl:1" in str(items[0]) and type(items[1]).__name__ == "Request"


def test_penalties_parse() -> None:
    req = parse(chat({"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.3,
                      "logit_bias": {"7": -100, "3": 2.5}, "min_tokens": 2, "top_k": -1}))
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (0.5, -1.0, 1.3)
    assert req.logit_bias == ((3, 2.5), (7, -100.0)) and req.min_tokens == 2 and req.top_k == 0
    assert not is_neutral(req)


# --------------------------------------------------------------------------- the sampler


def P(**kw) -> SamplingParams:
    return SamplingParams(**kw)


ROW = torch.tensor([1.0, -2.0, 3.0, 0.5, -0.25, 2.0])


def test_presence_and_frequency_follow_openai() -> None:
    prompt = [0, 5]
    generated = [2, 2, 3, 2]  # counts: token 2 -> 3, token 3 -> 1
    got = adjust_logits(ROW, P(presence_penalty=0.5, frequency_penalty=0.25), prompt + generated, len(prompt))
    want = ROW.clone()
    want[2] -= 0.5 + 0.25 * 3
    want[3] -= 0.5 + 0.25 * 1
    assert torch.equal(got, want)  # prompt tokens 0 and 5 untouched


def test_repetition_penalty_follows_vllm_over_prompt_and_output() -> None:
    got = adjust_logits(ROW, P(repetition_penalty=2.0), [0, 1, 4, 1], 2)  # prompt 0, 1; generated 4, 1
    want = ROW.clone()
    want[0] = 1.0 / 2  # > 0: divided
    want[1] = -2.0 * 2  # <= 0: multiplied (once, however often it appears)
    want[4] = -0.25 * 2
    assert torch.equal(got, want)


def test_logit_bias_and_min_tokens() -> None:
    got = adjust_logits(ROW, P(logit_bias=((1, 10.0), (2, -100.0))), [0], 1)
    want = ROW.clone()
    want[1] += 10.0
    want[2] -= 100.0
    assert torch.equal(got, want)
    eos = {2, 5}
    held = adjust_logits(ROW, P(min_tokens=2), [0, 3], 1, eos)  # 1 generated < 2: EOS masked
    assert torch.isneginf(held[[2, 5]]).all() and torch.equal(held[[0, 1, 3, 4]], ROW[[0, 1, 3, 4]])
    assert torch.equal(adjust_logits(ROW, P(min_tokens=2), [0, 3, 1], 1, eos), ROW)  # 2 generated: free
    logits = ROW.repeat(2, 1)
    out = choose(logits, [P(), P(min_tokens=2)], [None, None], [[0], [0]], [1, 1], eos)
    assert out == [2, 0]  # the second cannot end yet: its best non-EOS token


def test_neutral_values_take_the_old_path() -> None:
    assert is_neutral(P()) and is_neutral(P(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                                            logit_bias=(), min_tokens=0))
    logits = torch.randn(3, 50, dtype=torch.bfloat16)
    assert choose(logits, [P()] * 3, [None] * 3) == torch.argmax(logits, dim=-1).tolist()  # no tokens needed


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("batchfields")
    ckpt = write_checkpoint(root / "mixtral", "mixtral", seed=3)
    plan, _ = compile_model(ckpt)
    save_plan(plan, root / "plan.pt")
    return root, root / "plan.pt"


def write_lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


PROMPTS = ["the kettle clicked off", "a pulley is a wheel", "on an axle that turns"]


def test_neutral_values_leave_greedy_tokens_unchanged(tiny, tmp_path) -> None:
    _, plan = tiny
    plain = [cmpl({"prompt": p, "max_tokens": 10}, f"r{i}") for i, p in enumerate(PROMPTS)]
    real = [cmpl({**{k: v for k, v in REAL_BODY.items() if k not in ("parallel_tool_calls", "seed")},
                  "prompt": p, "max_tokens": 10, "repetition_penalty": 1.0, "logit_bias": {}, "min_tokens": 0},
                 f"r{i}") for i, p in enumerate(PROMPTS)]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    sa = run_job(plan, write_lines(tmp_path / "pa.jsonl", plain), a, device="cpu", log=None, max_batch=2)
    sb = run_job(plan, write_lines(tmp_path / "pb.jsonl", real), b, device="cpu", log=None, max_batch=2)
    assert (sa.failed, sb.failed, sb.succeeded) == (0, 0, 3)
    tokens = lambda p: {r["custom_id"]: r["token_ids"] for r in read_jsonl(p)}  # noqa: E731
    assert tokens(a) == tokens(b)


@pytest.mark.slow
def test_penalties_change_generation_end_to_end(tiny, tmp_path) -> None:
    _, plan = tiny
    base = [cmpl({"prompt": PROMPTS[0], "max_tokens": 12}, "plain")]
    out = tmp_path / "o.jsonl"
    run_job(plan, write_lines(tmp_path / "p.jsonl", base), out, device="cpu", log=None)
    plain = read_jsonl(out)[0]["token_ids"]
    first = plain[0]
    rows = [cmpl({"prompt": PROMPTS[0], "max_tokens": 12, "logit_bias": {str(first): -100}}, "bias"),
            cmpl({"prompt": PROMPTS[0], "max_tokens": 12, "frequency_penalty": 2, "presence_penalty": 2}, "pen"),
            cmpl({"prompt": PROMPTS[0], "max_tokens": 12, "repetition_penalty": 1.5}, "rep")]
    out2 = tmp_path / "o2.jsonl"
    s = run_job(plan, write_lines(tmp_path / "p2.jsonl", rows), out2, device="cpu", log=None)
    assert s.failed == 0
    got = {r["custom_id"]: r["token_ids"] for r in read_jsonl(out2)}
    assert got["bias"][0] != first
    repeats = lambda ids: len(ids) - len(set(ids))  # noqa: E731
    assert repeats(plain) > 0, plain  # the tiny model repeats itself greedily...
    for cid in ("pen", "rep"):  # ...and the penalties push repeats down
        assert got[cid] != plain and repeats(got[cid]) < repeats(plain), (cid, got[cid], plain)


@pytest.mark.slow
def test_logit_bias_outside_the_vocabulary_fails_its_line(tiny, tmp_path) -> None:
    _, plan = tiny
    rows = [cmpl({"logit_bias": {"99999999": 1}}, "bad"), cmpl({"max_tokens": 2}, "good")]
    errors = tmp_path / "e.jsonl"
    s = run_job(plan, write_lines(tmp_path / "p.jsonl", rows), tmp_path / "o.jsonl", errors_path=errors,
                device="cpu", log=None)
    assert (s.succeeded, s.failed) == (1, 1)
    assert "logit_bias" in json.dumps(read_jsonl(errors))


@pytest.mark.slow
def test_an_empty_input_file_is_a_clean_no_op(tiny, tmp_path) -> None:
    _, plan = tiny
    for name, content in (("empty.jsonl", b""), ("blank.jsonl", b"\n\n")):
        prompts = tmp_path / name
        prompts.write_bytes(content)
        out = tmp_path / f"{name}.out.jsonl"
        s = run_job(plan, prompts, out, errors_path=tmp_path / f"{name}.err.jsonl", device="cpu", log=None)
        assert (s.requests, s.succeeded, s.failed, s.status) == (0, 0, 0, "done")
        assert out.read_bytes() == b"" and not (tmp_path / f"{name}.err.jsonl").exists()


def test_min_p_parses_and_keeps_only_tokens_near_the_best() -> None:
    """vLLM's min_p (body and simple lines): a token is kept when its probability is at least
    min_p times the best one's; out of [0, 1] fails the line naming the field."""
    assert parse(chat({"min_p": 0.05})).min_p == 0.05
    assert parse({"custom_id": "s", "prompt": "hi", "min_p": 0}).min_p == 0.0
    assert refused(chat({"min_p": 1.5})).field == "body.min_p"
    from moecc_runtime.sampling import request_generator, sample

    logits = torch.tensor([[4.0, 3.9, 0.0, -1.0] + [-5.0] * 60] * 64)  # two near the best, the rest far below
    params = [SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.5)] * 64
    got = set(sample(logits, params, [request_generator(i, "m") for i in range(64)]).tolist())
    assert got <= {0, 1} and len(got) == 2
