"""batchgen as a library in real host projects, installed as a user installs it (issue #26).

The test builds batchgen's wheel, fetches the wheels of its declared dependencies into a
local wheelhouse (cached in ``~/.cache/batchgen-test-wheelhouse/<hash of the dependency lists>``,
so a rerun downloads nothing), and installs ``batchgen-llm[django]`` (the distribution of
the import package ``batchgen``) from there alone (``--no-index``) into a fresh venv: a
module imported but not declared is missing there, as it is in a user's install. From
that venv run batchgen's own processes (``batchgen worker``, ``batchgen dispatcher``,
``batchgen api``) and two host projects beside them (tests/host_projects: a Flask app
and a Django site, each with its own ``tasks.py``, ``templates/dashboard.html``,
``dashboard`` blueprint or app, and Celery app on a Redis server that is not batchgen's
broker; the site's laid out as Celery's "First steps with Django"), with their signal
commands and Celery workers.

Each host submits a batch; a client of the standalone API submits a third. Each host's
``batch_finished`` receiver gets its own batch once, in its signal command's process, and
nothing else; its ``on_finished`` task runs in its own Celery worker.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from celery import Celery

from batchgen.embedded import RedisServer, free_port
from batchgen.worker.procs import WorkerProcess, stop_all
from tests import http_client
from tests.helpers import chat_line, jsonl, make_tenant
from tests.waiting import wait_until

# The first test pays for the wheel, the venv (and once per dependency list, the
# wheelhouse); on a loaded 2-core machine that alone can near the suite's 300 s.
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ROOT / "tests" / "host_projects"
# What a wheel is built from (the rest of the checkout is not the package's).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "app", "tasks", "migrations")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# The wheel's file name starts with the distribution's name, normalised (batchgen_llm-).
WHEELS = f"{PROJECT['name'].replace('-', '_')}-*.whl"
CALLBACK_TASKS = ["flask_host.batch_done", "django_host.batch_done"]
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def _run(argv: list[str], timeout_s: float = 600, **kw: Any) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kw)
    assert done.returncode == 0, (argv, done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout


def _clean_env(**values: str) -> dict[str, str]:
    """This process's environment without anything that points into the dev venv, and
    writing bytecode (the venv is installed without it: its processes write it)."""
    dropped = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    return {**env, **values}


# What the venv's processes import (batchgen's worker, dispatcher and API, the hosts'
# Flask and Django apps and Celery workers), compiled once by one process before they
# start together: each would otherwise compile them all at once beside the others.
WARM_IMPORTS = (
    "batchgen.tasks",
    "batchgen.api",
    "batchgen.serving",
    "batchgen.cli.main",
    "batchgen.providers.openai",
    "batchgen.providers.anthropic",
    "batchgen.integrations.flask",
    "batchgen.integrations.django",
    "celery.apps.worker",
    "celery.bin.celery",
    "gunicorn.app.base",
    "django",
    "django.core.management",
    "flask",
)


def build_wheel(out: Path) -> Path:
    """batchgen's wheel, built from a copy of its sources (the checkout stays clean)."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, src / name)
    dist = out / "dist"
    # The dev venv's setuptools and wheel build it (no download of a build backend).
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(dist),
            str(src),
        ]
    )
    (wheel,) = dist.glob(WHEELS)
    return wheel


def wheelhouse(wheel: Path) -> Path:
    """The wheels of batchgen's declared dependencies (with the django extra), made once
    per list of them in pyproject.toml: a finished folder is renamed into place, never
    half written."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [project["dependencies"], project["optional-dependencies"]["django"]]
    key = hashlib.sha256(json.dumps(wanted).encode()).hexdigest()[:16]
    folder = CACHE / "batchgen-test-wheelhouse" / key
    if folder.is_dir():
        return folder
    partial = folder.with_name(f"{key}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    _run([sys.executable, "-m", "pip", "wheel", "--wheel-dir", str(partial), f"{wheel}[django]"])
    for built in partial.glob(WHEELS):
        built.unlink()  # this checkout's own wheel is built anew every run
    try:
        partial.rename(folder)
    except OSError:  # another run finished first: use its folder
        shutil.rmtree(partial, ignore_errors=True)
    return folder


@dataclass(frozen=True)
class Installed:
    venv: Path
    wheel: Path

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    @property
    def python(self) -> str:
        return self.bin("python")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """A fresh venv with the built wheel and only its declared dependencies in it."""
    root = tmp_path_factory.mktemp("install")
    wheel = build_wheel(root)
    house = wheelhouse(wheel)
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    # This venv's pip installs into the new one (no pip of its own needed there).
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-compile",  # bytecode is written as modules are first imported
            "--no-index",
            "--find-links",
            str(house),
            f"{wheel}[django]",
        ],
        env=_clean_env(PIP_FIND_LINKS=str(house)),
    )
    _run(
        [str(venv / "bin" / "python"), "-c", f"import {', '.join(WARM_IMPORTS)}"], env=_clean_env()
    )
    return Installed(venv, wheel)


def test_the_wheel_carries_its_data_license_and_type_marker(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    for required in (
        "batchgen/py.typed",
        "batchgen/models.toml",
        "batchgen/templates/batchgen/dashboard.html",
        "batchgen/migrations/script.py.mako",
        "batchgen/tasks/__init__.py",
    ):
        assert required in names, required
    assert any(n.startswith("batchgen/store/sql/") and n.endswith(".sql") for n in names)
    assert any(n.startswith("batchgen/limits/lua/") and n.endswith(".lua") for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith("/LICENSE") for n in names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(installed.wheel).read(metadata).decode()
    assert "Classifier: License :: OSI Approved :: MIT License" in text
    assert "Classifier: Typing :: Typed" in text
    assert "Requires-Dist: httpx>=0.27" in text


def test_the_installed_package_and_its_version(installed, tmp_path):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    probe = "import json, batchgen; print(json.dumps([batchgen.__file__, batchgen.__version__]))"
    where, found = json.loads(_run([installed.python, "-c", probe], cwd=tmp_path))
    assert Path(where).is_relative_to(installed.venv), where  # site-packages, not the checkout
    assert found == version
    out = _run([installed.bin("batchgen"), "--version"], cwd=tmp_path, env=_clean_env())
    assert out.strip() == f"batchgen {version}"


HOST_TYPED = """
from batchgen.python_api import submit_batch

reveal_type(submit_batch)
count: int = submit_batch([], tenant="acme")
"""


def test_a_host_mypy_sees_the_typed_api(installed, tmp_path):
    """PEP 561: a host's mypy, on the venv's site-packages, reads batchgen's annotations
    (py.typed), so ``submit_batch`` is typed and a misuse is caught."""
    host_file = tmp_path / "host_typed.py"
    host_file.write_text(HOST_TYPED)
    (tmp_path / "mypy.ini").write_text("[mypy]\n")  # the host's own, empty
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent))
    assert mypy, "mypy is in the dev extra"
    argv = [
        mypy,
        "--python-executable",
        installed.python,
        "--follow-imports=silent",
        "--no-error-summary",
        "--show-error-codes",
        "--config-file",
        str(tmp_path / "mypy.ini"),
        "--cache-dir",
        str(CACHE / "batchgen-test-wheelhouse" / "mypy-cache"),
        str(host_file),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    out = done.stdout + done.stderr
    assert "import-untyped" not in out and "import-not-found" not in out, out
    assert 'Revealed type is "def (requests:' in out, out
    assert "tenant: str | batchgen.store.schema.Tenant" in out, out
    assert ") -> dict[str, Any]" in out, out
    assert "Incompatible types in assignment" in out and "[assignment]" in out, out


# ------------------------------------------------------------- the processes of the run


@dataclass
class Procs:
    """Processes started from the venv, each in its own session, with its log."""

    logs: Path
    started: list[WorkerProcess]

    def start(self, name: str, argv: list[str], cwd: Path, env: dict[str, str]) -> WorkerProcess:
        log_path = self.logs / f"{name}.log"
        ready = self.logs / f"{name}.ready"
        env = {**env, "BATCHGEN_READY_FILE": str(ready), "HOST_READY_FILE": str(ready)}
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        proc = WorkerProcess(name, process, log_path, ready)
        self.started.append(proc)
        return proc

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail(15)}" for p in self.started)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    logs = tmp_path / "logs"
    logs.mkdir()
    group = Procs(logs, [])
    yield group
    stop_all(group.started)


@pytest.fixture(scope="module")
def host_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The hosts' own Celery broker: a second Redis server, not batchgen's."""
    server = RedisServer(free_port(), tmp_path_factory.mktemp("host-broker")).start()
    yield server.url
    server.stop()


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(what: str, condition: Callable[[], bool], procs: Procs, timeout_s: float = 240) -> None:
    def done() -> bool:
        if condition():
            return True
        dead = [p.name for p in procs.started if p.process.poll() is not None]
        assert not dead, f"{dead} exited while waiting for {what}\n{procs.tails()}"
        return False

    wait_until(done, timeout_s, lambda: f"{what}\n{procs.tails()}")


def _wait_api(base_url: str, procs: Procs, path: str = "/healthz") -> None:
    def up() -> bool:
        try:
            return http_client.get(f"{base_url}{path}", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    _wait(f"{base_url}{path}", up, procs)


def _host_celery(installed: Installed, pool: str) -> Callable[[str], list[str]]:
    """``celery -A APP worker`` of a host, from the venv, on one process or thread."""

    def argv(app: str) -> list[str]:
        return [
            installed.bin("celery"),
            "-A",
            app,
            "worker",
            "-P",
            pool,
            "-c",
            "1",
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
        ]

    return argv


def test_a_batch_runs_beside_a_django_site_and_a_flask_app(
    installed, clean_db, simulator, host_broker, procs, tmp_path
):
    flask_host = tmp_path / "flask_host"
    django_host = tmp_path / "django_host"
    shutil.copytree(HOSTS / "flask_host", flask_host)
    shutil.copytree(HOSTS / "django_host", django_host)
    # batchgen's processes run in the hosts' folders, as a team starts them there (the
    # working directory comes first on sys.path): they must import none of the hosts'
    # modules (app.py, tasks.py, settings), whose names are the ones batchgen's folders
    # have on disk. Each host module touches a mark in HOST_MARKS when imported.
    service_marks, host_marks = tmp_path / "service-marks", tmp_path / "host-marks"
    service_marks.mkdir()
    host_marks.mkdir()
    phases: dict[str, float] = {}
    started_at = time.monotonic()
    files = {
        (host, kind): tmp_path / f"{host}-{kind}.jsonl"
        for host in ("flask", "django")
        for kind in ("signals", "callbacks")
    }
    for name in ("flask-shop", "django-shop"):
        make_tenant(name)
    api_key = make_tenant("api-client")

    env = _clean_env(
        BATCHGEN_DATA_DIR=str(tmp_path / "data"),
        BATCHGEN_LOG_LEVEL="WARNING",
        HOST_BROKER_URL=host_broker,
        BATCHGEN_CALLBACK_BROKER_URL=host_broker,
        BATCHGEN_CALLBACK_TASKS=json.dumps(CALLBACK_TASKS),
        BATCHGEN_CALLBACK_QUEUES=json.dumps(["flask_host", "django_host"]),
    )

    def host_env(host: str, role: str) -> dict[str, str]:
        return {
            **env,
            "HOST_ROLE": role,
            "HOST_SIGNALS_FILE": str(files[host, "signals"]),
            "HOST_CALLBACKS_FILE": str(files[host, "callbacks"]),
            "HOST_MARKS": str(host_marks),
        }

    service_env = {**env, "HOST_MARKS": str(service_marks)}

    flask_cmd = [installed.bin("flask"), "--app", "app"]
    django_cmd = [installed.python, "manage.py"]
    host_celery = _host_celery(installed, "threads")
    api_port = free_port()
    # Everything starts at once; each is waited for by its own sign of life.
    ready = [
        procs.start("worker", [installed.bin("batchgen"), "worker"], flask_host, service_env),
        procs.start(
            "dispatcher", [installed.bin("batchgen"), "dispatcher"], django_host, service_env
        ),
        procs.start(
            "flask-celery",
            [*host_celery("tasks"), "-Q", "flask_host", "-n", "flask_host@%h"],
            flask_host,
            host_env("flask", "celery"),
        ),
        procs.start(
            "django-celery",
            [*host_celery("host_site"), "-Q", "django_host", "-n", "django_host@%h"],
            django_host,
            host_env("django", "celery"),
        ),
    ]
    procs.start(
        "api",
        [installed.bin("batchgen"), "api", "--host", "127.0.0.1", "--port", str(api_port)],
        flask_host,
        service_env,
    )
    procs.start(
        "flask-signals",
        [*flask_cmd, "batchgen", "signals", "--follow", "--poll-s", "0.5"],
        flask_host,
        host_env("flask", "signals"),
    )
    procs.start(
        "django-signals",
        [*django_cmd, "batchgen_signals", "--follow", "--poll-s", "0.5"],
        django_host,
        host_env("django", "signals"),
    )
    base_url = f"http://127.0.0.1:{api_port}"
    # The hosts' jobs start once their Celery workers listen (a callback then has a
    # queue to land in); batchgen's worker, dispatcher and API may still be starting.
    for proc in ready[2:]:
        _wait(f"{proc.name} ready", proc.ready_path.exists, procs)
    # Each host submits from a job of its own; a client of the standalone API submits too.
    jobs = {
        "flask": subprocess.Popen(
            [installed.python, "submit.py", "flask-shop"],
            cwd=flask_host,
            env=host_env("flask", "job"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
        "django": subprocess.Popen(
            [*django_cmd, "describe", "django-shop"],
            cwd=django_host,
            env=host_env("django", "job"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
    }
    _wait_api(base_url, procs)
    for proc in ready[:2]:
        _wait(f"{proc.name} ready", proc.ready_path.exists, procs)
    phases["processes up"] = time.monotonic() - started_at
    answer = http_client.post(
        f"{base_url}/v1/batches",
        content=jsonl([chat_line(f"api-{i}", max_tokens=5) for i in range(3)]),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/jsonl"},
        timeout=30,
    )
    assert answer.status_code in (200, 201), answer.text
    api_batch = answer.json()["id"]
    out = {}
    for host, job in jobs.items():
        stdout, stderr = job.communicate(timeout=120)
        assert job.returncode == 0, (host, stderr[-3000:])
        out[host] = json.loads(stdout.strip().splitlines()[-1])
    assert out["flask"]["status_code"] == 200, out["flask"]
    batches = {host: out[host]["batch"]["id"] for host in out}
    phases["submitted"] = time.monotonic() - started_at

    # Each host's pages are its own; batchgen's dashboard is not replaced by them.
    for host, marker in (("flask", "HOST-FLASK-DASHBOARD"), ("django", "HOST-DJANGO-DASHBOARD")):
        assert marker in out[host]["host_dashboard"], out[host]["host_dashboard"][:500]
        ours = out[host]["batchgen_dashboard"]
        assert marker not in ours, host
        assert 'id="sign-in"' in ours, (host, ours[:500])  # batchgen's own page, not an error

    # The batches run through the venv's worker and dispatcher.
    def status(batch_id: str) -> str:
        got = http_client.get(
            f"{base_url}/v1/batches/{batch_id}",
            timeout=10,
            headers={"Authorization": f"Bearer {api_key}"},
        )
        return str(got.json().get("status"))

    _wait("the API client's batch to end", lambda: status(api_batch) in TERMINAL, procs)
    assert status(api_batch) == "completed"

    def arrived() -> bool:
        return all(
            batches[host] in {line["batch_id"] for line in _lines(files[host, kind])}
            for host in batches
            for kind in ("signals", "callbacks")
        )

    _wait("each host's signal and callback", arrived, procs)
    phases["delivered"] = time.monotonic() - started_at
    # A one-shot run of each host's signal command finds nothing left to deliver: the
    # follow commands delivered each batch once, and nobody else's is due to them.
    once = [
        subprocess.Popen(argv, cwd=cwd, env=env_, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for argv, cwd, env_ in (
            ([*flask_cmd, "batchgen", "signals"], flask_host, host_env("flask", "once")),
            ([*django_cmd, "batchgen_signals"], django_host, host_env("django", "once")),
        )
    ]
    for command in once:
        _, stderr = command.communicate(timeout=240)
        assert command.returncode == 0, stderr[-3000:]
    for host in ("flask", "django"):
        signals = _lines(files[host, "signals"])
        assert Counter(s["batch_id"] for s in signals) == {batches[host]: 1}, (host, signals)
        assert {(s["status"], s["role"]) for s in signals} == {("completed", "signals")}
        callbacks = _lines(files[host, "callbacks"])
        assert Counter(c["batch_id"] for c in callbacks) == {batches[host]: 1}, (host, callbacks)
        assert {(c["status"], c["role"]) for c in callbacks} == {("completed", "celery")}
    assert api_batch not in json.dumps([_lines(f) for f in files.values()])
    for proc in procs.started:
        assert proc.process.poll() is None, f"{proc.name} exited\n{proc.log_tail()}"
    # batchgen's processes ran in the hosts' folders and loaded none of their modules;
    # the hosts' own processes did (the marks work).
    assert sorted(p.name for p in service_marks.iterdir()) == [], procs.tails()
    assert {p.name for p in host_marks.iterdir()} >= {
        "flask_host.app",
        "flask_host.tasks",
        "dashboard.dashboard.tasks",
        "host_site.host_site.celery",
        "host_site.host_site.settings",
    }
    print({name: round(seconds, 1) for name, seconds in phases.items()})  # -rP shows it


def _host_tasks_on(redis_url: str) -> list[str]:
    """The names of the Django site's tasks in any message waiting on a Redis server."""
    import redis

    client = redis.Redis.from_url(redis_url)
    found = []
    for key in client.scan_iter():
        if client.type(key) == b"list":
            for message in client.lrange(key, 0, -1):
                task = json.loads(message).get("headers", {}).get("task", "")
                if task.startswith("dashboard.tasks."):
                    found.append(f"{key.decode()}: {task}")
    return found


def test_a_django_sites_shared_tasks_reach_its_own_worker(
    installed, clean_db, host_broker, procs, tmp_path
):
    """Celery's "First steps with Django" layout (host_site/celery.py, ``@shared_task`` in
    dashboard/tasks.py) beside batchgen's Django app: the site's tasks sent with
    ``.delay()`` from a request, from a management command and from a task in the site's
    worker all run in the site's worker, from its own broker; none is sent to batchgen's.
    """
    site = tmp_path / "django_host"
    shutil.copytree(HOSTS / "django_host", site)
    pings = tmp_path / "pings.jsonl"
    env = _clean_env(
        BATCHGEN_DATA_DIR=str(tmp_path / "data"),
        BATCHGEN_LOG_LEVEL="WARNING",
        HOST_BROKER_URL=host_broker,
        HOST_PINGS_FILE=str(pings),
        HOST_CALLBACKS_FILE=str(tmp_path / "callbacks.jsonl"),
    )
    # The solo pool runs the tasks on the worker's main thread, the one that loaded
    # batchgen's modules (at Django's start-up), as a management command or a sync WSGI
    # worker does.
    worker = procs.start(
        "site-celery",
        [*_host_celery(installed, "solo")("host_site"), "-Q", "django_host", "-n", "site@%h"],
        site,
        {**env, "HOST_ROLE": "celery"},
    )
    port = free_port()
    # Without threads, as a sync WSGI worker (gunicorn's default) serves: on the main thread.
    procs.start(
        "site-web",
        [installed.python, "manage.py", "runserver", "--noreload", "--nothreading", str(port)],
        site,
        {**env, "HOST_ROLE": "web"},
    )
    _wait("the site's worker ready", worker.ready_path.exists, procs)
    _wait_api(f"http://127.0.0.1:{port}", procs, "/dashboard/")
    answer = http_client.get(f"http://127.0.0.1:{port}/ping/", timeout=30)
    assert answer.status_code == 200 and answer.text == "sent", answer.text
    _run([installed.python, "manage.py", "ping_site"], cwd=site, env={**env, "HOST_ROLE": "job"})
    # Sent by now (.delay() returns once the broker has the message): none on batchgen's.
    assert _host_tasks_on(clean_db["REDIS_URL"]) == []
    # The site's worker sends one on from its ``relay`` task (sent here by name).
    sender = Celery("test-sender", broker=host_broker, set_as_current=False, fixups=[])
    with sender.connection_for_write() as connection:
        sender.send_task("dashboard.tasks.relay", queue="django_host", connection=connection)

    def origins() -> set[tuple[str, str]]:
        return {(line["origin"], line["role"]) for line in _lines(pings)}

    everywhere = {(origin, "celery") for origin in ("web", "command", "relay", "worker")}
    _wait("the site's tasks in the site's worker", lambda: origins() >= everywhere, procs)
    assert origins() == everywhere
    assert _host_tasks_on(clean_db["REDIS_URL"]) == []
