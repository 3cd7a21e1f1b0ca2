"""Every third-party module the package imports comes from a dependency it declares.

A module that only the ``dev`` extra installs (httpx once was one) is there in the
development venv, so nothing else notices; a plain ``pip install batchgen-llm`` then dies
at start with ``ModuleNotFoundError``. The imports are read with :mod:`ast` (also the
ones inside functions); the distribution that provides each module comes from
:func:`importlib.metadata.packages_distributions`, and must be named in
``[project].dependencies``, or in the extra that owns that part of the package.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterator
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("app", "tasks")
FIRST_PARTY = {"batchgen"}
# Parts of the package that only run with an extra installed, and the extra; the rest
# of the package must not import what only these extras bring.
EXTRA_PARTS = {
    "app/integrations/django": "django",
    "app/embedded.py": "embedded",
}


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalised (PEP 503)."""
    name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _project() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def declared(extra: str | None = None) -> set[str]:
    """The distributions named by the runtime dependencies (and by ``extra``)."""
    project = _project()
    names = {_name(r) for r in project["dependencies"]}  # type: ignore[attr-defined]
    if extra is not None:
        names |= {_name(r) for r in project["optional-dependencies"][extra]}  # type: ignore[index]
    return names


def third_party_imports(path: Path) -> Iterator[tuple[str, int]]:
    """(top-level module, line) of every absolute import in ``path`` outside the
    standard library and the package itself."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.partition(".")[0]
            if top in sys.stdlib_module_names or top in FIRST_PARTY or top == "__future__":
                continue
            yield top, node.lineno


def _extra_for(relative: str) -> str | None:
    for part, extra in EXTRA_PARTS.items():
        if relative == part or relative.startswith(part + "/"):
            return extra
    return None


def undeclared_imports() -> list[str]:
    providers = packages_distributions()
    problems = []
    for source in SOURCES:
        for path in sorted((ROOT / source).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            allowed = declared(_extra_for(relative))
            for module, line in third_party_imports(path):
                dists = {_name(d) for d in providers.get(module, [])}
                if not dists:
                    problems.append(f"{relative}:{line}: {module} is installed by nothing")
                elif not dists & allowed:
                    problems.append(
                        f"{relative}:{line}: {module} comes from {sorted(dists)}, "
                        "which no runtime dependency names"
                    )
    return problems


def test_every_imported_module_comes_from_a_declared_dependency():
    assert undeclared_imports() == []


def test_the_check_sees_a_dev_only_module(tmp_path, monkeypatch):
    """The check is not vacuous: an import of a dev-only module (pytest) is reported."""
    fake = tmp_path / "app"
    fake.mkdir()
    (fake / "probe.py").write_text("def f():\n    import pytest\n")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "SOURCES", ("app",))
    assert undeclared_imports() == [
        "app/probe.py:2: pytest comes from ['pytest'], which no runtime dependency names"
    ]


@pytest.mark.parametrize("requirement", ["celery[redis]>=5.4", "Celery >= 5", "celery"])
def test_requirement_names(requirement):
    assert _name(requirement) == "celery"
