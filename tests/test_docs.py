"""The docs quote the CLI as it is: every ``rafl`` command line in README.md and docs/*.md names
commands and options that exist, and every option table of a command's page lists options of that
command. (The CLI reference itself is generated from the click commands when the site is built.)"""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from rafl.cli import cli

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```$", flags=re.M | re.S)
STOP = {"#", "|", ";", "&&", "||", ">", ")"}


def _command_lines(text: str) -> list[str]:
    """The text after ``rafl `` of every command line: fenced and indented code lines (backslash
    continuations joined) and inline code spans."""
    code = [m.group(1) for m in FENCE.finditer(text)]
    prose = FENCE.sub("", text)
    code += [line[4:] for line in prose.splitlines() if line.startswith("    ") and not line.lstrip().startswith("-")]
    found = []
    for block in code:
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*", "", line)  # a shell comment
            found += re.findall(r"(?:^|\s|\$ )rafl ([^\n]+)", line)
    for span in re.findall(r"`([^`]+)`", re.sub(r"`{3,}", "", prose)):
        found += re.findall(r"(?:^|\s)rafl ((?:[a-z][a-z-]*|--)[^`]*)$", span.replace("\n", " "))
    return found


def _resolve(words: list[str]) -> tuple[click.Command, str, list[str]]:
    """The click command ``words`` name, its path and the words after it."""
    ctx = click.Context(cli, info_name="rafl")
    command, path = cli, "rafl"
    while isinstance(command, click.Group) and words and re.fullmatch(r"[a-z][a-z-]*", words[0]):
        sub = command.get_command(ctx, words[0])
        assert sub is not None, f"`{path} {words[0]}`: no such command (commands: {command.list_commands(ctx)})"
        command, path, words = sub, f"{path} {words[0]}", words[1:]
    return command, path, words


def _options(command: click.Command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *getattr(p, "secondary_opts", ()))} | {"--help"}


def _passed_on(path: str) -> set[str]:
    """The options of the program a rafl command passes its other arguments to: `rafl
    flower-supernode` runs Flower's `flower-supernode` (its own argparse parser)."""
    if path != "rafl flower-supernode":
        return set()
    import importlib

    parser = importlib.import_module("flwr.supernode.cli.flower_supernode")._parse_args_run_supernode()
    return set(parser._option_string_actions)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_quoted_command_line_names_existing_commands_and_options(page):
    lines = _command_lines(page.read_text())
    for line in lines:
        words = []
        for word in line.split():
            if word in STOP or word.startswith("#"):
                break
            words.append(word.strip("[]"))
        command, path, rest = _resolve(words)
        for word in rest:
            if word.startswith("--"):
                flag = word.split("=", 1)[0]
                assert flag in _options(command) | _passed_on(path), \
                    f"{page.name}: `{path} {flag}` in `rafl {line.strip()}`: no such option"


TABLED = {"data.md": "data", "supernet.md": "supernet train", "profiles.md": "profile", "search.md": "search",
          "federate.md": "compare"}


@pytest.mark.parametrize("name", sorted(TABLED))
def test_the_option_tables_list_options_of_their_command(name):
    """An option table (first header cell ``option``) lists options of the command the nearest
    heading above it names; and each of these pages has one."""
    tables = 0
    heading_command = None
    in_table = False
    for line in (REPO / "docs" / name).read_text().splitlines():
        if line.startswith("#"):
            m = re.search(r"`rafl ([a-z -]+)`", line)
            heading_command = m.group(1) if m else heading_command
        if re.match(r"^\| option \|", line):
            in_table, tables = True, tables + 1
            command, path, _ = _resolve(heading_command.split())
            assert path == f"rafl {TABLED[name]}"
            continue
        if in_table and line.startswith("|"):
            first = line.split("|")[1]
            for flag in re.findall(r"--[a-z][a-z0-9-]*", first):
                assert flag in _options(command), f"{name}: `{path} {flag}` in the option table: no such option"
        else:
            in_table = False
    assert tables >= 1


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "design.md"], ids=lambda p: p.name)
def test_every_quoted_python_name_exists(page):
    """A ``rafl.module.name`` the page quotes imports (design.md describes the target layout, so it
    may name floors still being built)."""
    import importlib

    for name in sorted(set(re.findall(r"`(rafl(?:\.[A-Za-z_]\w*)+)", page.read_text()))):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ModuleNotFoundError:
                continue
            break
        for attr in parts[i:]:
            assert hasattr(obj, attr), f"{page.name}: `{name}`: {'.'.join(parts[:i])} has no {attr}"
            obj = getattr(obj, attr)
