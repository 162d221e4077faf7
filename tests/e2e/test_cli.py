"""End-to-end tests of the `moecc` command line (`moecc compile`, `moecc exec`).

Most cases run the real entry point (`python -m moecc.cli ...`) in a subprocess. Each
subprocess pays ~3-4 s of imports, so every subprocess this module needs is started once,
up front, by the module-scoped `runs` fixture, on a small thread pool (one process per
core); each test then waits for and inspects its own run. Cases where a subprocess adds
nothing use typer's CliRunner or the Python APIs in-process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from moecc.compiler import compile_model
from moecc.errors import MoeccError
from moecc.passes import PASS_NAMES
from moecc.sizes import parse_size
from moecc.testing.checkpoints import write_checkpoint
from moecc_runtime.plan import PlanError, check_checkpoint, save_plan

PASSES = ("trace", *PASS_NAMES)
PROVENANCE = re.compile(r"^# (\d{3}) made by pass (\w+) in \d+(?:\.\d+)? ms \((changed|unchanged)\)$")
RESULT_KEYS = {"custom_id", "text", "token_ids", "finish_reason", "usage", "moecc"}  # moecc: the job identity

SEEDED = {"custom_id": "seeded", "prompt": "A pulley is a wheel", "max_tokens": 8,
          "temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 5}
GOOD = [
    {"custom_id": "greedy", "prompt": "Hello world", "max_tokens": 5},
    {"custom_id": "default_max", "prompt": "The kettle clicked off"},  # --max-tokens 6
    {"custom_id": "chat", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 3},
    SEEDED,
    {"prompt": "Numbers: 2, 3, 5", "max_tokens": 4},  # custom_id defaults to request-5
]
GOOD_MAX_TOKENS = {"greedy": 5, "default_max": 6, "chat": 3, "seeded": 8, "request-5": 4}
# the seeded request again, with other (different) requests around it
SEEDED_COMPANIONS = [
    {"custom_id": "other1", "prompt": "Completely different text, and longer than the rest of them",
     "max_tokens": 7, "temperature": 1.0, "seed": 99},
    SEEDED,
    {"custom_id": "other2", "messages": [{"role": "user", "content": "What is a pulley?"}], "max_tokens": 2},
]
MIXED_LINES = [
    json.dumps({"custom_id": "m1", "prompt": "Hello", "max_tokens": 3}),
    '{"custom_id": "m2", "prompt": "oops"',  # malformed JSON on line 2
    json.dumps({"custom_id": "m3", "prompt": "World", "max_tokens": 3}),
]


pytestmark = pytest.mark.slow  # the whole file


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def read_jsonl(path: Path | str) -> list[dict]:
    text = Path(path).read_text(encoding="utf-8") if isinstance(path, Path) else path
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def by_id(rows: list[dict]) -> dict[str, dict]:
    out = {r["custom_id"]: r for r in rows}
    assert len(out) == len(rows), "duplicate custom_id in results"
    return out


def run_cli(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "moecc.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def assert_clean_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    """Exit status 1, an `error:` line on stderr naming every fragment, no traceback."""
    detail = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 1, detail
    assert "Traceback" not in proc.stderr, detail
    assert "error: " in proc.stderr, detail
    for fragment in fragments:
        assert fragment in proc.stderr, f"{fragment!r} missing; {detail}"


# ----------------------------------------------------------------------------- fixtures


@dataclass
class Env:
    root: Path
    ckpt: Path  # tiny Mixtral, seed 0
    plan: Path  # plan for ckpt, compiled in-process
    other_ckpt: Path  # copy of ckpt whose config.json was changed after compiling other_plan
    other_plan: Path
    config_only: Path  # only config.json
    llama: Path  # config.json of an unsupported architecture
    no_config: Path  # a directory without config.json
    good: Path
    mixed: Path
    seeded: Path
    not_a_plan: Path


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    root = tmp_path_factory.mktemp("cli")
    ckpt = write_checkpoint(root / "mixtral", "mixtral", seed=0)

    plan, _ = compile_model(ckpt)
    save_plan(plan, root / "plan.pt")

    other = root / "other"
    shutil.copytree(ckpt, other)
    other_plan, _ = compile_model(other)
    save_plan(other_plan, root / "other_plan.pt")
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-5) * 10
    (other / "config.json").write_text(json.dumps(config, indent=2))

    config_only = root / "config_only"
    config_only.mkdir()
    shutil.copy(ckpt / "config.json", config_only / "config.json")

    llama = root / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 384,
    }))

    no_config = root / "no_config"
    no_config.mkdir()
    (no_config / "README.md").write_text("weights live elsewhere\n")

    (root / "good.jsonl").write_text(jsonl(GOOD))
    (root / "mixed.jsonl").write_text("\n".join(MIXED_LINES) + "\n")
    (root / "seeded.jsonl").write_text(jsonl(SEEDED_COMPANIONS))
    (root / "notes.txt").write_text("this is not a plan\n")
    return Env(root, ckpt, root / "plan.pt", other, root / "other_plan.pt", config_only, llama, no_config,
               root / "good.jsonl", root / "mixed.jsonl", root / "seeded.jsonl", root / "notes.txt")


def _jobs(e: Env) -> dict[str, Callable[[], object]]:
    """Every subprocess this module runs, by name; chains run their steps in order."""
    r = e.root

    def compile_then_exec() -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
        c = run_cli("compile", e.ckpt, "-o", r / "cli_plan.pt", "--dump-dir", r / "dump",
                    "--print-after", "split_modules", cwd=r)
        x = run_cli("exec", r / "cli_plan.pt", e.good, "-o", r / "good_out.jsonl", "--max-tokens", 6, cwd=r)
        return c, x

    def config_only_chain() -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
        c = run_cli("compile", e.config_only, "-o", r / "config_only_plan.pt", cwd=r)
        x = run_cli("exec", r / "config_only_plan.pt", e.good, "-o", r / "config_only_out.jsonl", cwd=r)
        return c, x

    return {  # longest first
        "compile_then_exec": compile_then_exec,
        "config_only": config_only_chain,
        "exec_mixed": lambda: run_cli("exec", e.plan, e.mixed, "-o", r / "mixed_out.jsonl", cwd=r),
        "exec_seeded": lambda: run_cli("exec", e.plan, e.seeded, cwd=r),  # results on stdout
        "exec_other_checkpoint": lambda: run_cli("exec", e.other_plan, e.good, "-o", r / "other_out.jsonl", cwd=r),
        "exec_missing_prompts": lambda: run_cli("exec", e.plan, r / "missing.jsonl", "-o", r / "mp.jsonl", cwd=r),
        "compile_bogus_pass": lambda: run_cli("compile", e.ckpt, "-o", r / "bogus.pt", "--print-after", "bogus",
                                              cwd=r),
        "compile_small_gpu": lambda: run_cli("compile", e.ckpt, "-o", r / "small.pt", "--gpu-mem", "100KB", cwd=r),
        "compile_llama": lambda: run_cli("compile", e.llama, "-o", r / "llama.pt", cwd=r),
        "compile_missing_dir": lambda: run_cli("compile", r / "no_such_model", "-o", r / "missing.pt", cwd=r),
        "compile_no_config": lambda: run_cli("compile", e.no_config, "-o", r / "no_config.pt", cwd=r),
    }


@pytest.fixture(scope="module")
def runs(env: Env) -> Iterator[dict[str, Future]]:
    workers = max(2, min(4, os.cpu_count() or 2))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moecc-cli") as pool:
        futures = {name: pool.submit(job) for name, job in _jobs(env).items()}
        yield futures
        for f in futures.values():
            f.cancel()


def result(runs: dict[str, Future], name: str):
    return runs[name].result(timeout=600)


# ----------------------------------------------------------------------------- compile + exec success


def test_compile_succeeds_and_reports_the_plan(env: Env, runs: dict[str, Future]) -> None:
    c, _ = result(runs, "compile_then_exec")
    assert c.returncode == 0, c.stderr
    assert (env.root / "cli_plan.pt").is_file()
    assert "wrote" in c.stderr and "MixtralForCausalLM" in c.stderr and "weights present" in c.stderr


def test_exec_writes_one_result_line_per_request(env: Env, runs: dict[str, Future]) -> None:
    c, x = result(runs, "compile_then_exec")
    assert c.returncode == 0, c.stderr
    assert x.returncode == 0, x.stderr
    assert "5 ok, 0 failed of 5 requests; tokens in " in x.stderr
    assert x.stdout == ""  # results went to -o
    rows = read_jsonl(env.root / "good_out.jsonl")
    assert len(rows) == len(GOOD)
    results = by_id(rows)
    assert set(results) == set(GOOD_MAX_TOKENS)

    from moecc_runtime.tokenizer import Tokenizer

    tok = Tokenizer(env.ckpt)
    for cid, r in results.items():
        assert set(r) == RESULT_KEYS, r
        assert set(r["usage"]) == {"prompt_tokens", "completion_tokens"}
        assert isinstance(r["text"], str)
        assert all(isinstance(t, int) and 0 <= t < 384 for t in r["token_ids"])
        assert r["usage"]["completion_tokens"] == len(r["token_ids"])
        # the tiny random model never emits EOS this early, so every request hits its limit
        assert r["finish_reason"] == "length", r
        assert len(r["token_ids"]) == GOOD_MAX_TOKENS[cid], r
        assert r["text"] == tok.decode(r["token_ids"])
    assert results["greedy"]["usage"]["prompt_tokens"] == len(tok.encode_prompt("Hello world"))
    assert results["chat"]["usage"]["prompt_tokens"] == len(tok.encode_messages(GOOD[2]["messages"]))
    assert not (env.root / "good_out.errors.jsonl").exists()


def test_dump_dir_has_one_file_per_pass_with_provenance(env: Env, runs: dict[str, Future]) -> None:
    c, _ = result(runs, "compile_then_exec")
    assert c.returncode == 0, c.stderr
    files = sorted((env.root / "dump").iterdir())
    assert [f.name for f in files] == [f"{i:03d}_{name}.txt" for i, name in enumerate(PASSES)]
    for i, (f, name) in enumerate(zip(files, PASSES)):
        first, _, body = f.read_text().partition("\n")
        m = PROVENANCE.match(first)
        assert m, first
        assert m.group(1) == f"{i:03d}" and m.group(2) == name
        assert body.strip(), f"{f.name} has no graph"


def test_print_after_prints_that_pass_graph_to_stdout(env: Env, runs: dict[str, Future]) -> None:
    c, _ = result(runs, "compile_then_exec")
    assert c.returncode == 0, c.stderr
    lines = c.stdout.splitlines()
    headers = [line for line in lines if line.startswith("# ") and "made by pass" in line]
    assert len(headers) == 1, c.stdout[:2000]
    m = PROVENANCE.match(headers[0])
    assert m and m.group(1) == "001" and m.group(2) == "split_modules"
    assert lines[0] == headers[0]
    # the printed graph is the one dumped for the same pass
    dumped = (env.root / "dump" / "001_split_modules.txt").read_text().splitlines()[1:]
    assert [line for line in lines[1:] if line.strip()] == [line for line in dumped if line.strip()]


def test_print_after_unknown_pass_fails_naming_it(env: Env, runs: dict[str, Future]) -> None:
    proc = result(runs, "compile_bogus_pass")
    assert_clean_error(proc, "--print-after", "bogus", "split_modules", "emit_plan")
    assert not (env.root / "bogus.pt").exists()


# ----------------------------------------------------------------------------- seeded sampling


def test_seeded_sampled_request_is_reproducible(env: Env, runs: dict[str, Future]) -> None:
    _, first = result(runs, "compile_then_exec")
    assert first.returncode == 0, first.stderr
    in_first = by_id(read_jsonl(env.root / "good_out.jsonl"))["seeded"]

    second = result(runs, "exec_seeded")
    assert second.returncode == 0, second.stderr
    rows = by_id(read_jsonl(second.stdout))  # no -o: results on stdout
    assert set(rows) == {"other1", "seeded", "other2"}
    assert rows["seeded"]["token_ids"] == in_first["token_ids"]
    assert rows["seeded"]["text"] == in_first["text"]


def test_seeded_request_alone_in_process_matches_and_seed_matters(env: Env, runs: dict[str, Future],
                                                                   tmp_path: Path) -> None:
    import io

    from moecc_runtime.job.exec import run_job

    _, first = result(runs, "compile_then_exec")
    assert first.returncode == 0, first.stderr
    want = by_id(read_jsonl(env.root / "good_out.jsonl"))["seeded"]["token_ids"]
    prompts = tmp_path / "alone.jsonl"
    greedy = {k: v for k, v in SEEDED.items() if k != "seed"} | {"custom_id": "greedy", "temperature": 0.0}
    prompts.write_text(jsonl([SEEDED, {**SEEDED, "custom_id": "seed6", "seed": 6}, greedy]))
    out = io.StringIO()
    summary = run_job(env.plan, prompts, out, device="cpu", log=None)
    assert summary.failed == 0 and summary.succeeded == 3
    got = by_id(read_jsonl(out.getvalue()))
    assert got["seeded"]["token_ids"] == want
    # the seed and the temperature are actually used
    assert got["seed6"]["token_ids"] != want
    assert got["greedy"]["token_ids"] != want


# ----------------------------------------------------------------------------- bad request lines


def test_malformed_line_fails_alone(env: Env, runs: dict[str, Future]) -> None:
    proc = result(runs, "exec_mixed")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"{env.mixed}:2: " in proc.stderr
    assert "malformed JSON" in proc.stderr
    assert "2 ok, 1 failed of 3 requests" in proc.stderr
    errors_path = env.root / "mixed_out.errors.jsonl"  # default: beside the output
    assert str(errors_path) in proc.stderr
    results = by_id(read_jsonl(env.root / "mixed_out.jsonl"))
    assert set(results) == {"m1", "m3"}
    assert all(r["finish_reason"] == "length" and len(r["token_ids"]) == 3 for r in results.values())
    errors = read_jsonl(errors_path)
    assert len(errors) == 1
    assert errors[0]["error"]["line"] == 2
    assert "malformed JSON" in errors[0]["error"]["message"]
    assert errors[0]["custom_id"] in (None, "m2")


def test_errors_option_names_the_errors_file(env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process (CliRunner): `--errors FILE` puts the error records there."""
    from typer.testing import CliRunner

    from moecc.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out, errs = tmp_path / "out.jsonl", tmp_path / "my_errors.jsonl"
    res = CliRunner().invoke(app, ["exec", str(env.plan), str(env.mixed), "-o", str(out), "--errors", str(errs),
                                   "--device", "cpu"])
    assert res.exit_code == 1, res.output
    assert set(by_id(read_jsonl(out))) == {"m1", "m3"}
    assert [e["error"]["line"] for e in read_jsonl(errs)] == [2]
    assert not (tmp_path / "out.errors.jsonl").exists()


# ----------------------------------------------------------------------------- compile errors


def test_missing_model_directory(env: Env, runs: dict[str, Future]) -> None:
    proc = result(runs, "compile_missing_dir")
    assert_clean_error(proc, "no_such_model", "no such directory")
    assert not (env.root / "missing.pt").exists()


def test_directory_without_config_json(env: Env, runs: dict[str, Future]) -> None:
    proc = result(runs, "compile_no_config")
    assert_clean_error(proc, str(env.no_config.name), "not a checkpoint", "config.json")
    assert not (env.root / "no_config.pt").exists()


def test_unsupported_architecture_lists_the_supported_ones(env: Env, runs: dict[str, Future]) -> None:
    proc = result(runs, "compile_llama")
    assert_clean_error(proc, "LlamaForCausalLM", "not supported", "MixtralForCausalLM", "Qwen3MoeForCausalLM")
    assert not (env.root / "llama.pt").exists()


def test_gpu_mem_too_small_says_the_minimum(env: Env, runs: dict[str, Future]) -> None:
    proc = result(runs, "compile_small_gpu")
    assert_clean_error(proc, "--gpu-mem", "minimum working set", "or more")
    assert not (env.root / "small.pt").exists()


@pytest.mark.parametrize(("option", "value", "fragment"),
                         [("--gpu-mem", "24XB", "unknown unit 'XB'"), ("--host-mem", "-1GB", "cannot parse"),
                          ("--gpu-mem", "0", "positive")])
def test_unparseable_size_names_the_option(env: Env, tmp_path: Path, option: str, value: str,
                                           fragment: str) -> None:
    """In-process (CliRunner): the size is rejected before anything is loaded."""
    from typer.testing import CliRunner

    from moecc.cli import app

    res = CliRunner().invoke(app, ["compile", str(env.ckpt), "-o", str(tmp_path / "p.pt"), option, value])
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith(f"error: {option}: "), res.stderr
    assert fragment in res.stderr and repr(value) in res.stderr
    assert "Traceback" not in res.output
    assert not (tmp_path / "p.pt").exists()


def test_suggested_minimum_gpu_mem_is_enough(env: Env) -> None:
    with pytest.raises(MoeccError) as info:
        compile_model(env.ckpt, gpu_mem=100_000)
    m = re.search(r"use --gpu-mem (\S+) or more", str(info.value))
    assert m, str(info.value)
    compile_model(env.ckpt, gpu_mem=parse_size(m.group(1)))  # must not raise


def test_gpu_mem_budget_changes_the_plan(env: Env) -> None:
    unbounded, _ = compile_model(env.ckpt)
    small, _ = compile_model(env.ckpt, gpu_mem=parse_size("2MB"))
    dev = small["memory"]["device"]
    assert dev["budget"] == 1_800_000
    assert max(dev["decode_total"], dev["prefill_total"]) <= dev["budget"]
    assert unbounded["memory"]["device"]["budget"] is None
    assert small["batch"] != unbounded["batch"]
    with pytest.raises(MoeccError, match="minimum working set"):
        compile_model(env.ckpt, gpu_mem=dev["decode_total"] // 4)


# ----------------------------------------------------------------------------- plan / checkpoint mismatches


def test_plan_for_another_checkpoint_is_refused(env: Env, runs: dict[str, Future]) -> None:
    proc = result(runs, "exec_other_checkpoint")
    assert_clean_error(proc, "another checkpoint", "config.json", str(env.other_ckpt))
    out = env.root / "other_out.jsonl"
    assert not out.exists() or read_jsonl(out) == []


def test_changed_weight_file_is_refused_in_process(env: Env, tmp_path: Path) -> None:
    moved = tmp_path / "moved"
    shutil.copytree(env.ckpt, moved)
    import torch

    plan = torch.load(str(env.plan), weights_only=True)
    assert check_checkpoint(plan, moved) == moved  # an identical copy passes (--model DIR)
    weights = sorted(moved.glob("*.safetensors"))[0]
    with open(weights, "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(PlanError, match="another checkpoint: weight file sizes"):
        check_checkpoint(plan, moved)
    weights.unlink()
    with pytest.raises(PlanError, match="missing"):
        check_checkpoint(plan, moved)


def test_config_only_plan_compiles_but_cannot_exec(env: Env, runs: dict[str, Future]) -> None:
    c, x = result(runs, "config_only")
    assert c.returncode == 0, c.stderr
    assert "config only (cannot exec)" in c.stderr
    assert (env.root / "config_only_plan.pt").is_file()
    assert_clean_error(x, "without weight files", str(env.config_only))


def test_missing_prompts_file(env: Env, runs: dict[str, Future]) -> None:
    proc = result(runs, "exec_missing_prompts")
    assert_clean_error(proc, "missing.jsonl")
    assert "No such file" in proc.stderr or "no such file" in proc.stderr


@pytest.mark.parametrize("case", ["missing_plan", "text_file"])
def test_bad_plan_file(env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """In-process (CliRunner): the plan is checked before anything else is loaded."""
    from typer.testing import CliRunner

    from moecc.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    plan = tmp_path / "nope.pt" if case == "missing_plan" else env.not_a_plan
    res = CliRunner().invoke(app, ["exec", str(plan), str(env.good), "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith(f"error: {plan}: "), res.stderr
    assert ("no such plan file" if case == "missing_plan" else "not a moecc plan") in res.stderr
    assert "moecc compile" in res.stderr or case == "text_file"


def test_token_id_prompts_and_stats_file(env: Env, runs: dict[str, Future], tmp_path: Path) -> None:
    """A prompt given as token ids runs like its text; an id outside the vocabulary fails
    alone naming the line; stats_path gets the summary and one record per engine step."""
    import io

    from moecc_runtime.job.exec import run_job
    from moecc_runtime.tokenizer import Tokenizer

    _, first = result(runs, "compile_then_exec")
    assert first.returncode == 0, first.stderr
    ids = Tokenizer(env.ckpt).encode_prompt("The cat sat")
    prompts = tmp_path / "ids.jsonl"
    prompts.write_text(jsonl([
        {"custom_id": "text", "prompt": "The cat sat", "max_tokens": 4},
        {"custom_id": "ids", "prompt": ids, "max_tokens": 4},
        {"custom_id": "oov", "prompt": [1, 10**6], "max_tokens": 4},
    ]))
    out, stats = io.StringIO(), tmp_path / "stats.json"
    summary = run_job(env.plan, prompts, out, device="cpu", log=None, stats_path=stats)
    assert (summary.succeeded, summary.failed) == (2, 1)
    got = by_id(read_jsonl(out.getvalue()))
    assert got["ids"]["token_ids"] == got["text"]["token_ids"]
    assert summary.errors[0]["error"]["line"] == 3 and "outside the model's vocabulary" in \
        summary.errors[0]["error"]["message"]
    data = json.loads(stats.read_text())
    recs = data["engine"]["records"]
    assert data["completion_tokens"] == 8 and len(recs) == data["engine"]["steps"] >= 4
    assert 0 < data["load_seconds"] < data["seconds"] <= data["wall_seconds"]  # load, then the run, inside the job
    # the first wave's KV pages committed in start-up (3 requests), not by the steps
    assert data["engine"]["kv_prefault_bytes"] > 0 and data["engine"]["kv_prefault_seconds"] <= data["load_seconds"]
    one = tmp_path / "one.json"  # --max-batch 1: a first wave of one sequence, a third of the three's
    run_job(env.plan, prompts, io.StringIO(), device="cpu", log=None, stats_path=one, max_batch=1)
    assert 3 * json.loads(one.read_text())["engine"]["kv_prefault_bytes"] == data["engine"]["kv_prefault_bytes"]
    assert sum(r["prefill_tokens"] + r["decode_tokens"] for r in recs) == data["engine"]["tokens"]
    assert all(r["kv_allocated_bytes"] >= r["kv_live_bytes"] > 0 for r in recs)
