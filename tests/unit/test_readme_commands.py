"""The front door's commands work as written (issue 41, "a newcomer's path"): every
``backfill`` command line in README.md's shell blocks names a command the CLI has and only
options that command takes, every script and package path it names exists, and its Python
block parses. The walk itself (a fresh clone, the tour followed literally) is in
bench/RESULTS.md under "The house"; this pins down what a unit test can."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import typer.main

from backfill.summarize.folder import read_folder
from backfill_cli.app import app

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# A `backfill` invocation at the start of a command or inside `$(...)`.
INVOCATION = re.compile(r"(?:^|\$\(|[;&|]\s*)(backfill\s[^)#;&|]*)")


def _blocks(language: str) -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [body for lang, body in FENCE.findall(text) if lang == language]


def _command_lines() -> list[str]:
    """The shell blocks' commands, continuation lines joined and comments cut."""
    lines = []
    for block in _blocks(""):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            code = line.split("  #", 1)[0].strip()
            if code:
                lines.append(code)
    return lines


def _problems(invocation: str) -> list[str]:
    """What in one ``backfill ...`` invocation the CLI does not have."""
    words = shlex.split(invocation)[1:]
    command = typer.main.get_command(app)
    # A group's subcommands by name (typer vendors click: duck-typed, not isinstance).
    while (commands := getattr(command, "commands", None)) is not None:
        if not words or words[0].startswith("-"):
            return [f"{invocation!r}: names a group, not a command"]
        if words[0] not in commands:
            return [f"{invocation!r}: no command {words[0]!r}"]
        command, words = commands[words[0]], words[1:]
    options = {name for p in command.params for name in [*p.opts, *p.secondary_opts]}
    return [
        f"{invocation!r}: {command.name} has no option {word.split('=')[0]!r}"
        for word in words
        if word.startswith("-") and word.split("=")[0] not in options
    ]


def test_every_backfill_command_in_the_readme_exists_with_its_options() -> None:
    invocations = [m for line in _command_lines() for m in INVOCATION.findall(line)]
    assert len(invocations) >= 10  # the tour's: found, not silently skipped
    assert [p for invocation in invocations for p in _problems(invocation)] == []


def test_the_readme_names_only_scripts_and_packages_the_checkout_has() -> None:
    missing = []
    for line in _command_lines():
        for path in re.findall(r"(?:bash |pip install )(\./?[\w/.-]+|scripts/[\w.-]+)", line):
            if not (ROOT / path).exists():
                missing.append(f"{line!r}: {path}")
    assert missing == []


def _prose() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return FENCE.sub("", text)


def test_the_tour_reads_only_files_the_newcomer_has_or_is_told_how_to_write() -> None:
    """A file the tour submits is in the checkout or introduced in its prose (what it holds),
    never a name the newcomer has no way to make (the tour's `docs.parquet` was one)."""
    inputs = [
        shlex.split(invocation)[2]
        for line in _command_lines()
        for invocation in INVOCATION.findall(line)
        if shlex.split(invocation)[1] in ("submit", "summarize")
    ]
    inputs += [m for block in _blocks("python") for m in re.findall(r'open\("([^"]+)"', block)]
    assert inputs
    prose = _prose()
    unknown = [name for name in inputs if not (ROOT / name).exists() and f"`{name}`" not in prose]
    assert unknown == []


def test_a_folder_the_tour_summarises_holds_the_demo_documents_and_nothing_else() -> None:
    """`backfill summarize devkit/demo_docs` sends every file of the folder as a document:
    the folder holds the demo's documents only (its README.md was summarised as a 27th)."""
    folders = [
        ROOT / shlex.split(invocation)[2]
        for line in _command_lines()
        for invocation in INVOCATION.findall(line)
        if shlex.split(invocation)[1] == "summarize"
        and (ROOT / shlex.split(invocation)[2]).is_dir()
    ]
    assert folders
    for folder in folders:
        sent = sorted(row.id or "" for row in read_folder(folder))
        assert sent == sorted(path.name for path in folder.glob("*.txt"))


def test_the_readme_python_parses() -> None:
    blocks = _blocks("python")
    assert blocks
    for block in blocks:
        ast.parse(block)


def test_a_misspelt_option_is_caught() -> None:
    """The check itself: a wrong option or command is reported, not passed over."""
    assert _problems("backfill status $BATCH --wacth") != []
    assert _problems("backfill statuz $BATCH") != []
    assert _problems("backfill status $BATCH --watch") == []
