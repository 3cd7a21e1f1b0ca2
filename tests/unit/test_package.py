"""The distribution's metadata as a host project meets it: version, type marker, licence.

tests/integration/test_host_project.py checks the same on a built wheel, installed."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from typer.testing import CliRunner

import batchgen
from batchgen.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_is_the_distributions():
    assert batchgen.__version__ == importlib.metadata.version("batchgen")
    assert batchgen.__version__ == PROJECT["project"]["version"]


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
