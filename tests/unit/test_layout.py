"""The installed layout: app/, tasks/ and migrations/ install as batchgen,
batchgen.tasks and batchgen.migrations (pyproject.toml), nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Imports every module of batchgen (Django's need a configured project and Alembic's
# env a migration context), then lists modules loaded under an on-disk name.
WALK = """
import importlib, pkgutil, sys
import batchgen
for info in pkgutil.walk_packages(batchgen.__path__, "batchgen."):
    if info.name.startswith(("batchgen.integrations.django", "batchgen.migrations")):
        continue
    importlib.import_module(info.name)
import batchgen.tasks.celery_app, batchgen.tasks.dispatch, batchgen.tasks.generate
import batchgen.tasks.nightly, batchgen.tasks.sweep, batchgen.migrations
old = ("app", "tasks", "celeryconfig", "migrations")
print(sorted(m for m in sys.modules if m in old or m.startswith(tuple(o + "." for o in old))))
"""


def test_no_host_names_loaded():
    """Run from the repo root (on sys.path, as under pytest), importing all of
    batchgen loads no module as ``app``, ``tasks``, ``celeryconfig`` or ``migrations``."""
    # batchgen.celeryconfig needs a broker URL to import; nothing connects to it.
    env = {"REDIS_URL": "redis://127.0.0.1:1/0", **os.environ}
    done = subprocess.run(
        [sys.executable, "-c", WALK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_every_package_is_listed():
    """Every folder holding Python code maps to a listed package: with a renaming
    package-dir, setuptools installs only what ``packages`` names."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    # Longest folder first, so tasks/ maps to batchgen.tasks and not below batchgen.
    folders = sorted(setuptools["package-dir"].items(), key=lambda kv: -len(kv[1]))
    expected = set()
    for top in ("app", "tasks", "migrations"):
        for init in (ROOT / top).rglob("*.py"):
            folder = init.parent.relative_to(ROOT).as_posix()
            if "__pycache__" in folder:
                continue
            for package, where in folders:
                if folder == where or folder.startswith(where + "/"):
                    rest = folder[len(where) :].strip("/").replace("/", ".")
                    expected.add(f"{package}.{rest}" if rest else package)
                    break
    assert expected - listed == set(), "folders with code missing from [tool.setuptools] packages"
    assert listed - expected == set(), "listed packages without a folder"
    assert "py-modules" not in setuptools, "celeryconfig.py at the root is not installed"
