"""The command line's errors under ``--json``: each one is a JSON document on stdout,
click's own usage errors (exit 2) too, beside the usual message on stderr."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from batchgen.cli.main import cli

USAGE_ERRORS = [
    (["submit", "--json"], "Missing argument"),  # no file, no --tenant
    (["usage", "--from", "2026-13-01", "--json"], "2026-13-01"),  # a bad option value
    (["submit", "requests.jsonl", "--tenant", "a", "--bogus", "--json"], "--bogus"),
    (["tenants", "create", "--json"], "Missing argument"),  # a nested group's command
]


@pytest.mark.parametrize(("argv", "named"), USAGE_ERRORS, ids=lambda a: " ".join(a))
def test_a_usage_error_under_json_is_a_json_document(argv: list[str], named: str) -> None:
    result = CliRunner().invoke(cli, argv, env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    document = json.loads(result.stdout)
    assert document["error"]["code"] == "usage"
    assert named in document["error"]["message"]
    assert named in result.stderr  # the usual message too, for a reader


def test_without_json_a_usage_error_prints_nothing_on_stdout() -> None:
    result = CliRunner().invoke(cli, ["submit"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and result.stdout == ""
    assert "Missing argument" in result.stderr


def test_an_error_of_a_command_under_json_is_a_json_document(tmp_path) -> None:
    """A usage error a command finds itself (a bad parameter) is a document too."""
    result = CliRunner().invoke(
        cli, ["results", "batch_x", "--tenant", "a", "-o", "-", "--json"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 2, result.output
    assert json.loads(result.stdout)["error"]["code"] == "usage"
