"""Every command of the README, run as the README gives it (tests/readme.py reads them).

One test per README section with an ``sh`` block (``readme.SECTIONS``). A command is
run as a real process of this checkout's install (``.venv/bin/batchgen`` and
``batchgen`` are ``python -m batchgen.cli``), on this session's PostgreSQL and Redis,
with each README port mapped to a free one and ``0.0.0.0`` to ``127.0.0.1``. A command
the runner does not know fails its test: a new command in the README needs a way to
run here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from batchgen.embedded import free_port
from batchgen.worker import procs
from tests import http_client, readme
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

SERVERS = {"api", "worker", "dispatcher", "beat", "flower", "simulator"}
# Unset, the processes start (or reuse) embedded servers in BATCHGEN_DATA_DIR.
EMBEDDED_UNSET = tuple(
    prefix + name
    for prefix in ("", "BATCHGEN_")
    for name in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL")
)
FLOWER_AUTH = {"BATCHGEN_FLOWER_USER": "ops", "BATCHGEN_FLOWER_PASSWORD": "readme-test"}


def _spawn_at(cwd: Path, argv: list[str], env: dict[str, str], log: Path) -> procs.Process:
    """``argv`` in folder ``cwd``, in a session of its own, output to ``log``: by the
    suite's spawn (its fork server) when this process runs there, else by exec."""
    if Path.cwd().resolve() == cwd.resolve():
        return procs.default_spawn(argv, env, log)
    with open(log, "ab") as fh:
        return subprocess.Popen(
            argv, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


@dataclass
class Started:
    command: readme.Command
    process: procs.Process
    log: Path
    ready: Callable[[], bool]

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Runner:
    """Runs README commands in a folder, ports mapped, and stops what it started."""

    folder: Path
    env: dict[str, str]
    unset: tuple[str, ...] = ()
    ports: dict[str, int] = field(default_factory=dict)
    started: list[Started] = field(default_factory=list)

    def port(self, readme_port: str) -> int:
        return self.ports.setdefault(readme_port, free_port())

    def argv(self, command: readme.Command) -> list[str]:
        program = command.argv[0]
        if program not in ("batchgen", ".venv/bin/batchgen"):
            raise AssertionError(f"no test runs {command.line!r}")
        args = list(command.argv[1:])
        for i, arg in enumerate(args[:-1]):
            if arg == "--port":
                args[i + 1] = str(self.port(args[i + 1]))
            if arg in ("--host", "--address") and args[i + 1] == "0.0.0.0":
                args[i + 1] = "127.0.0.1"
        return [sys.executable, "-m", "batchgen.cli", *args]

    def process_env(self, command: readme.Command, ready: Path | None = None) -> dict[str, str]:
        env = {**os.environ, **self.env, **command.env, "COLUMNS": "200"}
        for name in self.unset:
            env.pop(name, None)
        if "8099" in self.ports:  # the README's simulator
            env["BATCHGEN_SIMULATOR_URL"] = f"http://127.0.0.1:{self.ports['8099']}"
        if ready is not None:
            env["BATCHGEN_READY_FILE"] = str(ready)
        return env

    def run(self, command: readme.Command, timeout_s: float = 120) -> subprocess.CompletedProcess:
        assert command.argv[1] not in SERVERS, command.line
        done = subprocess.run(
            self.argv(command),
            cwd=readme.ROOT,
            env=self.process_env(command),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        return done

    def start(self, command: readme.Command) -> Started:
        kind = command.argv[1]
        if kind not in SERVERS:
            raise AssertionError(f"no test knows when {command.line!r} is up")
        name = f"{kind}-{uuid.uuid4().hex[:4]}"
        log, ready_file = self.folder / f"{name}.log", self.folder / f"{name}.ready"
        env = self.process_env(command, ready_file)
        if kind == "flower":
            env.update(FLOWER_AUTH)  # the README: Flower needs them
        argv = self.argv(command)
        process = _spawn_at(readme.ROOT, argv, env, log)
        port = argv[argv.index("--port") + 1] if "--port" in argv else ""
        started = Started(command, process, log, lambda: False)
        checks: dict[str, Callable[[], bool]] = {
            "api": lambda: answers(f"http://127.0.0.1:{port}/healthz"),
            "simulator": lambda: answers(f"http://127.0.0.1:{port}/v1/models"),
            "flower": lambda: answers(f"http://127.0.0.1:{port}/healthcheck"),
            "worker": ready_file.exists,
            "dispatcher": ready_file.exists,
            "beat": lambda: "beat: Starting" in started.text(),
        }
        started.ready = checks[kind]
        self.started.append(started)
        return started

    def wait_ready(self, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        for s in self.started:

            def up(s: Started = s) -> bool:
                if s.ready():
                    return True
                if s.process.poll() is not None:
                    raise AssertionError(f"{s.command.line!r} exited: {s.text()[-3000:]}")
                return False

            left_s = max(0.0, deadline - time.monotonic())
            wait_until(up, left_s, lambda s=s: f"{s.command.line!r} up: {s.text()[-3000:]}")

    def stop(self) -> None:
        for s in self.started:
            if s.process.poll() is None:
                os.killpg(s.process.pid, signal.SIGTERM)
        for s in self.started:
            try:
                s.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(s.process.pid, signal.SIGKILL)
                s.process.wait()


def answers(url: str) -> bool:
    try:
        return http_client.get(url, timeout=1).status_code < 500
    except httpx.TransportError:
        return False


@pytest.fixture
def runner(services, tmp_path: Path) -> Iterator[Runner]:
    run = Runner(tmp_path, {"BATCHGEN_DATA_DIR": str(tmp_path / "data")})
    try:
        yield run
    finally:
        run.stop()


@pytest.mark.slow
def test_the_two_commands(services, runner: Runner, restore_env) -> None:
    """The test command is exactly what .ci/run runs (not run again here: this is it):
    uv, installed by pip, installs the `dev` extra into the venv with its bytecode. The
    demo's set-up is the same venv, pip installing the `embedded` extra, and the demo
    itself runs, with `--items` kept short."""
    demo, tests = [b for b in readme.blocks() if b.section == "The two commands"]
    assert tests.text.strip() == readme.ci_test_command()
    setup = readme.commands(tests)[:-1]
    assert [c.argv[0] for c in setup] == ["python3", ".venv/bin/pip", ".venv/bin/uv"]
    assert setup[1].argv == [".venv/bin/pip", "install", "-q", "uv"]
    assert setup[2].argv[-2:] == ["-e", ".[dev]"]
    assert {"--python", ".venv/bin/python", "--compile-bytecode"} <= set(setup[2].argv)
    extras = tomllib.loads((readme.ROOT / "pyproject.toml").read_text())["project"]
    demo_commands = readme.commands(demo)
    assert len(demo_commands) == 3
    venv, install, run_demo = demo_commands
    assert venv.argv == setup[0].argv
    assert install.argv == [".venv/bin/pip", "install", "-q", "-e", ".[embedded]"]
    assert "embedded" in extras["optional-dependencies"]
    assert set(extras["optional-dependencies"]["embedded"]) <= set(
        extras["optional-dependencies"]["dev"]
    )

    assert run_demo.argv == [".venv/bin/batchgen", "demo"]
    short = dataclasses.replace(run_demo, argv=[*run_demo.argv, "--items", "9"])
    done = runner.run(short, timeout_s=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "per-tenant usage" in done.stdout


@pytest.mark.slow
def test_quick_start(runner: Runner) -> None:
    """The quick start's processes, on embedded servers of their own as on a laptop
    (no DATABASE_URL or REDIS_URL: the first process starts them, the others reuse
    them), then its openai-SDK program, as written, against them (its key and address
    put in), on the README's own requests.jsonl."""
    section = "Quick start: the SDK you already have"
    # Outside pytest's temporary root, which other pytest runs may prune meanwhile.
    data_dir = Path(tempfile.mkdtemp(prefix="batchgen-readme-"))
    runner.env["BATCHGEN_DATA_DIR"] = str(data_dir)
    runner.unset = EMBEDDED_UNSET
    try:
        run_quick_start(runner, section)
    finally:
        runner.stop()  # the process that started the embedded servers stops them
        shutil.rmtree(data_dir, ignore_errors=True)


def run_doctor(runner: Runner, command: readme.Command) -> subprocess.CompletedProcess:
    """`batchgen doctor` once the started processes are up; a worker is seen once it
    answers Celery's ping, so it is asked again until it passes or a minute is up."""
    runner.wait_ready()
    runs: list[subprocess.CompletedProcess] = []

    def passed() -> bool:
        runs.append(runner.run(command))
        return runs[-1].returncode == 0

    # The caller reads the last run's output and says what failed.
    with contextlib.suppress(AssertionError):
        wait_until(passed, 60, "`batchgen doctor` to pass", 1.0)
    return runs[-1]


def run_quick_start(runner: Runner, section: str) -> None:
    key = ""
    commands = readme.sh_commands(section)
    assert commands[-1].argv[1:] == ["doctor"]  # the check comes once the parts are up
    for command in commands:
        if command.background:
            runner.start(command)
            continue
        is_doctor = command.argv[1] == "doctor"
        done = run_doctor(runner, command) if is_doctor else runner.run(command)
        assert done.returncode == 0, done.stdout + done.stderr
        if command.argv[1:3] == ["tenants", "create"]:
            key = done.stdout.strip().splitlines()[-1]
    assert key.startswith("bg"), key

    program = readme.quick_start_program()
    (lines,) = [b.text for b in readme.blocks() if b.section == section and b.lang == "json"]
    api = f"http://127.0.0.1:{runner.ports['8000']}"
    assert 'TENANT_KEY = "..."' in program and "http://localhost:8000" in program
    program = program.replace('TENANT_KEY = "..."', f"TENANT_KEY = {key!r}")
    program = program.replace("http://localhost:8000", api)
    program += "\nprint(reply.choices[0].message.content[:0] + 'SYNC-DONE')\n"
    (runner.folder / "requests.jsonl").write_text(lines)
    done = subprocess.run(
        [sys.executable, "-c", program],
        cwd=runner.folder,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["custom_id"] for r in rows] == ["p-1"]
    assert rows[0]["response"]["status_code"] == 200
    assert done.stdout.rstrip().endswith("SYNC-DONE")
    poll_a_cancelled_batch(runner, key, api)


def poll_a_cancelled_batch(runner: Runner, key: str, api: str) -> None:
    """The program's polling loop ends on a batch that was cancelled, not completed."""
    import openai

    client = openai.OpenAI(base_url=f"{api}/v1", api_key=key)
    line = json.loads((runner.folder / "requests.jsonl").read_text())
    # Enough requests that the cancel comes before they are all done.
    lines = "".join(json.dumps({**line, "custom_id": f"c-{i}"}) + "\n" for i in range(50))
    upload = client.files.create(file=("r.jsonl", lines.encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    client.batches.cancel(batch.id)
    program = (
        "import time\nfrom openai import OpenAI\n"
        f"client = OpenAI(base_url={api + '/v1'!r}, api_key={key!r})\n"
        f"batch = client.batches.retrieve({batch.id!r})\n"
        + readme.polling_loop(readme.quick_start_program())
        + "print(batch.status)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["cancelled"]


@pytest.mark.slow
def test_production_processes(clean_db, simulator, runner: Runner) -> None:
    """Each process of the production block starts and comes up; with all of them
    running, the checks that follow (`batchgen doctor`, `batchgen status`) pass."""
    section = "In production: the processes"
    commands = readme.sh_commands(section)
    assert {c.argv[1] for c in commands} >= {"api", "worker", "dispatcher", "beat", "flower"}
    for command in commands:
        if command.argv[1] in SERVERS:
            runner.start(command)
            continue
        if command.argv[1] == "doctor":
            done = run_doctor(runner, command)
        else:
            runner.wait_ready()
            done = runner.run(command)
        assert done.returncode == 0, f"{command.line}: {done.stdout}{done.stderr}"
    flower = [s for s in runner.started if s.command.argv[1] == "flower"]
    port = runner.ports["5555"]
    assert flower and http_client.get(f"http://127.0.0.1:{port}/").status_code == 401


def test_real_providers(services, runner: Runner) -> None:
    """The registry for OpenAI and Anthropic loads and lists its models."""
    (command,) = readme.sh_commands("Real providers")
    done = runner.run(command)
    assert done.returncode == 0, done.stdout + done.stderr
    registry = tomllib.loads((readme.ROOT / command.env["BATCHGEN_MODELS_FILE"]).read_text())
    for model in registry["models"]:
        assert re.search(re.escape(model[:20]), done.stdout), (model, done.stdout)
