"""`moecc serve` through the official openai client (issue 34): upload, create, poll to
completed, download with every output line validated by the client's types; cancel mid-run
gives cancelled with the finished results; lists paginate; a second key sees none of the
first key's objects; no key gets 401; bad input gets OpenAI's error shape and breaks
nothing; the status page, rendered by headless Chromium during a run, shows the counts the
API reports. One server on the trained demo model, on a free 127.0.0.1 port."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from openai.types import Batch, Completion, FileObject
from openai.types.chat import ChatCompletion

from moecc.serve.testing import ServerProcess, cached_plans, data_dir_with_plans

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo-model"
K1, K2 = "key-one-0123456789", "key-two-0123456789"
LIMIT = 256 * 1024  # --max-file-size of this module's server


def chat_line(cid: str, text: str, max_tokens: int = 6, model: str = "demo-model") -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}}


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def wait(client: openai.OpenAI, batch_id: str, until: tuple[str, ...] = ("completed", "failed", "cancelled",
                                                                          "expired"), timeout: float = 60) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in until or time.monotonic() > deadline:
            return b
        time.sleep(0.1)


@pytest.fixture(scope="session")
def plan_cache(tmp_path_factory) -> Path:
    """The demo model's plan, compiled once as `moecc serve` caches it (the plans/ of a data
    directory)."""
    return cached_plans(DEMO, tmp_path_factory.mktemp("serve-plans"))


@pytest.fixture(scope="module")
def server(plan_cache, tmp_path_factory):
    """One server of two models, two keys: the demo model under its own name and again as
    "tiny" (NAME=DIR: one checkpoint, one cached plan, two names a line's body.model picks)."""
    d = data_dir_with_plans(plan_cache, tmp_path_factory.mktemp("serve-api"))
    s = ServerProcess([str(DEMO), f"tiny={DEMO}"], d, "--api-key", K1, "--api-key", K2,
                      "--max-file-size", str(LIMIT), "--max-tokens", "8", key=K1).start()
    yield s
    s.stop()


def client(server: ServerProcess, key: str = K1) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_the_command_refuses_an_open_address_without_a_key(tmp_path: Path) -> None:
    from moecc.serve.config import ServeConfig, check, is_loopback, parse_model

    m = parse_model(f"demo={DEMO}")
    assert (m.name, parse_model(str(DEMO)).name) == ("demo", "demo-model")
    assert all(map(is_loopback, ("127.0.0.1", "127.8.0.1", "::1", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "10.0.0.1", "::", "example.org")))
    with pytest.raises(ValueError, match="--api-key"):
        check(ServeConfig([m], tmp_path, host="0.0.0.0"))
    check(ServeConfig([m], tmp_path, host="0.0.0.0", keys=["k" * 16]))  # with a key it may
    with pytest.raises(ValueError, match="twice"):
        check(ServeConfig([m, m], tmp_path))


@pytest.mark.slow
def test_upload_create_poll_download_every_line_validates(server: ServerProcess) -> None:
    c = client(server)
    assert [m.id for m in c.models.list()] == ["demo-model", "tiny"]
    rows = [chat_line(f"c{i}", f"Tell me about topic {i}") for i in range(6)]
    rows += [chat_line(f"c{i}", f"Tell me about topic {i}", model="tiny") for i in range(6, 8)]  # body.model picks
    rows.append(chat_line("lost", "hello", model="no-such-model"))  # fails alone, as OpenAI reports it
    f = c.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    assert isinstance(f, FileObject) and f.purpose == "batch" and f.bytes == len(jsonl(rows))
    assert c.files.retrieve(f.id).id == f.id and c.files.content(f.id).content == jsonl(rows)
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"job": "eval"})
    assert b.status == "validating" and b.metadata == {"job": "eval"}
    b = wait(c, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (9, 8, 1)
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.created_at <= b.in_progress_at
    out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == [f"c{i}" for i in range(8)]
    for r in out:
        assert r["response"]["status_code"] == 200 and r["error"] is None
        body = ChatCompletion.model_validate(r["response"]["body"])
        assert body.choices[0].message.role == "assistant" and body.usage.completion_tokens <= 6
        assert body.model == ("tiny" if r["custom_id"] in ("c6", "c7") else "demo-model")
    errs = [json.loads(x) for x in c.files.content(b.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["response"]["status_code"], e["response"]["body"]["error"]["code"]) for e in errs] \
        == [("lost", 404, "model_not_found")]
    assert c.files.retrieve(b.output_file_id).purpose == "batch_output"
    # a completions batch, validated by its own type
    f2 = c.files.create(file=("c.jsonl", jsonl([{"custom_id": "p", "method": "POST", "url": "/v1/completions",
                                                  "body": {"model": "demo-model", "prompt": "A class",
                                                           "max_tokens": 4}}])), purpose="batch")
    b2 = wait(c, c.batches.create(input_file_id=f2.id, endpoint="/v1/completions", completion_window="24h").id)
    assert b2.status == "completed" and b2.request_counts.completed == 1
    line = json.loads(c.files.content(b2.output_file_id).text)
    assert Completion.model_validate(line["response"]["body"]).object == "text_completion"
    assert c.files.delete(f2.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f2.id)


@pytest.fixture(scope="module")
def long_batch(server: ServerProcess) -> Batch:
    """A batch of 400 requests of 8..387 tokens each (min_tokens: no early EOS, so they finish
    one after another, over far longer than the tests take), in progress with some done; the
    status page tests look at it, the cancel test cancels it."""
    c = client(server)
    rows = [chat_line(f"r{i}", f"Explain item {i}", max_tokens=8 + i * 37 % 380) for i in range(400)]
    for r in rows:
        r["body"]["min_tokens"] = r["body"]["max_tokens"]
    f = c.files.create(file=("big.jsonl", jsonl(rows)), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while (b.request_counts is None or b.request_counts.completed == 0) and time.monotonic() < deadline:
        time.sleep(0.05)
        b = c.batches.retrieve(b.id)
    assert b.status == "in_progress" and 0 < b.request_counts.completed < 400, b
    return b


def page_rows(page: str) -> dict[str, dict[str, int]]:
    """Each batch row of the status page: its counts as the page shows them."""
    rows = {}
    for m in re.finditer(r'<tr class="batch" data-batch="([^"]+)" data-status="[^"]+" data-completed="(\d+)" '
                         r'data-failed="(\d+)" data-total="(\d+)">(.*?)</tr>', page):
        ok, bad, total = int(m[2]), int(m[3]), int(m[4])
        assert f"{ok + bad}/{total}</td>" in m[5]  # the text shows what the attributes say
        rows[m[1]] = {"completed": ok, "failed": bad, "total": total}
    return rows


def chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.mark.slow
def test_status_page_in_headless_chromium_shows_the_api_counts(server: ServerProcess, long_batch: Batch,
                                                               tmp_path: Path) -> None:
    exe = chromium()
    if exe is None:
        pytest.skip("chromium not found (apt-get install chromium; .ci/run installs it where it can)")
    c = client(server)
    before = c.batches.retrieve(long_batch.id).request_counts
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,1400"]
    url = f"{server.url}/?key={K1}"  # sets the key's cookie and redirects to /
    dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=60).stdout
    after = c.batches.retrieve(long_batch.id).request_counts
    shown = page_rows(dom)[long_batch.id]
    assert before.completed <= shown["completed"] <= after.completed and shown["total"] == after.total == 400
    assert "running: <code>" + long_batch.id in dom and "<svg" in dom and "tok/s" in dom  # explain + timeline
    assert "decode" in dom and "prefill" in dom  # explain's summary of the plan


@pytest.mark.slow
def test_status_page_without_a_browser(server: ServerProcess, long_batch: Batch) -> None:
    req = urllib.request.Request(server.url + "/", headers={"Authorization": f"Bearer {K1}"})
    before = client(server).batches.retrieve(long_batch.id).request_counts
    page = urllib.request.urlopen(req, timeout=10).read().decode()
    after = client(server).batches.retrieve(long_batch.id).request_counts
    shown = page_rows(page)[long_batch.id]
    assert before.completed <= shown["completed"] <= after.completed
    assert "http-equiv='refresh'" in page and "<script" not in page
    with pytest.raises(urllib.error.HTTPError) as e:  # no key, no page
        urllib.request.urlopen(server.url + "/", timeout=10)
    assert e.value.code == 401
    other = urllib.request.Request(server.url + "/", headers={"Authorization": f"Bearer {K2}"})
    assert long_batch.id not in urllib.request.urlopen(other, timeout=10).read().decode()


@pytest.mark.slow
def test_cancel_mid_run_keeps_the_finished_results(server: ServerProcess, long_batch: Batch) -> None:
    c = client(server)
    cancelled = c.batches.cancel(long_batch.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
    b = wait(c, long_batch.id)
    assert b.status == "cancelled" and b.cancelled_at, b
    done = b.request_counts.completed
    assert 0 < done < 400 and b.request_counts.total == 400
    out = c.files.content(b.output_file_id).text.splitlines()
    assert len(out) == done
    for line in out:
        ChatCompletion.model_validate(json.loads(line)["response"]["body"])
    assert len({json.loads(x)["custom_id"] for x in out}) == done
    assert c.batches.cancel(b.id).status == "cancelled"  # idempotent


@pytest.mark.slow
def test_a_batch_past_its_window_expires_with_what_finished(server: ServerProcess) -> None:
    """Expiry (24h) brought forward by setting the batch's expires_at in the server's database
    while it runs (SQLite in WAL mode takes a second writer): the run stops, the finished
    results are in the output file and every other request is a `batch_expired` error line."""
    import sqlite3

    c = client(server)
    rows = [chat_line(f"e{i}", f"Explain item {i}", max_tokens=8 + i * 37 % 380) for i in range(300)]
    for r in rows:
        r["body"]["min_tokens"] = r["body"]["max_tokens"]
    f = c.files.create(file=("exp.jsonl", jsonl(rows)), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while (b.request_counts.completed == 0 or b.status != "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        b = c.batches.retrieve(b.id)
    with sqlite3.connect(server.data_dir / "server.db", timeout=30) as db:
        db.execute("UPDATE batches SET expires_at = ? WHERE id = ?", (int(time.time()) - 1, b.id))
    b = wait(c, b.id)
    assert b.status == "expired" and b.expired_at, b
    ok, bad = b.request_counts.completed, b.request_counts.failed
    assert 0 < ok < 300 and ok + bad == 300
    assert len(c.files.content(b.output_file_id).text.splitlines()) == ok
    errs = [json.loads(x) for x in c.files.content(b.error_file_id).text.splitlines()]
    assert len(errs) == bad and {e["error"]["code"] for e in errs} == {"batch_expired"}


@pytest.mark.slow
def test_lists_paginate(server: ServerProcess) -> None:
    c = client(server, K2)
    f = c.files.create(file=("one.jsonl", jsonl([chat_line("a", "hi", 1)])), purpose="batch")
    ids = [c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
           for _ in range(5)]
    page = c.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    second = c.batches.list(limit=2, after=page.data[-1].id)
    assert [b.id for b in second.data] == ids[::-1][2:4]
    assert [b.id for b in c.batches.list(limit=2)] == ids[::-1]  # the client follows `after` through every page
    for bid in ids:
        wait(c, bid)
    files = [c.files.create(file=(f"f{i}.jsonl", jsonl([chat_line("a", "hi", 1)])), purpose="batch").id
             for i in range(3)]
    listed = [x.id for x in c.files.list(limit=2, purpose="batch")]
    assert listed[:3] == files[::-1] and f.id in listed


@pytest.mark.slow
def test_a_key_sees_only_its_own_objects_and_no_key_gets_401(server: ServerProcess) -> None:
    one, two = client(server, K1), client(server, K2)
    f = one.files.create(file=("mine.jsonl", jsonl([chat_line("m", "hi", 1)])), purpose="batch")
    b = one.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert f.id not in [x.id for x in two.files.list()]
    assert b.id not in [x.id for x in two.batches.list()]
    for call in (lambda: two.files.retrieve(f.id), lambda: two.files.content(f.id), lambda: two.files.delete(f.id),
                 lambda: two.batches.retrieve(b.id), lambda: two.batches.cancel(b.id),
                 lambda: two.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    for key in (None, "not-a-key-at-all"):
        req = urllib.request.Request(server.url + "/v1/files")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 401
        err = json.loads(e.value.read())["error"]
        assert err["type"] == "invalid_request_error" and err["code"] in ("missing_api_key", "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong-key-123456").batches.list()
    assert wait(one, b.id).status == "completed"


def raw(server: ServerProcess, method: str, path: str, body: bytes | None = None,
        ctype: str = "application/json", key: str = K1) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, data=body, method=method,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def openai_error(status: int, doc: dict, want: int) -> bool:
    err = doc.get("error") or {}
    return status == want and set(err) == {"message", "type", "param", "code"} and bool(err["message"])


@pytest.mark.slow
def test_bad_input_gets_openai_errors_and_breaks_nothing(server: ServerProcess) -> None:
    c = client(server)
    # a file that is not JSONL: the batch fails with errors naming the line
    f = c.files.create(file=("notes.txt", b"this is not json\n{\"custom_id\": 1}\n"), purpose="batch")
    b = wait(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    assert b.status == "failed" and b.failed_at and b.errors.data[0].code == "invalid_json_line"
    assert b.errors.data[0].line == 1
    # a file over the limit: 413, nothing stored
    before = len(c.files.list().data)
    with pytest.raises(openai.APIStatusError) as e:
        c.files.create(file=("big.jsonl", b"x" * (LIMIT + 1)), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
    assert len(c.files.list().data) == before
    good = c.files.create(file=("ok.jsonl", jsonl([chat_line("g", "hi", 2)])), purpose="batch")
    # an unknown endpoint, a bad window, a deleted file, an unknown route, a bad JSON body
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=good.id, endpoint="/v1/embeddings", completion_window="24h")  # type: ignore
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError):
        c.batches.create(input_file_id=good.id, endpoint="/v1/completions", completion_window="1h")  # type: ignore
    gone = c.files.create(file=("gone.jsonl", jsonl([chat_line("g", "hi", 2)])), purpose="batch")
    c.files.delete(gone.id)
    with pytest.raises(openai.NotFoundError):
        c.batches.create(input_file_id=gone.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert openai_error(*raw(server, "GET", "/v1/nothing/here"), 404)
    assert openai_error(*raw(server, "POST", "/v1/batches", b"{not json"), 400)
    assert openai_error(*raw(server, "POST", "/v1/batches", b"[1, 2]"), 400)
    assert openai_error(*raw(server, "GET", "/v1/batches?limit=0"), 400)
    assert openai_error(*raw(server, "GET", "/v1/files/..%2F..%2Fserver.db"), 404)
    assert openai_error(*raw(server, "POST", "/v1/files", b"plain", ctype="text/plain"), 415)
    # 1,000 bad batch creations in a burst, from 8 threads: each its OpenAI error, the server fine
    bodies = [{"input_file_id": gone.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
              {"input_file_id": good.id, "endpoint": "/v1/embeddings", "completion_window": "24h"},
              {"endpoint": "/v1/chat/completions", "completion_window": "24h"},
              {"input_file_id": good.id, "endpoint": "/v1/completions", "completion_window": "24h",
               "metadata": {"k": 5}}]
    def one(i: int) -> bool:
        body = json.dumps(bodies[i % 4]).encode() if i % 5 else b"{\"input_file_id\": "
        status, doc = raw(server, "POST", "/v1/batches", body)
        return openai_error(status, doc, 404 if i % 5 and i % 4 == 0 else 400)
    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(1000)))
    b = wait(c, c.batches.create(input_file_id=good.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    assert b.status == "completed" and b.request_counts.completed == 1
