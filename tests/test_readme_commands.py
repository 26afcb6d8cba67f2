"""Every `eagle-fsd ...` and `python -m eagle_fsd...` command in the shell blocks of README.md and docs/*.md parses
with the real argparse parser of its command. Nothing runs: no model loads, no network.

A command module's own `parse_args(argv)` (`eagle_fsd.cli.parse_run_args` for `run`) parses the flags and builds the
job from them (settings, FSD arm specs) without loading anything; a module without one has its `main` called with
`ArgumentParser.parse_args` stopped right after parsing. A bad flag or value ends in SystemExit: the test fails.
"""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from eagle_fsd import cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(?:bash|sh|shell|console)[ \t]*\n(.*?)^```", re.M | re.S)
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = {"&&", "||", ";", "|", "&"}


def shell_lines(text: str):
    """(line number, command line) of each fenced shell block, backslash continuations joined; in a block with
    `$ ` prompts only the prompted lines (the rest is output)."""
    for block in BLOCK.finditer(text):
        lines = block.group(1).splitlines()
        prompted = any(line.startswith("$ ") for line in lines)
        joined, start = "", 0
        for number, line in enumerate(lines, text.count("\n", 0, block.start(1)) + 1):
            if not joined:
                if prompted and not line.startswith("$ "):
                    continue
                line, start = line[2:] if prompted else line, number
            if line.endswith("\\"):
                joined += line[:-1] + " "
                continue
            yield start, joined + line
            joined = ""


def commands(line: str):
    """(module, argv) of each eagle-fsd command of a shell line; comments, env assignments and pipes dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words, part = list(lexer), []
    except ValueError:  # e.g. a quote left open: keep shell blocks to one command a line
        yield "?unreadable line: " + line, []
        return
    for word in [*words, ";"]:
        if word not in SEPARATORS:
            part.append(word)
            continue
        while part and ENV.match(part[0]):
            part.pop(0)
        if part[:1] == ["eagle-fsd"]:
            sub = part[1] if len(part) > 1 else ""
            yield cli.COMMANDS.get(sub, ("?no such command: eagle-fsd " + sub,))[0], part[2:]
        elif len(part) > 2 and part[0].split("/")[-1].startswith("python") and part[1] == "-m" \
                and part[2].startswith("eagle_fsd"):
            yield part[2], part[3:]
        part = []


def documented():
    found = []
    for page in PAGES:
        for number, line in shell_lines(page.read_text()):
            found += [pytest.param(module, argv, id=f"{page.name}:{number}") for module, argv in commands(line)]
    return found


COMMANDS = documented()


class Parsed(Exception):
    """Raised by the stopped parse_args: the flags parsed."""


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 20, [p.id for p in COMMANDS]


@pytest.mark.parametrize("module, argv", COMMANDS)
def test_command_parses(module, argv, monkeypatch):
    assert not module.startswith("?"), module[1:]
    name, _, func = module.partition(":")
    if name == "eagle_fsd.cli":  # eagle-fsd run
        parse = cli.parse_run_args
    else:
        mod = importlib.import_module(name)
        parse = None if func else getattr(mod, "parse_args", None)
    if parse is not None:
        parse(argv)  # SystemExit on a bad flag or value
        return
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(Parsed):  # `eagle-fsd models` turns a bad flag into a return code: no Parsed either
        getattr(mod, func or "main")(argv)
