"""Batch-finished notifications (app/worker/notify.py, app/store/notifications.py): a
signed webhook delivered once past a receiver that failed twice, a host project's
Celery task called once, a Flask signal, all on real PostgreSQL, Redis, workers and
the simulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from flask import Flask

from batchgen import python_api as client
from batchgen.config import get_settings
from batchgen.domain.notifications import ID_HEADER, SIGNATURE_HEADER, verify
from batchgen.errors import ValidationFailed
from batchgen.integrations.flask import BatchGen, batch_finished
from batchgen.store import db, tenants
from batchgen.worker.notify import deliver_due
from tests.helpers import chat_line, make_tenant, wait_batches

ROOT = Path(__file__).resolve().parents[2]
NOTIFY_ENV = {"BATCHGEN_NOTIFY_INTERVAL_S": "0.2", "BATCHGEN_NOTIFY_RETRY_FIRST_S": "0.2"}


class Receiver:
    """A webhook receiver on a free port: answers ``failures`` 500s, then 200s."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.requests: list[tuple[dict[str, str], bytes, int]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                code = 500 if len(receiver.requests) < receiver.failures else 200
                receiver.requests.append((dict(self.headers), body, code))
                self.send_response(code)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/batchgen"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def accepted(self) -> list[tuple[dict[str, str], bytes, int]]:
        return [r for r in self.requests if r[2] == 200]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(failures=2)
    yield r
    r.server.shutdown()
    r.server.server_close()


@pytest.fixture
def notify_env(clean_db) -> Iterator[dict[str, str]]:
    saved = dict(os.environ)
    os.environ.update(NOTIFY_ENV)
    get_settings.cache_clear()
    yield NOTIFY_ENV
    os.environ.clear()
    os.environ.update(saved)
    get_settings.cache_clear()


def _wait(condition: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_webhook_is_signed_and_delivered_once_past_two_failures(
    notify_env, simulator, workers, receiver
):
    make_tenant("hooked", webhook_url=receiver.url)
    with db.session_scope() as session:
        _, secret = tenants.set_webhook(session, "hooked")
    batch = client.submit_batch([chat_line(f"w-{i}") for i in range(3)], tenant="hooked")
    workers(env=notify_env)
    wait_batches([batch["id"]], timeout_s=60)
    _wait(lambda: receiver.accepted())
    time.sleep(1.5)  # several more ticks: nothing is delivered again

    assert [code for _, _, code in receiver.requests] == [500, 500, 200]
    bodies = {body for _, body, _ in receiver.requests}
    assert len(bodies) == 1  # the same announcement each time
    headers, body, _ = receiver.accepted()[0]
    assert verify(secret, headers[SIGNATURE_HEADER], body, time.time())
    assert not verify(secret, headers[SIGNATURE_HEADER], body + b" ", time.time())
    assert not verify(secret, headers[SIGNATURE_HEADER], body, time.time() + 3600)  # a replay
    data = json.loads(body)
    assert data["type"] == "batch.finished" and data["batch_id"] == batch["id"]
    assert data["status"] == "completed" and data["request_counts"]["succeeded"] == 3
    assert str(data["id"]) == headers[ID_HEADER]
    assert "Describe" not in body.decode()  # ids and counts, never a prompt
    seen = client.batch_notifications(batch["id"], tenant="hooked")
    hook = next(n for n in seen if n["channel"] == "webhook")
    assert (hook["status"], hook["attempts"], hook["last_error"]) == ("delivered", 3, None)
    assert hook["target"] == receiver.url


def test_a_batchs_own_webhook_and_bad_targets(notify_env, receiver):
    make_tenant("hook-own")
    receiver.failures = 0
    batch = client.submit_batch([chat_line("x")], tenant="hook-own", webhook_url=receiver.url)
    client.cancel_batch(batch["id"], tenant="hook-own")  # finished at once
    assert deliver_due(get_settings()).delivered == 1
    assert deliver_due(get_settings()).delivered == 0
    assert json.loads(receiver.requests[0][1])["status"] == "cancelled"
    for bad in ("ftp://example.com/x", "not a url"):
        with pytest.raises(ValidationFailed, match="webhook_url must be an http"):
            client.submit_batch([chat_line("y")], tenant="hook-own", webhook_url=bad)
    with pytest.raises(ValidationFailed, match="on_finished must be a Celery task name"):
        client.submit_batch([chat_line("y")], tenant="hook-own", on_finished="not a task")


def test_a_receiver_that_stays_down_loses_nothing(notify_env):
    make_tenant("hook-down", webhook_url="http://127.0.0.1:9/unreachable")
    batch = client.submit_batch([chat_line("x")], tenant="hook-down")
    client.cancel_batch(batch["id"], tenant="hook-down")
    report = deliver_due(get_settings())
    assert (report.delivered, report.failed_attempts) == (0, 1)
    (hook,) = [
        n
        for n in client.batch_notifications(batch["id"], tenant="hook-down")
        if n["channel"] == "webhook"
    ]
    assert hook["status"] == "pending" and hook["last_error"].startswith("unreachable")


def test_a_host_celery_task_is_called_once(notify_env, simulator, workers, tmp_path):
    calls = tmp_path / "callbacks.jsonl"
    env = {
        **os.environ,
        "CELERY_BROKER_URL": get_settings().broker_url,
        "HOST_CALLBACKS_FILE": str(calls),
        "PYTHONPATH": str(ROOT),
    }
    host = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.host_callbacks",
            "worker",
            "-Q",
            "host.callbacks",
            "-P",
            "threads",
            "-c",
            "1",
            "--without-mingle",
            "--without-gossip",
            "-n",
            "host@%h",
            "--loglevel",
            "WARNING",
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        make_tenant("called")
        batch = client.submit_batch(
            [chat_line(f"c-{i}") for i in range(2)],
            tenant="called",
            on_finished="hostapp.batch_done",
            on_finished_queue="host.callbacks",
        )
        workers(env=notify_env)
        wait_batches([batch["id"]], timeout_s=60)
        _wait(lambda: calls.exists() and calls.read_text().strip(), timeout_s=60)
        time.sleep(1.5)
        lines = [json.loads(x) for x in calls.read_text().splitlines()]
    finally:
        host.terminate()
        host.wait(15)
    assert lines == [
        {
            "batch_id": batch["id"],
            "status": "completed",
            "counts": lines[0]["counts"],
        }
    ]
    assert lines[0]["counts"]["succeeded"] == 2 and lines[0]["counts"]["total"] == 2


def test_a_flask_app_receives_its_signal_at_least_once(notify_env):
    app = Flask("host")
    ext = BatchGen(app)
    got: list[dict[str, Any]] = []
    fail_once = {"left": 1}

    @batch_finished.connect_via(app)
    def on_finished(sender: Flask, **payload: Any) -> None:
        if fail_once["left"]:
            fail_once["left"] -= 1
            raise RuntimeError("the receiver fails once")
        got.append(payload)

    make_tenant("signalled")
    batch = client.submit_batch([chat_line("s")], tenant="signalled")
    client.cancel_batch(batch["id"], tenant="signalled")
    assert ext.deliver_signals(app) == 0  # the receiver raised: kept for later
    (signal,) = [
        n
        for n in client.batch_notifications(batch["id"], tenant="signalled")
        if n["channel"] == "signal"
    ]
    assert signal["last_error"] == "handler:RuntimeError" and signal["status"] == "pending"
    time.sleep(0.3)  # its retry time (BATCHGEN_NOTIFY_RETRY_FIRST_S)
    assert ext.deliver_signals(app) == 1
    assert ext.deliver_signals(app) == 0
    assert [(p["batch_id"], p["status"]) for p in got] == [(batch["id"], "cancelled")]
    batch_finished.disconnect(on_finished, sender=app)


def test_old_announcements_are_swept(notify_env):
    from sqlalchemy import func, select

    from batchgen.store import notifications
    from batchgen.store.schema import BatchNotification

    make_tenant("swept")
    batch = client.submit_batch([chat_line("x")], tenant="swept")
    client.cancel_batch(batch["id"], tenant="swept")
    with db.session_scope() as session:
        assert notifications.delete_old(session, retention_s=3600) == 0
        assert notifications.delete_old(session, retention_s=0) == 1  # the signal
        left = session.scalar(select(func.count()).select_from(BatchNotification))
    assert left == 0
