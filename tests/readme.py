"""The README's commands, as the tests read them.

Every fenced ``sh`` block of README.md belongs to a section (its ``##`` heading), and
every section with such a block is run by one test, named in :data:`SECTIONS`
(tests/unit/test_docs.py checks that no block is left out, and that the test exists).
A block's commands are its lines, comments stripped, split at ``&&``; a trailing
``&`` marks a process the reader leaves running. Inline commands are the code spans
of prose that start with ``batchgen`` (run with ``--help``, which checks the command
and its options).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"

# README section -> the test (in tests/integration/test_readme.py) that runs its blocks.
SECTIONS = {
    "The two commands": "test_the_two_commands",
    "Quick start: the SDK you already have": "test_quick_start",
    "In production: the processes": "test_production_processes",
    "Real providers": "test_real_providers",
}

_FENCE = re.compile(r"^```(\w*)\s*$")
_INLINE = re.compile(r"`((?:\.venv/bin/)?batchgen(?:\s[^`]*)?)`")


@dataclass(frozen=True)
class Command:
    """One command of a block: environment assignments, then the program's argv."""

    section: str
    line: str  # the README line it came from, comment stripped
    env: dict[str, str]
    argv: list[str]
    background: bool


@dataclass(frozen=True)
class Block:
    section: str
    lang: str
    text: str


def blocks(text: str | None = None) -> list[Block]:
    """The README's fenced blocks, each with the ``##`` section it sits in."""
    text = README.read_text() if text is None else text
    found: list[Block] = []
    section, lang, lines, inside = "", "", [], False
    for line in text.splitlines():
        fence = _FENCE.match(line)
        if fence and not inside:
            inside, lang, lines = True, fence.group(1), []
        elif line.startswith("```") and inside:
            inside = False
            found.append(Block(section, lang, "\n".join(lines) + "\n"))
        elif inside:
            lines.append(line)
        elif line.startswith("## "):
            section = line[3:].strip()
    return found


def commands(block: Block) -> list[Command]:
    """The commands of an ``sh`` block, in order."""
    found: list[Command] = []
    for raw in block.text.replace("\\\n", " ").splitlines():
        tokens = shlex.split(raw, comments=True)
        line = raw.split(" #", 1)[0].strip() if "#" in raw else raw.strip()
        while tokens:
            cut = tokens.index("&&") if "&&" in tokens else len(tokens)
            part, tokens = tokens[:cut], tokens[cut + 1 :]
            background = bool(part) and part[-1] == "&"
            part = part[:-1] if background else part
            env: dict[str, str] = {}
            while part and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", part[0]):
                key, _, value = part.pop(0).partition("=")
                env[key] = value
            if part:
                found.append(Command(block.section, line, env, part, background))
    return found


def sh_commands(section: str | None = None) -> list[Command]:
    """Every command of the README's ``sh`` blocks (of one section)."""
    return [
        c
        for b in blocks()
        if b.lang == "sh" and (section is None or b.section == section)
        for c in commands(b)
    ]


def inline_commands(text: str | None = None) -> list[list[str]]:
    """The ``batchgen …`` code spans of the README's prose, as argv lists."""
    text = README.read_text() if text is None else text
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    found = []
    for span in _INLINE.findall(prose):
        argv = shlex.split(span)
        if argv[0].endswith("batchgen"):
            found.append(argv)
    return found


# Programs a reader could run from a code span of the README's prose. Only `batchgen`
# spans are run (with --help); a span starting with one of these has no test.
OTHER_PROGRAMS = frozenset(
    [
        "python",
        "python3",
        "pip",
        "pytest",
        "gunicorn",
        "celery",
        "docker",
        "podman",
        "mkdocs",
        "curl",
        "psql",
        "redis-cli",
        "export",
        "sh",
        "bash",
    ]
)


def untested_inline_commands(text: str | None = None) -> list[str]:
    """Code spans of the README's prose that start with a program other than batchgen."""
    text = README.read_text() if text is None else text
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    spans = re.findall(r"`([^`]+)`", prose)
    return [s for s in spans if Path(s.split()[0]).name in OTHER_PROGRAMS or "=" in s.split()[0]]


def quick_start_program() -> str:
    """The Python program of the quick start (its openai-SDK code)."""
    section = "Quick start: the SDK you already have"
    (program,) = [b.text for b in blocks() if b.section == section and b.lang == "python"]
    return program


def polling_loop(program: str) -> str:
    """A program's ``while`` loop as code to run, after the constants it may read (the
    capitalised assignments above it)."""
    lines = program.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("while "))
    end = start + 1
    while end < len(lines) and lines[end].startswith(" "):
        end += 1
    constants = [line for line in lines[:start] if re.match(r"[A-Z][A-Z0-9_]* = ", line)]
    return "\n".join([*constants, *lines[start:end]]) + "\n"


def ci_test_command() -> str:
    """The command .ci/run runs (its last line)."""
    return CI_RUN.read_text().strip().splitlines()[-1].strip()
