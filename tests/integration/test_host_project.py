"""Issue 11: a host project whose own modules are named ``app`` (an ``app.py`` and an
``app/`` package), ``tasks``, ``celeryconfig`` and ``migrations`` uses batchgen beside
them: the Flask extension, the Python API and ``celery -A batchgen.tasks worker``.

The test builds a fresh venv (``python -m venv``) and runs ``pip install --no-deps
--no-build-isolation -e <repo>`` in it. Nothing is downloaded: a ``.pth`` file in the
new venv's site-packages puts this venv's site-packages (the dependencies, and the build
backend) on its ``sys.path`` after its own. The host's processes run the NEW venv's
interpreter with the host folder as their working directory (first on ``sys.path``, as
for ``python app.py`` and ``celery -A``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from batchgen.worker.procs import WorkerProcess
from tests.helpers import make_tenant

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HOST_NAMES = ("app", "app.py", "tasks", "celeryconfig", "migrations")


def _marker(name: str) -> str:
    # Every host module leaves a mark when imported (if HOST_MARKS is set), so a
    # test can tell which of them a process loaded.
    return (
        "import os as _os, pathlib as _pathlib\n"
        "if _os.environ.get('HOST_MARKS'):\n"
        f"    (_pathlib.Path(_os.environ['HOST_MARKS']) / {name!r}).touch()\n"
    )


# The host's own Flask app, in its app/ package, with batchgen mounted on it.
HOST_APP_PACKAGE = """
from flask import Flask

from batchgen.integrations.flask import BatchGen


def create_app():
    flask_app = Flask("host")
    flask_app.config["BATCHGEN_URL_PREFIX"] = "/llm"
    BatchGen(flask_app)

    @flask_app.get("/")
    def home():
        return "the host's own page"

    return flask_app
"""

# The host's app.py: its entry script. It imports its own app, tasks, celeryconfig
# and migrations, answers one request through the extension and submits a batch
# through the Python API.
HOST_APP_SCRIPT = """
import json
import os
import sys

import app
import celeryconfig
import migrations
import tasks
from batchgen import python_api as client

import batchgen
import importlib.metadata

here = os.path.dirname(os.path.abspath(__file__))
for module in (app, tasks, celeryconfig, migrations):
    assert module.__file__.startswith(here), (module.__name__, module.__file__)
# Which venv runs this, and which install of batchgen it imports.
finders = sorted(
    module.__file__ for name, module in sys.modules.items()
    if name.startswith("__editable___batchgen")
)
installed = {
    "prefix": sys.prefix,
    "batchgen": batchgen.__file__,
    "dist": str(importlib.metadata.distribution("batchgen").locate_file("")),
    "finders": finders,
}
assert celeryconfig.broker_url == "memory://" and tasks.HOST

rows = [
    {"custom_id": f"host-{i}", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "sim-small", "max_tokens": 5,
              "messages": [{"role": "user", "content": f"hello {i}"}]}}
    for i in range(3)
]
submitted = client.submit_batch(rows, tenant="host")
web = app.create_app().test_client()
auth = {"Authorization": "Bearer " + os.environ["HOST_KEY"]}
answer = web.get("/llm/v1/batches/" + submitted["id"], headers=auth)
assert web.get("/").text == "the host's own page"
print(json.dumps({"status_code": answer.status_code, "body": answer.json,
                  "stored": client.get_batch(submitted["id"], tenant="host"),
                  "installed": installed}))
"""


def _write_host(host: Path) -> None:
    (host / "app").mkdir(parents=True)
    (host / "app" / "__init__.py").write_text(_marker("app") + HOST_APP_PACKAGE)
    (host / "app.py").write_text(_marker("app.py") + HOST_APP_SCRIPT)
    (host / "tasks.py").write_text(_marker("tasks") + "HOST = True  # Celery's convention\n")
    (host / "celeryconfig.py").write_text(_marker("celeryconfig") + 'broker_url = "memory://"\n')
    (host / "migrations").mkdir()
    (host / "migrations" / "__init__.py").write_text(_marker("migrations"))


_HAS_BDIST_WHEEL = (
    "from setuptools.dist import Distribution; Distribution().get_command_class('bdist_wheel')"
)


def _run(argv: list[str], env: dict[str, str], timeout_s: float = 300) -> str:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, (argv, done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout


def _fresh_venv(venv: Path, repo_root: Path, env: dict[str, str]) -> Path:
    """A new venv with batchgen installed in it by ``pip install -e`` (editable, from
    ``repo_root``) and this venv's packages visible; returns its interpreter."""
    _run([sys.executable, "-m", "venv", str(venv)], env)
    python = venv / "bin" / "python"
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], env
    )
    site_packages = Path(purelib.strip())
    assert site_packages.is_dir() and site_packages.is_relative_to(venv), site_packages
    # Plain paths, appended to sys.path: this venv's .pth files (its own editable
    # install of batchgen among them) are NOT processed in the new one.
    ours = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site_packages / "_batchgen_test_dependencies.pth").write_text("".join(f"{p}\n" for p in ours))
    # --no-build-isolation builds with the new venv's setuptools (the one venv bundles),
    # which takes bdist_wheel from the wheel package: this venv must provide it.
    has_bdist_wheel = subprocess.run(
        [str(python), "-c", _HAS_BDIST_WHEEL], env=env, capture_output=True, text=True
    )
    assert has_bdist_wheel.returncode == 0, (
        "no bdist_wheel for `pip install --no-build-isolation -e` in the new venv: this "
        "venv needs the `wheel` package\n" + has_bdist_wheel.stderr[-2000:]
    )
    pip = venv / "bin" / "pip"
    _run(
        [
            str(pip),
            "install",
            "--no-index",
            "--no-deps",
            "--no-build-isolation",
            "-e",
            str(repo_root),
        ],
        env,
    )
    return python


def test_host_project_with_colliding_names_uses_batchgen(clean_db, tmp_path, repo_root):
    host = tmp_path / "host"
    _write_host(host)
    key = make_tenant("host")
    script_marks = tmp_path / "script-marks"
    worker_marks = tmp_path / "worker-marks"
    script_marks.mkdir()
    worker_marks.mkdir()
    env = {**os.environ, "BATCHGEN_LOG_LEVEL": "WARNING", "PIP_NO_INDEX": "1"}
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    venv = tmp_path / "venv"
    python = _fresh_venv(venv, repo_root, env)

    # The worker starts first: its start-up overlaps the script's.
    log_path = tmp_path / "worker.log"
    ready_path = tmp_path / "worker.ready"
    # The new venv's interpreter runs Celery's command line (with --no-deps, Celery's
    # console script is not installed in it; ``python -m celery`` is the same command).
    argv = [str(python), "-m", "celery", "-A", "batchgen.tasks", "worker", "-P", "threads"]
    argv += ["-c", "2"]
    argv += ["-Q", "batchgen.control", "--without-mingle", "--without-gossip"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv,
            cwd=host,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, "HOST_MARKS": str(worker_marks), "BATCHGEN_READY_FILE": str(ready_path)},
            start_new_session=True,
        )
    worker = WorkerProcess("host-worker", process, log_path, ready_path)
    try:
        done = subprocess.run(
            [str(python), "app.py"],
            cwd=host,
            env={**env, "HOST_MARKS": str(script_marks), "HOST_KEY": key},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.splitlines()[-1])
        assert out["status_code"] == 200, out
        assert out["body"]["id"] == out["stored"]["id"]
        assert out["body"]["request_counts"]["total"] == 3
        # The script ran the host's app.py and imported the host's own modules.
        assert sorted(p.name for p in script_marks.iterdir()) == sorted(HOST_NAMES)
        # It ran in the new venv, on the new venv's editable install of batchgen.
        installed = out["installed"]
        assert Path(installed["prefix"]) == venv, installed
        assert Path(installed["dist"]).is_relative_to(venv), installed
        assert installed["finders"], installed
        assert all(Path(f).is_relative_to(venv) for f in installed["finders"]), installed
        assert Path(installed["batchgen"]).is_relative_to(repo_root), installed

        worker.wait_ready(timeout_s=90)
        assert worker.process.poll() is None
    finally:
        worker.stop()
    # batchgen's worker (its worker_ready hook wrote the ready file) loaded none of
    # the host's modules, although Celery puts the host folder on sys.path.
    assert list(worker_marks.iterdir()) == [], worker.log_tail()
