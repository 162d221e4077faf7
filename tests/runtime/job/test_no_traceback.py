"""No traceback from any command (issue 32, item 4): every path a command writes is checked
before work starts, and every subcommand given an unwritable, a missing or a directory path
(to write or to read) ends in exactly one `error:` line naming the path and the OS's reason,
exit status 1, with nothing left behind. Options that do not apply are refused (item 6)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.demo_jobs import DEMO, demo_plan, write_jsonl
from moecc.cli import app, main

UNWRITABLE = "/proc/sys/moecc-x"  # no file can be created there, not even by root
NOENT = "No such file or directory"


@pytest.fixture(scope="module")
def plan() -> Path:
    return demo_plan()


def one_error(args: list[str], *fragments: str) -> str:
    """Run a command in-process: exit 1, one `error:` line holding every fragment, no traceback."""
    res = CliRunner().invoke(app, args)
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 1, (args, res.output, res.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, res.output)
    assert "Traceback" not in res.output
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def cases(tmp: Path, plan: Path) -> list[tuple[list[str], tuple[str, ...]]]:
    """(arguments, fragments of the one error line) for every subcommand and path kind."""
    prompts = write_jsonl(tmp / "p.jsonl", [{"custom_id": "a", "prompt": "x", "max_tokens": 1}])
    missing, adir = tmp / "gone" / "x", tmp / "adir"
    adir.mkdir(exist_ok=True)
    (tmp / "s.pt.weights.safetensors").mkdir(exist_ok=True)  # where a plan's sidecar would go
    m = str(DEMO)
    return [
        (["compile", m, "-o", UNWRITABLE], (f"cannot write the plan file {UNWRITABLE}: {NOENT}", "give -o")),
        (["compile", m, "-o", str(missing)], (f"cannot write the plan file {missing}", "does not exist")),
        (["compile", m, "-o", str(adir)], (f"cannot write the plan file {adir}: it is a directory",)),
        (["compile", m, "-o", str(tmp / "q.pt"), "--dump-dir", UNWRITABLE], (f"dump directory {UNWRITABLE}", NOENT)),
        (["compile", m, "-o", str(tmp / "q.pt"), "--dump-dir", str(prompts)], ("is not a directory",)),
        (["compile", m, "-o", str(tmp / "q.pt"), "--quantize", "int8", "--dump-dir", str(prompts)],
         ("is not a directory",)),
        (["compile", m, "-o", str(tmp / "s.pt"), "--quantize", "int8"],
         (f"cannot write the quantized weights file {tmp / 's.pt.weights.safetensors'} (beside the plan): it is "
          f"a directory",)),
        (["exec", str(plan), str(prompts), "-o", UNWRITABLE], (f"output file {UNWRITABLE}", NOENT)),
        (["exec", str(plan), str(prompts), "-o", str(missing)], (f"output file {missing}", NOENT)),
        (["exec", str(plan), str(prompts), "-o", str(adir)], (f"output file {adir}", "Is a directory")),
        (["exec", str(plan), str(prompts), "-o", str(tmp / "o.jsonl"), "--errors", UNWRITABLE],
         (f"errors file {UNWRITABLE}", NOENT)),
        (["exec", str(plan), str(prompts), "-o", str(tmp / "o.jsonl"), "--stats", UNWRITABLE],
         (f"stats file {UNWRITABLE}: {NOENT}", "give --stats")),
        (["exec", str(plan), str(prompts), "-o", str(tmp / "o.jsonl"), "--stats", str(missing)],
         (f"stats file {missing}", "does not exist")),
        (["exec", str(plan), str(prompts), "-o", str(tmp / "o.jsonl"), "--stats", str(adir)],
         (f"stats file {adir}: it is a directory",)),
        (["exec", str(plan), str(missing), "-o", str(tmp / "o.jsonl")], (str(missing), NOENT)),
        (["exec", str(plan), str(adir), "-o", str(tmp / "o.jsonl")], (str(adir), "Is a directory")),
        (["exec", str(missing), str(prompts)], (str(missing), "no such plan file")),
        (["exec", str(adir), str(prompts)], (str(adir), "no such plan file")),
        (["explain", str(missing)], (str(missing), "no such plan file")),
        (["explain", str(plan), "--timeline", UNWRITABLE], (f"timeline picture {UNWRITABLE}", NOENT)),
        (["explain", str(plan), "--timeline", str(adir)], (f"timeline picture {adir}: it is a directory",)),
        (["explain", str(plan), "--prompts", str(missing)], (str(missing),)),
        (["perplexity", str(plan), str(missing)], (str(missing), NOENT)),
        (["perplexity", str(plan), str(adir)], (str(adir), "Is a directory")),
        (["profile", "-o", UNWRITABLE], (f"hardware profile {UNWRITABLE}", NOENT)),
        (["profile", "-o", str(missing)], (f"hardware profile {missing}", "does not exist")),
        (["profile", "-o", str(adir)], (f"hardware profile {adir}: it is a directory",)),
    ]


def test_every_subcommand_fails_on_bad_paths_with_one_error_line(plan, tmp_path):
    for args, fragments in cases(tmp_path, plan):
        one_error(args, *fragments)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["adir", "p.jsonl", "s.pt.weights.safetensors"], left  # nothing created, not even a lock


def test_compile_to_proc_sys_is_one_line_from_the_entry_point(monkeypatch, capsys):
    """The issue's case through main() (what `moecc` and `python -m moecc.cli` run)."""
    monkeypatch.setattr(sys, "argv", ["moecc", "compile", str(DEMO), "-o", "/proc/sys/plan.pt"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 1
    assert capsys.readouterr().err == ("error: cannot write the plan file /proc/sys/plan.pt: No such file or "
                                       "directory; give -o a path this user can write\n")


def test_an_uncaught_error_is_one_line_too(plan, monkeypatch, capsys, tmp_path):
    import moecc.views.explain as ex

    def boom(*a, **k):
        raise KeyError("planner")

    monkeypatch.setattr(ex, "explain", boom)
    monkeypatch.setattr(sys, "argv", ["moecc", "explain", str(plan)])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    assert capsys.readouterr().err == ("error: internal error, a moecc bug: KeyError: 'planner' (set "
                                       "MOECC_TRACEBACK=1 for the traceback)\n")
    import moecc.compiler as compiler

    def unreadable(*a, **k):
        raise PermissionError(13, "Permission denied", "/ckpt/model.safetensors")

    monkeypatch.setattr(compiler, "compile_model", unreadable)  # an OSError no command catches
    monkeypatch.setattr(sys, "argv", ["moecc", "compile", str(DEMO), "-o", str(tmp_path / "p.pt")])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 1 and capsys.readouterr().err == "error: /ckpt/model.safetensors: Permission denied\n"


@pytest.mark.parametrize(("args", "said"), [
    (["--quantize", "int8", "--quantize-group-size", "64"],
     "error: --quantize-group-size 64 does not apply to --quantize int8 (one scale per output channel, no groups); "
     "drop it, or use --quantize int4"),
    (["--quantize-group-size", "64"],
     "error: --quantize-group-size only applies with --quantize; add --quantize int8|int4 or drop "
     "--quantize-group-size"),
    (["--quantize-scope", "all"],
     "error: --quantize-scope only applies with --quantize; add --quantize int8|int4 or drop --quantize-scope"),
    (["--dump-format", "svg"], "error: --dump-format svg only applies with --dump-dir DIR (where the dumps go)"),
])
def test_options_that_do_not_apply_are_refused(tmp_path, args, said):
    res = CliRunner().invoke(app, ["compile", str(DEMO), "-o", str(tmp_path / "p.pt"), *args])
    assert res.exit_code == 1 and res.output == said + "\n", res.output
    assert list(tmp_path.iterdir()) == []
