"""The ``batchgen`` CLI: each command's happy path and its main error.

In-process commands run through Typer's CliRunner; the long-running ones
(worker, dispatcher, beat, api, simulator, flower) as real processes. This
module shares one ``batchgen worker --group sim`` and one ``batchgen
dispatcher`` process, so its tests use fresh tenant names instead of
``clean_db`` (which would flush the broker under them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from batchgen.cli.main import cli
from batchgen.config import get_settings
from batchgen.embedded import free_port
from batchgen.store import db
from batchgen.store.schema import Item, Result, Tenant
from batchgen.worker import procs
from tests import http_client
from tests.helpers import chat_line, jsonl
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
SECRET = "SECRET-PROMPT-TEXT"


@dataclass
class Service:
    name: str
    process: procs.Process
    log: Path
    ready_file: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
        def ready() -> bool:
            if check():
                return True
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.process.returncode}: {self.text()}")
            return False

        wait_until(ready, timeout_s, lambda: f"{self.name} ready: {self.text()[-3000:]}")

    def wait_worker(self) -> None:
        self.wait(lambda: self.ready_file.exists() or " ready." in self.text())

    def stop(self) -> int:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode


def start(args: list[str], folder: Path, env: dict[str, str] | None = None) -> Service:
    """``batchgen ARGS`` as a process of its own (process group), logging to a file."""
    name = args[0] + "-" + uuid.uuid4().hex[:4]
    log, ready = folder / f"{name}.log", folder / f"{name}.ready"
    process = procs.default_spawn(  # the suite's fork server, or exec
        [sys.executable, "-m", "batchgen.cli", *args],
        {**os.environ, "BATCHGEN_READY_FILE": str(ready), **(env or {})},
        log,
    )
    return Service(name, process, log, ready)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def stack(services, simulator, folder) -> Iterator[dict[str, Service]]:
    """``batchgen worker --group sim`` and ``batchgen dispatcher``: the commands' happy path
    and the processing for this module's batches."""
    env = {
        "BATCHGEN_DATA_DIR": str(folder / "data"),
        "BATCHGEN_NIGHTLY_POLL_S": "0.3",
        "BATCHGEN_NIGHTLY_JOBS_FILE": str(folder / "nightly" / "jobs.toml"),
    }
    procs = {
        "worker": start(["worker", "--group", "sim", "--concurrency", "8"], folder, env),
        "dispatcher": start(["dispatcher"], folder, env),
    }
    try:
        for p in procs.values():
            p.wait_worker()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture
def run() -> Callable[..., object]:
    runner = CliRunner()

    def invoke(*args: str) -> object:
        result = runner.invoke(cli, [str(a) for a in args], env={"COLUMNS": "200"})
        get_settings.cache_clear()
        return result

    return invoke


@pytest.fixture
def tenant(services, run) -> str:
    name = "t-" + uuid.uuid4().hex[:8]
    result = run("tenants", "create", name, "--json")
    assert result.exit_code == 0, result.output
    return name


def test_tenant_webhooks(services, run):
    name = "hooks-" + uuid.uuid4().hex[:6]
    url = "https://hooks.example.com/batchgen"
    created = run("tenants", "create", name, "--webhook-url", url, "--json")
    assert created.exit_code == 0, created.output
    secret = json.loads(created.stdout)["webhook_secret"]
    assert secret.startswith("whsec_")
    shown = json.loads(run("tenants", "webhook", name, "--json").stdout)
    assert shown == {"name": name, "webhook_url": url, "webhook_secret": secret}
    rotated = json.loads(run("tenants", "webhook", name, "--rotate", "--json").stdout)
    assert rotated["webhook_secret"] != secret and rotated["webhook_url"] == url
    bad = run("tenants", "webhook", name, "--url", "ftp://nope")
    assert bad.exit_code == 1 and "webhook_url must be an http" in bad.stderr
    assert run("tenants", "create", "bad-" + name, "--webhook-url", "nope").exit_code == 1
    assert run("tenants", "webhook", "nobody-" + name).exit_code == 1


def test_tenants(services, run):
    name = "acme-" + uuid.uuid4().hex[:6]
    limits = [
        "--max-pending-items",
        "500",
        "--daily-token-quota",
        "90000",
        "--tokens-per-min",
        "600",
        "--max-files",
        "7",
        "--max-file-bytes",
        "4096",
    ]
    created = run("tenants", "create", name, "--weight", "3", *limits, "--json")
    assert created.exit_code == 0, created.output
    assert json.loads(created.stdout)["api_key"].startswith("bg_")
    duplicate = run("tenants", "create", name)
    assert duplicate.exit_code == 1 and "already exists" in duplicate.stderr
    assert run("tenants", "create", "w0-" + name, "--weight", "0").exit_code == 2
    listed = json.loads(run("tenants", "list", "--json").stdout)
    expected = {
        "name": name,
        "weight": 3,
        "max_pending_items": 500,
        "daily_token_quota": 90000,
        "tokens_per_min": 600,
        "max_files": 7,
        "max_file_bytes": 4096,
        "revoked": False,
    }
    assert expected.items() <= next(t for t in listed if t["name"] == name).items()
    assert name in run("tenants", "list").stdout
    assert run("tenants", "revoke", name).exit_code == 0
    assert next(
        t for t in json.loads(run("tenants", "list", "--json").stdout) if t["name"] == name
    )["revoked"]
    unknown = run("tenants", "revoke", "nobody-" + name)
    assert unknown.exit_code == 1 and "no tenant named" in unknown.stderr


def test_keys_tenants_and_the_audit_log_from_the_cli(services, run, monkeypatch):
    """Keys made, listed, rotated and revoked, a tenant's quotas changed, suspended and
    resumed, from the CLI: each change in the audit log as ``cli:<user>``; an operator
    key made by the CLI opens the admin API once its entry is configured."""
    import getpass

    from batchgen.api import create_app
    from batchgen.store.api_keys import authenticate

    name = "keys-" + uuid.uuid4().hex[:6]
    created = json.loads(run("tenants", "create", name, "--json").stdout)
    made = run("keys", "create", name, "--name", "ci", "--scope", "batches", "--scope", "read")
    assert made.exit_code == 0, made.output
    secret = made.stdout.strip()
    assert secret.startswith("bg_") and "shown once" in made.stderr
    listed = json.loads(run("keys", "list", name, "--json").stdout)
    ci = next(k for k in listed if k["name"] == "ci")
    assert ci["scopes"] == ["batches", "read"] and secret not in json.dumps(listed)
    assert "ci" in run("keys", "list", name).stdout
    rotated = json.loads(
        run("keys", "rotate", name, str(ci["id"]), "--overlap-s", "600", "--json").stdout
    )
    with db.session_scope() as session:  # both work during the overlap
        assert authenticate(session, secret).key_id == ci["id"]
        assert authenticate(session, rotated["new"]["secret"]).key_name == "ci"
    assert run("keys", "revoke", name, str(ci["id"])).exit_code == 0
    assert run("keys", "revoke", name, "999999").exit_code == 1
    bad_scope = run("keys", "create", name, "--name", "x", "--scope", "root")
    assert bad_scope.exit_code == 1 and "unknown scope" in bad_scope.stderr

    updated = run("tenants", "update", name, "--weight", "4", "--tokens-per-min", "900", "--json")
    assert json.loads(updated.stdout)["weight"] == 4
    cleared = json.loads(
        run("tenants", "update", name, "--clear", "tokens_per_min", "--json").stdout
    )
    assert cleared["tokens_per_min"] is None
    assert json.loads(run("tenants", "suspend", name, "--json").stdout)["suspended"]
    assert not json.loads(run("tenants", "resume", name, "--json").stdout)["suspended"]

    log = json.loads(run("audit", "--tenant", name, "--json").stdout)
    assert [e["action"] for e in reversed(log)] == [
        "tenant.create",
        "key.create",
        "key.create",
        "key.rotate",
        "key.revoke",
        "tenant.update",
        "tenant.update",
        "tenant.suspend",
        "tenant.resume",
    ]
    assert {e["actor"] for e in log} == {f"cli:{getpass.getuser()}"}
    assert created["api_key"] not in json.dumps(log) and secret not in json.dumps(log)
    assert name in run("audit", "--tenant", name).stdout

    by_key = run("usage", "--tenant", name, "--group-by", "key", "--json")
    assert by_key.exit_code == 0 and json.loads(by_key.stdout) == []  # nothing billed yet
    operator = json.loads(run("admin", "operator-key", "deploy", "--json").stdout)
    assert operator["admin_keys_entry"].startswith("deploy:")
    monkeypatch.setenv("BATCHGEN_ADMIN_KEYS", json.dumps([operator["admin_keys_entry"]]))
    get_settings.cache_clear()
    try:
        client = create_app().test_client()
        headers = {"Authorization": f"Bearer {operator['key']}"}
        assert client.get(f"/admin/v1/tenants/{name}", headers=headers).status_code == 200
    finally:
        monkeypatch.delenv("BATCHGEN_ADMIN_KEYS")
        get_settings.cache_clear()


def test_models_and_db_upgrade(services, run, tmp_path, restore_env):
    models = json.loads(run("models", "--json").stdout)
    assert {"sim-small", "sim-large"} <= {m["name"] for m in models}
    assert "sim-small" in run("models").stdout
    assert run("db", "upgrade").exit_code == 0
    bad_revision = run("db", "upgrade", "--revision", "nope")
    assert bad_revision.exit_code == 1 and "migration" in bad_revision.stderr
    (tmp_path / "models.toml").write_text("[models.broken]\nprovider = 'nope'\n")
    os.environ["BATCHGEN_MODELS_FILE"] = str(tmp_path / "models.toml")
    broken = run("models")
    assert broken.exit_code == 1 and "broken" in broken.stderr


def test_submit_wait_watch_results_cancel(stack, run, tenant, tmp_path):
    requests = tmp_path / "requests.jsonl"
    # The file names sim-large; --model puts every line on sim-small (served here).
    rows = [chat_line(f"c-{i}", model="sim-large", text=f"{SECRET} {i}") for i in range(15)]
    requests.write_bytes(jsonl(rows))
    done = run("submit", requests, "--tenant", tenant, "--model", "sim-small", "--wait", "--json")
    assert done.exit_code == 0, done.output
    batch = json.loads(done.stdout)
    assert f"as {batch['id']}; waiting" in done.stderr  # said before the wait
    assert batch["status"] == "completed" and batch["request_counts"]["succeeded"] == 15
    with db.session_scope() as s:
        models = set(s.scalars(select(Item.model).where(Item.batch_id == batch["id"])))
    assert models == {"sim-small"}

    watched = run("watch", batch["id"], "--tenant", tenant)
    assert watched.exit_code == 0 and "15 succeeded" in watched.stdout
    out = tmp_path / "out" / "results.jsonl"
    written = run("results", batch["id"], "--tenant", tenant, "-o", out, "--json")
    assert written.exit_code == 0 and json.loads(written.stdout)["written"] == 15
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in lines] == [f"c-{i}" for i in range(15)]
    to_stdout = run("results", batch["id"], "--tenant", tenant, "-o", "-")
    assert len(to_stdout.stdout.splitlines()) == 15

    # Without --wait: prints the id; sim-large has no worker here, so cancel catches it.
    pending = run("submit", requests, "--tenant", tenant, "--metadata", '{"k": 1}')
    assert pending.exit_code == 0, pending.output
    batch_id = pending.stdout.strip()
    cancelled = run("cancel", batch_id, "--tenant", tenant, "--json")
    assert cancelled.exit_code == 0 and json.loads(cancelled.stdout)["status"] == "cancelled"
    assert run("watch", batch_id, "--tenant", tenant).exit_code == 1  # not all succeeded

    for result in (done, watched, written, pending, cancelled):
        assert SECRET not in result.output


def test_submit_detects_an_anthropic_batch_file(stack, run, tenant, tmp_path):
    """A Message Batch file (JSONL of {custom_id, params}, or {"requests": [...]}) is
    detected, translated and run; --model applies to it too."""
    requests = [
        {
            "custom_id": f"a-{i}",
            "params": {
                "model": "sim-large",
                "max_tokens": 30,
                "messages": [{"role": "user", "content": f"{SECRET} {i}"}],
            },
        }
        for i in range(4)
    ]
    for name, content in (
        ("lines.jsonl", jsonl(requests)),
        ("whole.json", json.dumps({"requests": requests}, indent=2).encode()),
    ):
        path = tmp_path / name
        path.write_bytes(content)
        done = run("submit", path, "--tenant", tenant, "--model", "sim-small", "--wait", "--json")
        assert done.exit_code == 0, done.output
        batch = json.loads(done.stdout)
        assert batch["endpoint"] == "/v1/messages" and batch["request_counts"]["succeeded"] == 4
        with db.session_scope() as s:
            items = list(
                s.execute(select(Item.custom_id, Item.model).where(Item.batch_id == batch["id"]))
            )
        assert sorted(items) == [(f"a-{i}", "sim-small") for i in range(4)]
        assert SECRET not in done.output


def test_batch_command_errors(services, run, tenant, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(jsonl([chat_line("a", text=SECRET)]) + b'{"custom_id": "b", ' + b"\n")
    result = run("submit", bad, "--tenant", tenant)
    assert result.exit_code == 1 and "line 2" in result.stderr
    assert SECRET not in result.output
    assert run("submit", tmp_path / "missing.jsonl", "--tenant", tenant).exit_code == 2
    assert run("submit", bad).exit_code == 2  # --tenant is required
    assert run("submit", bad, "--tenant", tenant, "--metadata", "{no").exit_code == 2
    good = tmp_path / "good.jsonl"
    good.write_bytes(jsonl([chat_line("a")]))
    unknown_tenant = run("submit", good, "--tenant", "nobody-" + tenant)
    assert unknown_tenant.exit_code == 1 and "no tenant named" in unknown_tenant.stderr
    for args in (["watch", "batch_nope"], ["cancel", "batch_nope"]):
        result = run(*args, "--tenant", tenant)
        assert result.exit_code == 1 and "no batch 'batch_nope'" in result.stderr, args
    result = run("results", "batch_nope", "--tenant", tenant, "-o", tmp_path / "r.jsonl")
    assert result.exit_code == 1 and not (tmp_path / "r.jsonl").exists()
    as_json = run("watch", "batch_nope", "--tenant", tenant, "--json")
    assert as_json.exit_code == 1  # and the reason is the JSON document on stdout
    assert json.loads(as_json.stdout)["error"]["code"] == "not_found"


def test_nightly_run(stack, run, tenant, folder, tmp_path, restore_env):
    jobs = folder / "nightly" / "jobs.toml"  # the dispatcher's BATCHGEN_NIGHTLY_JOBS_FILE
    jobs.parent.mkdir(exist_ok=True)
    (jobs.parent / "catalog.jsonl").write_text(
        "".join(json.dumps({"id": f"n{i}", "name": f"Vase {i}"}) + "\n" for i in range(8))
    )
    text = (
        f'[[jobs]]\nname = "vases"\ntenant = "{tenant}"\nmodel = "sim-small"\n'
        'catalog = "catalog.jsonl"\nmax_tokens = 8\noutput = "out/{job}-{date}.csv"\n'
    )
    jobs.write_text(text)
    other = tmp_path / "other-jobs.toml"
    other.write_text(text)
    os.environ.update(BATCHGEN_NIGHTLY_POLL_S="0.3", BATCHGEN_NIGHTLY_JOBS_FILE=str(jobs))
    # Another jobs file than the workers' cannot be collected by them: --wait or nothing.
    refused = run("nightly", "run", "--date", "2030-03-04", "--jobs-file", other)
    assert refused.exit_code == 2 and "--wait" in refused.stderr, refused.output
    # Without --wait: submitted, and the dispatcher writes the output when it ends.
    started = run("nightly", "run", "--date", "2030-03-04", "--json")
    assert started.exit_code == 0, started.output
    (batch_id,) = json.loads(started.stdout)["batches"]["vases"]
    waited = run("nightly", "run", "--date", "2030-03-04", "--jobs-file", jobs, "--wait")
    assert waited.exit_code == 0, waited.output
    assert "already submitted" in waited.stderr
    assert waited.stdout.startswith("nightly job=vases date=2030-03-04 products=8 written=8 ")
    assert waited.stdout.strip().endswith(f"batches={batch_id}")
    output = jobs.parent / "out" / "vases-2030-03-04.csv"
    assert len(output.read_text().splitlines()) == 9  # header + 8
    stack["dispatcher"].wait(lambda: "nightly job=vases" in stack["dispatcher"].text(), 30)

    assert run("nightly", "run", "--date", "2030-13-01", "--jobs-file", jobs).exit_code == 2
    unknown = run("nightly", "run", "--job", "nope", "--jobs-file", jobs)
    assert unknown.exit_code == 1 and "no nightly job named 'nope'" in unknown.stderr
    os.environ.pop("BATCHGEN_NIGHTLY_JOBS_FILE", None)
    unset = run("nightly", "run")
    assert unset.exit_code == 1 and "BATCHGEN_NIGHTLY_JOBS_FILE" in unset.stderr


def test_servers_start_and_refuse_bad_options(services, simulator, run, folder, restore_env):
    api_port, sim_port, flower_port = free_port(), free_port(), free_port()
    env = {"BATCHGEN_DATA_DIR": str(folder / "data")}
    flower_env = {"BATCHGEN_FLOWER_USER": "ops", "BATCHGEN_FLOWER_PASSWORD": "s3cret"}
    procs = [
        api := start(["api", "--port", str(api_port)], folder, env),
        sim := start(["simulator", "--port", str(sim_port), "--latency-ms", "1"], folder, env),
        beat := start(["beat"], folder, env),
        flower := start(["flower", "--port", str(flower_port)], folder, {**env, **flower_env}),
    ]
    try:

        def answers(url: str, **kw: object) -> Callable[[], bool]:
            def check() -> bool:
                try:
                    return http_client.get(url, timeout=1, **kw).status_code < 500  # type: ignore[arg-type]
                except httpx.TransportError:
                    return False

            return check

        api.wait(answers(f"http://127.0.0.1:{api_port}/healthz"))
        assert http_client.get(f"http://127.0.0.1:{api_port}/healthz").json() == {"ok": True}
        sim.wait(answers(f"http://127.0.0.1:{sim_port}/v1/models"))
        beat.wait(lambda: "beat: Starting" in beat.text())
        flower.wait(answers(f"http://127.0.0.1:{flower_port}/healthcheck"))
        assert http_client.get(f"http://127.0.0.1:{flower_port}/").status_code == 401
        ok = http_client.get(f"http://127.0.0.1:{flower_port}/", auth=("ops", "s3cret"))
        assert ok.status_code == 200
        assert "s3cret" not in flower.text()
    finally:
        for p in procs:
            p.stop()

    for key in ("BATCHGEN_FLOWER_USER", "BATCHGEN_FLOWER_PASSWORD"):
        os.environ.pop(key, None)
    refused = run("flower")
    assert refused.exit_code == 2 and "basic auth" in refused.stderr
    assert run("flower", "--basic-auth", "only-user").exit_code == 2
    unknown_group = run("worker", "--group", "nope")
    assert unknown_group.exit_code == 2 and "unknown group" in unknown_group.stderr
    assert run("simulator", "--charge-mode", "bogus").exit_code == 2
    assert run("demo", "--items", "0").exit_code == 2


def test_demo(services, run, restore_env):
    result = run("demo", "--items", "9")
    assert result.exit_code == 0, result.output
    assert "per-tenant usage" in result.stdout


def test_demo_offload(services, run, restore_env, monkeypatch):
    # Servers of its own, as on a laptop with nothing running: this module's dispatcher
    # (the shipped registry, where nothing offloads) must not take the demo's items.
    for name in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL"):
        monkeypatch.delenv(name, raising=False)
    result = run("demo", "--items", "9", "--offload")
    assert result.exit_code == 0, result.output
    assert "saved against online prices" in result.stdout


def test_usage_and_status(stack, run, tenant, tmp_path):
    requests = tmp_path / "usage.jsonl"
    requests.write_bytes(jsonl([chat_line(f"u-{i}", model="sim-small") for i in range(6)]))
    assert run("submit", requests, "--tenant", tenant, "--wait").exit_code == 0
    rows = json.loads(run("usage", "--tenant", tenant, "--json").stdout)
    assert [(r["model"], r["requests"]) for r in rows] == [("sim-small", 6)]
    with db.session_scope() as s:
        prompt = s.scalar(
            select(func.sum(Result.prompt_tokens))
            .join(Item)
            .join(Tenant, Tenant.id == Item.tenant_id)
            .where(Tenant.name == tenant)
        )
    assert rows[0]["prompt_tokens"] == prompt
    table = run("usage", "--tenant", tenant)
    assert table.exit_code == 0 and "sim-small" in table.stdout
    everyone = json.loads(run("usage", "--group-by", "tenant", "--json").stdout)
    assert tenant in {r["tenant"] for r in everyone}
    assert run("usage", "--tenant", "nobody-here").exit_code == 1
    assert run("usage", "--from", "yesterday").exit_code == 2  # wrong usage
    assert run("usage", "--to", "2026-13-01").exit_code == 2
    status = json.loads(run("status", "--json").stdout)
    assert {m["model"] for m in status["models"]} >= {"sim-small", "sim-large"}
    assert "sim-small" in run("status").stdout
    served = {q["queue"]: q["workers"] for q in status["queues"]}
    assert served["llm.sim"] and served["batchgen.control"]  # which workers serve them
    assert served["llm.sim-large"] == [] and status["warnings"] == []

    # Work for a group no worker consumes: released to its queue, and status says so.
    from batchgen import python_api

    stuck = python_api.submit_batch([chat_line("nobody", model="sim-large")], tenant=tenant)
    waiting = wait_until(
        lambda: (status := json.loads(run("status", "--json").stdout))["warnings"] and status,
        30,
        "the item released",
        0.3,
    )
    assert waiting["warnings"] == [
        "queue llm.sim-large has 1 messages and no worker consuming it: "
        "start `batchgen worker --group sim-large`"
    ]
    shown = run("status")
    assert "no worker consuming it" in shown.stderr
    python_api.cancel_batch(stuck["id"], tenant=tenant)


def test_doctor(stack, run, tmp_path):
    """With the module's worker (group sim) and dispatcher: everything answers, and the
    group without a worker is named with the command to start."""
    result = run("doctor", "--json")
    assert result.exit_code == 1, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    for name in ("configuration", "registry", "database", "redis", "broker"):
        assert checks[name]["ok"], checks[name]
    assert not checks["workers"]["ok"]
    assert "llm.sim-large" in checks["workers"]["found"]
    assert "batchgen worker --group sim-large" in checks["workers"]["fix"]
    assert "llm.sim," not in checks["workers"]["found"] + ","
    providers = [c for name, c in checks.items() if name.startswith("provider ")]
    assert providers and all(c["ok"] for c in providers)
    table = run("doctor")
    assert table.exit_code == 1 and "batchgen worker --group sim-large" in table.stdout

    # A database behind on its migrations: the fix is named.
    from batchgen import embedded
    from batchgen.store import db

    name = "doctor_" + uuid.uuid4().hex[:6]
    url = embedded.ensure_database(os.environ["DATABASE_URL"], name)
    try:
        db.upgrade(url, "0006")
        saved = os.environ["DATABASE_URL"]
        os.environ["DATABASE_URL"] = url
        try:
            stale = {c["name"]: c for c in json.loads(run("doctor", "--json").stdout)}
        finally:
            os.environ["DATABASE_URL"] = saved
        assert (
            not stale["database"]["ok"] and stale["database"]["fix"] == "run `batchgen db upgrade`"
        )
        assert "0006" in stale["database"]["found"]
    finally:
        db.get_engine(url).dispose()
        embedded.drop_database(os.environ["DATABASE_URL"], name)


def test_worker_prefork_pool_is_refused(services, folder):
    """The worker runs the thread pool only; asking for another pool is a usage error,
    never silently replaced (Celery itself swaps an explicit ``-P prefork`` for the
    configured pool)."""
    env = {**os.environ, "BATCHGEN_DATA_DIR": str(folder / "data")}
    commands = [
        [sys.executable, "-m", "batchgen.cli", "worker", "-P", "prefork"],
        [sys.executable, "-m", "batchgen.cli", "worker", "--pool=solo"],
        [sys.executable, "-m", "celery", "-A", "batchgen.tasks", "worker", "-P", "prefork"],
        [sys.executable, "-m", "celery", "-A", "batchgen.tasks", "worker", "--pool=prefork"],
    ]
    running = [  # side by side: each is a process start, the refusals need no order
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for argv in commands
    ]
    for argv, process in zip(commands, running, strict=True):
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for p in running:
                p.kill()
            raise AssertionError(f"{argv[2:]} started a worker instead of refusing") from None
        assert process.returncode == 2, (argv, stdout, stderr)
        assert "pool" in stderr and "threads" in stderr, (argv, stderr)
        assert "ready." not in stdout + stderr


def test_a_database_never_migrated_is_named_with_the_fix(services, run, restore_env):
    """With DATABASE_URL on a database without batchgen's tables, a command says to run
    `batchgen db upgrade` (exit 1), instead of a traceback about a missing relation."""
    from batchgen import embedded

    name = f"batchgen_empty_{os.getpid()}"
    embedded.drop_database(services["server_url"], name)
    os.environ["DATABASE_URL"] = embedded.ensure_database(services["server_url"], name)
    get_settings.cache_clear()
    try:
        for args in (["tenants", "list"], ["tenants", "list", "--json"]):
            result = run(*args)
            assert result.exit_code == 1, result.output
            assert "batchgen db upgrade" in result.stderr and "Traceback" not in result.output
        assert json.loads(result.stdout)["error"]["code"] == "not_migrated"
    finally:
        os.environ["DATABASE_URL"] = services["DATABASE_URL"]
        get_settings.cache_clear()
        embedded.drop_database(services["server_url"], name)  # WITH (FORCE): pooled ones too


def test_budgets_from_the_cli(services, run):
    """A tenant's dollar budget set, shown and removed from the CLI, each change audited."""
    name = "money-" + uuid.uuid4().hex[:6]
    assert run("tenants", "create", name, "--json").exit_code == 0
    made = run(
        "budgets",
        "set",
        name,
        "--limit-usd",
        "2.5",
        "--period",
        "day",
        "--time-zone",
        "Europe/Paris",
        "--thresholds",
        "80,50",
        "--json",
    )
    assert made.exit_code == 0, made.output
    budget = json.loads(made.stdout)
    assert (budget["limit_micros"], budget["thresholds"]) == (2_500_000, [50, 80])
    shown = json.loads(run("budgets", "show", name, "--json").stdout)
    assert [(b["period"], b["used_micros"], b["reserved_micros"]) for b in shown] == [("day", 0, 0)]
    bad = run("budgets", "set", name, "--limit-usd", "1", "--time-zone", "Nowhere/None")
    assert bad.exit_code != 0
    assert run("budgets", "remove", name).exit_code == 0
    assert json.loads(run("budgets", "show", name, "--json").stdout) == []
    actions = [e["action"] for e in json.loads(run("audit", "--tenant", name, "--json").stdout)]
    assert actions.count("budget.set") == 1 and "budget.delete" in actions
