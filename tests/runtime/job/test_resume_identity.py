"""`moecc exec --resume` continues only its own job (issue 20, items 5 and 12): every result
and error line records the plan identity and the request's hash; a resume with another plan
(or on lines no moecc exec wrote) is refused naming file, line and both identities, changing
nothing; a request changed since its result or error was written runs again, its stale line
moved to `<file>.replaced.jsonl`; errors are keyed by custom_id and request hash, so an
inserted line skips nothing and a fixed line is retried; a corrupt middle line is reported
and moved aside; an unwritable --errors path fails at once, creating no output."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from moecc.compiler import compile_model
from moecc.testing.checkpoints import write_checkpoint
from moecc_runtime.job.exec import run_job
from moecc_runtime.job.lock import JobIdentityError
from moecc_runtime.job.results import plan_identity, replaced_path
from moecc_runtime.plan import PlanError, load_plan, save_plan


pytestmark = pytest.mark.slow  # the whole file


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_input(path: Path, lines: list[dict | bytes]) -> Path:
    """A prompts file: dicts as JSON lines, bytes verbatim."""
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))
    return path


def req(cid: str, prompt: str, max_tokens: int | None = 3) -> dict:
    return {"custom_id": cid, "prompt": prompt} | ({"max_tokens": max_tokens} if max_tokens else {})


BAD = {"custom_id": "bad", "prompt": "x", "max_tokens": "3"}  # max_tokens of the wrong type


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """Plans of one tiny Mixtral ("a", and "a2" recompiled), of it under a device budget
    ("budget"), of it with a smaller batch ("batch") and of another checkpoint of the same
    layout, other weights ("model")."""
    root = tmp_path_factory.mktemp("identity")
    ckpt = write_checkpoint(root / "mixtral", "mixtral", seed=3)
    other = write_checkpoint(root / "other", "mixtral", seed=4)
    out = {}
    for name, model, kw in (("a", ckpt, {}), ("a2", ckpt, {}), ("budget", ckpt, {"gpu_mem": 4_000_000}),
                            ("batch", ckpt, {"max_batch": 2}), ("model", other, {})):
        plan, _ = compile_model(model, **kw)
        save_plan(plan, root / f"{name}.pt")
        out[name] = root / f"{name}.pt"
    return out


def run(plans: dict[str, Path], prompts: Path, out: Path, errors: Path | None = None, plan: str = "a",
        **kw) -> tuple[object, str]:
    """run_job on the CPU with `plan`; (summary, what it logged)."""
    log = io.StringIO()
    summary = run_job(plans[plan], prompts, out, errors_path=errors, device="cpu", log=log, **kw)
    return summary, log.getvalue()


def fresh(plans: dict[str, Path], prompts: Path, tmp_path: Path) -> dict[str, dict]:
    """What an uninterrupted run of `prompts` writes, by custom_id."""
    ref = tmp_path / "fresh.jsonl"
    run(plans, prompts, ref, tmp_path / "fresh.errors.jsonl")
    return {r["custom_id"]: r for r in rows_of(ref)}


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_plan_identity_names_what_the_plan_computes(plans):
    ids = {name: plan_identity(load_plan(p)) for name, p in plans.items()}
    assert ids["a"] == ids["a2"], "recompiling the same checkpoint changed the identity"
    assert len({ids["a"], ids["budget"], ids["batch"], ids["model"]}) == 4
    assert all(len(i) == 16 and int(i, 16) >= 0 for i in ids.values())
    plan = load_plan(plans["a"])
    assert plan_identity(plan, plan["model"]["dir"]) == ids["a"] != plan_identity(plan, plans["a"].parent / "other")
    assert plan_identity({**plan, "predicted": {}, "timeline": None}) == ids["a"]


@pytest.mark.parametrize("other", ["budget", "model"])
def test_resume_with_another_plan_is_refused_and_changes_nothing(plans, tmp_path, monkeypatch, other):
    from typer.testing import CliRunner

    from moecc.cli import app

    prompts = write_input(tmp_path / "in.jsonl", [req("a", "a wheel"), BAD, req("c", "the rope")])
    out, errors = tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
    run(plans, prompts, out, errors)
    with open(out, "ab") as f:
        f.write(b'{"custom_id": "c", "te')  # a torn tail: not cut when refused
    before = snapshot(tmp_path)
    ours, theirs = plan_identity(load_plan(plans["a"])), plan_identity(load_plan(plans[other]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = CliRunner().invoke(app, ["exec", str(plans[other]), str(prompts), "-o", str(out), "--resume",
                                   "--device", "cpu"])
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith(f"error: {out}:1: written by plan {ours}, but this job's plan is {theirs}: "), \
        res.stderr
    assert "resume with the plan that started this job, or give a new -o" in res.stderr
    assert "nothing was changed" in res.stderr and "Traceback" not in res.stderr
    assert snapshot(tmp_path) == before  # nothing cut, moved, created, or left locked


def test_resume_on_lines_no_moecc_exec_wrote_is_refused(plans, tmp_path):
    prompts = write_input(tmp_path / "in.jsonl", [req("a", "a wheel"), req("c", "the rope")])
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    ours = plan_identity(load_plan(plans["a"]))
    errors.write_text('{"custom_id": "a", "error": {"line": 1, "field": null, "message": "x"}}\n')
    before = snapshot(tmp_path)
    with pytest.raises(JobIdentityError) as e:  # the errors file alone: output missing
        run(plans, prompts, out, errors, resume=True)
    msg = str(e.value)
    assert msg.startswith(f"{errors}:1: this line carries no moecc job identity") and f"plan {ours}" in msg
    assert snapshot(tmp_path) == before and not out.exists()
    run(plans, prompts, out)
    full = out.read_bytes()
    out.write_bytes(full + b'{"custom_id": "z", "text": "from another tool"}\n')
    with pytest.raises(JobIdentityError, match=f"^{out}:3: this line carries no moecc job identity"):
        run(plans, prompts, out, resume=True)
    assert out.read_bytes() == full + b'{"custom_id": "z", "text": "from another tool"}\n'


def test_changed_prompt_is_rerun_once_and_its_stale_result_moved_aside(plans, tmp_path):
    prompts = write_input(tmp_path / "in.jsonl", [req("a", "a wheel"), req("b", "the rope"), req("c", "an axle")])
    out = tmp_path / "out.jsonl"
    run(plans, prompts, out)
    old_b = next(line for line in out.read_bytes().splitlines(keepends=True) if b'"custom_id": "b"' in line)
    write_input(prompts, [req("a", "a wheel"), req("b", "the kettle clicked"), req("c", "an axle")])
    s, log = run(plans, prompts, out, resume=True)
    assert (s.succeeded, s.skipped, s.changed) == (1, 2, 1)
    assert (f"moecc: 1 request changed since their results were written; rerunning them (the old results are "
            f"in {replaced_path(out)})") in log
    rows = rows_of(out)
    assert sorted(r["custom_id"] for r in rows) == ["a", "b", "c"]
    ref = fresh(plans, prompts, tmp_path)
    assert all(r == ref[r["custom_id"]] for r in rows)
    assert replaced_path(out).read_bytes() == old_b


def test_inserted_line_skips_no_valid_request(plans, tmp_path):
    """Errors were keyed by line number: a request inserted where a bad line was would be
    skipped as already failed. Now each request runs exactly once, the bad line fails once."""
    first = [req("a", "a wheel"), BAD, req("c", "the rope"), req("d", "an axle")]
    prompts = write_input(tmp_path / "in.jsonl", first)
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    run(plans, prompts, out, errors)
    out.write_bytes(out.read_bytes().splitlines(keepends=True)[0])  # as if killed after the first result
    err_before = errors.read_bytes()
    write_input(prompts, [first[0], req("n", "a pulley is"), *first[1:]])
    s, _ = run(plans, prompts, out, errors, resume=True)
    assert (s.requests, s.skipped, s.succeeded, s.failed) == (5, 2, 3, 0)
    ref = fresh(plans, prompts, tmp_path)
    rows = rows_of(out)
    assert sorted(r["custom_id"] for r in rows) == ["a", "c", "d", "n"]
    assert all(r == ref[r["custom_id"]] for r in rows)
    assert errors.read_bytes() == err_before and not replaced_path(errors).exists()


def test_fixed_bad_line_is_retried_and_its_error_no_longer_stands(plans, tmp_path):
    prompts = write_input(tmp_path / "in.jsonl", [req("a", "a wheel"), BAD, req("c", "the rope")])
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    run(plans, prompts, out, errors)
    old_error = errors.read_bytes()
    assert [e["custom_id"] for e in rows_of(errors)] == ["bad"]
    write_input(prompts, [req("a", "a wheel"), req("bad", "x"), req("c", "the rope")])
    s, log = run(plans, prompts, out, errors, resume=True)
    assert (s.succeeded, s.failed, s.skipped, s.retried) == (1, 0, 2, 1)
    assert f"moecc: 1 error record no longer match a request in {prompts} (fixed or changed since)" in log
    assert sorted(r["custom_id"] for r in rows_of(out)) == ["a", "bad", "c"]
    assert not errors.exists()  # its one record moved aside, and an errors file left empty is removed
    assert replaced_path(errors).read_bytes() == old_error
    assert rows_of(out)[-1] == fresh(plans, prompts, tmp_path)["bad"]


def test_duplicate_custom_id_error_never_stands_for_the_first_request(plans, tmp_path):
    same = req("a", "a wheel")
    prompts = write_input(tmp_path / "in.jsonl", [same, same])
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    first, _ = run(plans, prompts, out, errors)
    assert (first.succeeded, first.failed) == (1, 1)
    (dup,) = rows_of(errors)
    assert dup["error"]["field"] == "custom_id" and dup["error"]["line"] == 2
    result = out.read_bytes()
    out.write_bytes(b"")  # killed after writing the duplicate's error, before the first result
    s, _ = run(plans, prompts, out, errors, resume=True)
    assert (s.succeeded, s.failed, s.skipped) == (1, 0, 1)
    assert out.read_bytes() == result and rows_of(errors) == [dup]


def test_corrupt_middle_line_is_reported_moved_aside_and_rerun(plans, tmp_path):
    prompts = write_input(tmp_path / "in.jsonl", [req("a", "a wheel"), req("b", "the rope"), req("c", "an axle")])
    out = tmp_path / "out.jsonl"
    run(plans, prompts, out)
    lines = out.read_bytes().splitlines(keepends=True)
    garbage = [b'{"custom_id": "b", "text": "ha\n', b"[1, 2]\n"]
    out.write_bytes(lines[0] + garbage[0] + lines[2] + garbage[1])
    s, log = run(plans, prompts, out, resume=True)
    for n, why in ((2, "not valid JSON"), (4, "not a JSON object")):
        assert (f"moecc: {out}:{n}: corrupt line ({why}), not one moecc exec writes; moved to "
                f"{replaced_path(out)}") in log
    assert s.corrupt == [f"{out}:2: not valid JSON", f"{out}:4: not a JSON object"]
    assert (s.succeeded, s.skipped) == (1, 2)
    assert replaced_path(out).read_bytes() == b"".join(garbage)
    assert out.read_bytes() == lines[0] + lines[2] + lines[1]  # b rerun: the same result, written once


def test_changed_default_max_tokens_reruns_only_requests_that_use_it(plans, tmp_path):
    prompts = write_input(tmp_path / "in.jsonl", [req("own", "a wheel"), req("dflt", "the rope", None)])
    out = tmp_path / "out.jsonl"
    run(plans, prompts, out, max_tokens=2)
    s, _ = run(plans, prompts, out, resume=True, max_tokens=4)
    assert (s.succeeded, s.skipped, s.changed) == (1, 1, 1)
    assert {r["custom_id"]: len(r["token_ids"]) for r in rows_of(out)} == {"own": 3, "dflt": 4}


@pytest.mark.parametrize("where", ["proc", "under_a_file", "read_only_dir"])
def test_errors_on_an_unwritable_path_fails_at_once(plans, tmp_path, monkeypatch, where):
    from typer.testing import CliRunner

    from moecc.cli import app

    if where == "read_only_dir":
        if os.geteuid() == 0:
            pytest.skip("root writes into a 0o500 directory anyway")
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        errors, reason = ro / "e.jsonl", "Permission denied"
    elif where == "under_a_file":  # no one, root included, can write there
        (tmp_path / "ro").write_text("a file, not a directory\n")
        errors, reason = tmp_path / "ro" / "e.jsonl", "Not a directory"
    else:
        errors, reason = Path("/proc/x/e.jsonl"), "No such file or directory"
    prompts = write_input(tmp_path / "in.jsonl", [req("a", "a wheel")])
    out = tmp_path / "out.jsonl"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        res = CliRunner().invoke(app, ["exec", str(plans["a"]), str(prompts), "-o", str(out), "--errors",
                                       str(errors), "--device", "cpu"])
        assert res.exit_code == 1, res.output
        assert res.stderr.startswith(f"error: cannot write the errors file {errors}: {reason}"), res.stderr
        assert "give --errors a path" in res.stderr and "Traceback" not in res.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in.jsonl"] + (["ro"] if where != "proc" else []))
        out.write_text('{"custom_id": "x"}\n')  # an existing output is left as it is, even with --overwrite
        res = CliRunner().invoke(app, ["exec", str(plans["a"]), str(prompts), "-o", str(out), "--errors",
                                       str(errors), "--overwrite", "--device", "cpu"])
        assert res.exit_code == 1 and "cannot write the errors file" in res.stderr
        assert out.read_text() == '{"custom_id": "x"}\n' and not (tmp_path / "out.jsonl.lock").exists()
    finally:
        if where == "read_only_dir":
            (tmp_path / "ro").chmod(0o700)  # so pytest can clean up


@pytest.mark.parametrize("field", ["decode.B", "prefill.b_e", "schedule"])
def test_a_plan_no_job_can_run_on_fails_with_a_message(plans, tmp_path, field):
    """Values the schema's types admit but nothing can run: B = 0 hung the scheduler, a
    schedule without its head failed an assertion; both are refused naming the field."""
    plan = load_plan(plans["a"])
    if field == "schedule":
        plan["schedule"] = [m for m in plan["schedule"] if m["kind"] != "head"]
        want = "plan.schedule has no head module"
    else:
        phase, key = field.split(".")
        plan["batch"][phase][key] = 0
        want = f"plan.batch.{field} is 0, it must be at least 1"
    save_plan(plan, tmp_path / "broken.pt")
    prompts = write_input(tmp_path / "in.jsonl", [req("a", "a wheel")])
    with pytest.raises(PlanError, match=f"^{tmp_path / 'broken.pt'}: {want}.*recompile it"):
        run_job(tmp_path / "broken.pt", prompts, tmp_path / "out.jsonl", device="cpu", log=None)
    assert not (tmp_path / "out.jsonl").exists()
