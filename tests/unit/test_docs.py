"""The documentation: the site builds strictly, and the README stays a front door whose
every command a test runs (tests/readme.py reads them; tests/integration/test_readme.py
runs the blocks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli.main import cli
from tests import readme

ROOT = readme.ROOT
MAX_README_LINES = 250


def nav_pages(nav: object) -> list[str]:
    """Every page file of mkdocs.yml's nav, nested sections included."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for entry in nav for p in nav_pages(entry)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in nav_pages(value)]
    return []


def test_the_site_builds_strictly_with_every_page_in_its_nav(tmp_path: Path) -> None:
    """`mkdocs build --strict` fails on a broken link or anchor, and on a docs/ page
    left out of the nav (mkdocs.yml's validation turns each into a warning)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = nav_pages(config["nav"])
    assert len(pages) == len(set(pages))
    for page in pages:
        assert (ROOT / "docs" / page).is_file(), page
    on_disk = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == set(pages)
    # Nothing fetched at build time: no plugin but the local search.
    assert config["plugins"] == ["search"]
    assert config["theme"].get("font") is False

    site = tmp_path / "site"
    # Not -q: a quiet build hides its warnings from --strict too, and passes.
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=120,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    for page in pages:
        html = "index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html"
        assert (site / html).is_file(), html


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The strict build does catch a link to a missing anchor (so the test above could fail)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[there](other.md#nowhere)\n")
    (docs / "other.md").write_text("# Other\n")
    config = (ROOT / "mkdocs.yml").read_text()
    config = re.sub(r"(?ms)^nav:.*", "nav:\n  - index.md\n  - other.md\n", config)
    (tmp_path / "mkdocs.yml").write_text(config)
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "s")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=120,
    )
    assert built.returncode != 0
    assert "nowhere" in built.stdout + built.stderr


def test_the_readme_is_a_front_door() -> None:
    text = readme.README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    # Its links into docs/ reach pages that exist (the site's own links are checked above).
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links
    for link in links:
        assert (ROOT / link).exists(), link


def test_the_security_pages_name_only_settings_that_exist() -> None:
    """What an operator sets, as the README's security section and docs/security.md name
    it: each ``BATCHGEN_*`` variable is one the settings object reads (a renamed or
    invented setting would be a claim no deployment can follow)."""
    from tests.unit.test_compose import settings_variables

    known = settings_variables()
    for page in (readme.README, ROOT / "docs" / "security.md"):
        named = set(re.findall(r"\bBATCHGEN_[A-Z0-9_]+", page.read_text()))
        assert named, page
        assert named <= known, (page.name, sorted(named - known))


def test_the_readme_test_command_is_what_ci_runs() -> None:
    lines = [c.line for c in readme.sh_commands("The two commands")]
    assert readme.ci_test_command() in lines
    assert readme.ci_test_command().endswith("&& .venv/bin/pytest")


def test_every_readme_command_block_is_run_by_a_test() -> None:
    """A new `sh` block outside the sections tests/integration/test_readme.py runs fails
    here; a new command inside one fails there, unless that test knows how to run it."""
    sections = {b.section for b in readme.blocks() if b.lang == "sh"}
    assert sections == set(readme.SECTIONS), sections ^ set(readme.SECTIONS)
    runner = (ROOT / "tests" / "integration" / "test_readme.py").read_text()
    for test_name in readme.SECTIONS.values():
        assert f"\ndef {test_name}(" in runner, test_name
    programs = {Path(c.argv[0]).name for c in readme.sh_commands()}
    assert programs <= {"python3", "pip", "uv", "pytest", "batchgen"}, programs


@pytest.mark.parametrize("argv", readme.inline_commands(), ids=" ".join)
def test_the_readme_inline_commands_exist(argv: list[str]) -> None:
    """A command named in the README's prose exists with the options it is given
    (`--help` after them: an unknown command or option is still a usage error)."""
    result = CliRunner().invoke(cli, [*argv[1:], "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("end", ["completed", "failed", "expired", "cancelled"])
def test_the_readme_polling_loop_stops_at_every_end_of_a_batch(end: str) -> None:
    """The quick start's program polls until the batch ends, however it ends (a loop
    on ``!= "completed"`` would spin forever on a cancelled one): its loop, run on
    a batch that reads as ``end`` on the third poll."""
    statuses = iter(["validating", "in_progress", end])
    batches = SimpleNamespace(
        retrieve=lambda batch_id: SimpleNamespace(id=batch_id, status=next(statuses))
    )
    scope = {
        "client": SimpleNamespace(batches=batches),
        "batch": SimpleNamespace(id="batch_1"),
        "time": SimpleNamespace(sleep=lambda seconds: None),
    }
    exec(readme.polling_loop(readme.quick_start_program()), scope)
    assert scope["batch"].status == end


def test_the_readme_prose_names_no_command_a_test_does_not_run() -> None:
    assert readme.untested_inline_commands() == []
    assert readme.untested_inline_commands("run `docker compose up` or `X=1 batchgen beat`") == [
        "docker compose up",
        "X=1 batchgen beat",
    ]


def test_the_inline_commands_are_found() -> None:
    assert ["batchgen", "worker", "--group", "openai"] in readme.inline_commands(
        "run `batchgen\nworker --group openai`, not `--group x`\n```sh\nbatchgen beat\n```\n"
    )
    assert readme.inline_commands("```sh\nbatchgen beat\n```\n") == []


def _features_table() -> list[str]:
    """The rows of docs/index.md's "Features by layer" table."""
    text = (ROOT / "docs" / "index.md").read_text()
    section = text.split("## Features by layer", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "`" in line]


def test_every_path_of_the_features_table_exists() -> None:
    """docs/index.md's table of features by layer names real files and folders, so it
    cannot drift from the tree as modules move."""
    rows = _features_table()
    paths = [p for row in rows for p in re.findall(r"`([^`]+)`", row)]
    assert len(rows) >= 10 and len(paths) >= 60
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"docs/index.md names paths that do not exist: {missing}"


def test_the_documented_view_lays_the_folders_out_as_the_package(tmp_path: Path) -> None:
    """docs/index.md's command makes a view in which every module sits where its
    import name says: batchgen/worker/calls.py, batchgen/tasks/generate.py,
    batchgen/migrations/versions/."""
    text = (ROOT / "docs" / "index.md").read_text()
    section = text.split("## Reading the code with tools", 1)[1]
    command = section.split("```bash\n", 1)[1].split("```", 1)[0]
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    view = Path(done.stdout.strip()) / "batchgen"
    assert view.is_relative_to(tmp_path)
    modules = {p.relative_to(ROOT / "app").as_posix() for p in (ROOT / "app").rglob("*.py")}
    for module in modules:
        if "__pycache__" not in module:
            assert (view / module).resolve() == (ROOT / "app" / module).resolve(), module
    assert (view / "tasks" / "generate.py").resolve() == (ROOT / "tasks" / "generate.py")
    assert (view / "migrations" / "versions").is_dir()
    mypy_view = ROOT / ".mypy" / "pkg" / "batchgen"
    assert mypy_view.resolve() == (ROOT / "app").resolve()
    assert (ROOT / ".mypy" / "tasks" / "batchgen" / "tasks").resolve() == (ROOT / "tasks")
