"""The docs say what the repository holds: every repository path README.md and docs/*.md write
exists, every `moecc SUB --option` they write is an option of that subcommand, docs/cli.md lists
every option of every subcommand, and README's test command is the one `.ci/run` runs.

Reads only text and the typer app (no compile, no model): well under a second."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest
import typer.main

from moecc.cli import app

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
DOCS = sorted((REPO_ROOT / "docs").glob("*.md"))
DOC_FILES = [README, *DOCS]

# A repository path: starts at a top-level folder of the repository.
_PATH = re.compile(r"(?<![\w./-])((?:moecc|runtime|bench|examples|tests|docs|\.ci)/[\w./-]*)")
# Written by runs, not shipped (.gitignore): examples/out/, bench/out/.
_OUTPUT_DIRS = ("examples/out/", "bench/out/")
_OPTION = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_CLI_HEADING = re.compile(r"^## `moecc (\w+)")


@cache
def _options_by_command() -> dict[str, set[str]]:
    """Each subcommand's option strings (`-o`, `--output`, `--no-calibrate`, `--help`)."""
    group = typer.main.get_command(app)
    out: dict[str, set[str]] = {}
    for name, cmd in group.commands.items():  # type: ignore[attr-defined]
        opts = {"--help"}
        for p in cmd.params:
            opts.update(o for o in [*p.opts, *p.secondary_opts] if o.startswith("-"))
        out[name] = opts
    return out


def _repo_paths(text: str) -> set[str]:
    """Repository paths written in `text`, placeholders (`<plan>`, `NNN_`, `*`) and run outputs left out."""
    found = set()
    for m in _PATH.finditer(text):
        path = m.group(1).rstrip(".,;:)")
        tail = text[m.end():m.end() + 1]
        if tail in "<{*" and tail != "" or "NNN" in path or path.startswith(_OUTPUT_DIRS):
            continue
        found.add(path)
    return found


# A file named without its top-level folder (`worker/batch.py`, `kernels.py`), in a code span.
_PARTIAL = re.compile(r"`((?:[\w-]+/)*[\w-]+\.(?:py|c|h|sh))`")
_SOURCE_DIRS = ("moecc", "runtime", "bench", "examples", "tests")


def _partial_paths(text: str) -> set[str]:
    """Files written without a top-level folder: `worker/batch.py`, `awq.py`."""
    return {p for p in _PARTIAL.findall(text) if not _PATH.fullmatch(p)}


@cache
def _source_files() -> tuple[str, ...]:
    """Every source file under the top-level source folders, as `/`-prefixed repository paths."""
    return tuple("/" + str(f.relative_to(REPO_ROOT)) for d in _SOURCE_DIRS for f in (REPO_ROOT / d).rglob("*")
                 if f.suffix in (".py", ".c", ".h", ".sh"))


def _doc_id(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


@pytest.mark.parametrize("doc", [pytest.param(p, id=_doc_id(p)) for p in DOC_FILES])
def test_every_repository_path_exists(doc: Path) -> None:
    """(a) Every `moecc/...`, `runtime/...`, `bench/...`, `examples/...`, `tests/...`, `docs/...` path exists,
    and every file written without its folder (`worker/batch.py`) is some source file's tail."""
    text = doc.read_text()
    missing = sorted(p for p in _repo_paths(text) if not (REPO_ROOT / p).exists())
    files = _source_files()
    missing += sorted(p for p in _partial_paths(text) if not (REPO_ROOT / p).exists()
                and not any(f.endswith("/" + p) for f in files))
    assert not missing, f"{_doc_id(doc)} names paths that do not exist: {missing}; fix the doc or the path"


def _command_lines(text: str) -> list[str]:
    """Every `moecc SUB ...` command written in code spans and code blocks, one per shell command."""
    chunks = _CODE_SPAN.findall(text)
    chunks += [line for block in re.findall(r"```\w*\n(.*?)```", text, re.S) for line in block.splitlines()]
    commands = []
    for chunk in chunks:
        for part in re.split(r"&&|\|\||[|;]", chunk.split("#")[0]):
            part = part.strip()
            if part.startswith("moecc "):
                commands.append(part)
    return commands


@pytest.mark.parametrize("doc", [pytest.param(p, id=_doc_id(p)) for p in DOC_FILES])
def test_every_written_command_option_exists(doc: Path) -> None:
    """(b) Each `moecc SUB ... --option` written in a doc is an option of SUB."""
    options = _options_by_command()
    wrong = []
    for command in _command_lines(doc.read_text()):
        sub = command.split()[1]
        if sub == "--help" or sub.isupper():  # `moecc --help`, `moecc SUB --help`
            continue
        if sub not in options:
            wrong.append(f"{command!r}: no subcommand {sub!r}")
            continue
        wrong += [f"{command!r}: {o}" for o in _OPTION.findall(command) if o not in options[sub]]
    assert not wrong, f"{_doc_id(doc)} writes options the CLI does not have: {wrong}"


def _cli_md_tables() -> dict[str, set[str]]:
    """docs/cli.md: per `## \\`moecc SUB\\`` section, the options named in its table's first column."""
    tables: dict[str, set[str]] = {}
    current = None
    for line in (REPO_ROOT / "docs" / "cli.md").read_text().splitlines():
        heading = _CLI_HEADING.match(line)
        if heading:
            current = heading.group(1)
            tables[current] = set()
        elif line.startswith("## "):
            current = None
        elif current and line.startswith("|") and not line.startswith("|---"):
            first_cell = line.split("|")[1]
            tables[current].update(_OPTION.findall(first_cell))
    return tables


def test_cli_md_lists_exactly_the_cli_options() -> None:
    """(b) docs/cli.md has a section per subcommand whose table names every option, and no other."""
    options = _options_by_command()
    tables = _cli_md_tables()
    assert set(tables) == set(options), f"docs/cli.md sections {sorted(tables)} != subcommands {sorted(options)}"
    for sub, opts in options.items():
        unknown = tables[sub] - opts
        missing = opts - {"--help"} - tables[sub]
        assert not unknown, f"docs/cli.md `moecc {sub}` lists options the CLI lacks: {sorted(unknown)}"
        assert not missing, f"docs/cli.md `moecc {sub}` misses options (add a row): {sorted(missing)}"


def test_readme_test_command_is_the_one_ci_runs() -> None:
    """(c) README's install-and-test line is byte-identical to the one `.ci/run` runs."""
    ci_lines = [line for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
                if line.startswith("python -m pip install") and "pytest" in line]
    assert len(ci_lines) == 1, f".ci/run: expected one install-and-test line, found {ci_lines}"
    assert ci_lines[0] in README.read_text().splitlines(), (
        f"README.md lacks .ci/run's test command as a line of its own: {ci_lines[0]!r}")
