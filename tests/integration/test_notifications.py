"""Batch-finished notifications (app/worker/notify.py, app/worker/webhooks.py,
app/store/batch_notifications.py) on real PostgreSQL, Redis, workers and the simulator: a
Standard Webhooks delivery verified by the ``standardwebhooks`` package, a receiver
that drips its answer, internal targets refused, a host project's Celery task on its
own broker, the callback allow-lists, and a Flask app's own signals."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
from flask import Flask
from sqlalchemy import select as sql_select
from sqlalchemy import text
from standardwebhooks import Webhook

from batchgen import python_api as client
from batchgen.api import create_app
from batchgen.config import get_settings
from batchgen.domain.notifications import ID_HEADER
from batchgen.embedded import RedisServer, free_port
from batchgen.errors import ValidationFailed
from batchgen.integrations.flask import BatchGen, batch_finished
from batchgen.store import db, tenants
from batchgen.store.schema import Batch, BatchNotification
from batchgen.worker import webhooks
from batchgen.worker.notify import deliver_due
from tests.helpers import chat_line, jsonl, make_tenant, wait_batches
from tests.invariants import wait_until
from tests.waiting import hold

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = '["127.0.0.0/8"]'  # the test receivers listen on 127.0.0.1
NOTIFY_ENV = {
    "BATCHGEN_NOTIFY_INTERVAL_S": "0.2",
    "BATCHGEN_NOTIFY_RETRY_FIRST_S": "0.2",
    "BATCHGEN_WEBHOOK_ALLOW_NETS": LOOPBACK,
}


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
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}/hooks/batchgen"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def accepted(self) -> list[tuple[dict[str, str], bytes, int]]:
        return [r for r in self.requests if r[2] == 200]


class DripReceiver:
    """Takes the request, then answers one byte a second of a 100-byte body: a read
    time-out alone never fires. Records when each connection opened and closed."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/drip"
        self.opened: list[float] = []
        self.closed: list[float] = []
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            while len(body) < length:
                body += conn.recv(65536)
            self.opened.append(time.monotonic())
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
            for _ in range(100):
                if self.stop.is_set():
                    break
                readable, _, _ = select.select([conn], [], [], 1.0)
                if readable and conn.recv(1) == b"":
                    break  # the client gave up
                try:
                    conn.sendall(b"x")
                except OSError:
                    break
            self.closed.append(time.monotonic())

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(failures=2)
    yield r
    r.server.shutdown()
    r.server.server_close()


def _set_env(values: dict[str, str]) -> None:
    os.environ.update(values)
    get_settings.cache_clear()


@pytest.fixture
def notify_env(clean_db) -> Iterator[dict[str, str]]:
    saved = dict(os.environ)
    _set_env(NOTIFY_ENV)
    yield NOTIFY_ENV
    os.environ.clear()
    os.environ.update(saved)
    get_settings.cache_clear()


def _hook(batch_id: str, tenant: str) -> dict[str, Any]:
    (hook,) = [
        n for n in client.batch_notifications(batch_id, tenant=tenant) if n["channel"] == "webhook"
    ]
    return hook


def _stored_error(batch_id: str, channel: str = "webhook") -> str | None:
    with db.session_scope() as session:
        return session.scalar(
            sql_select(BatchNotification.last_error).where(
                BatchNotification.batch_id == batch_id, BatchNotification.channel == channel
            )
        )


@pytest.mark.slow
def test_a_webhook_follows_standard_webhooks_and_is_delivered_once_past_two_failures(
    notify_env, simulator, workers, receiver
):
    make_tenant("hooked", webhook_url=receiver.url)
    with db.session_scope() as session:
        _, secret = tenants.set_webhook(session, "hooked")
    batch = client.submit_batch([chat_line(f"w-{i}") for i in range(3)], tenant="hooked")
    workers(env=notify_env)
    wait_batches([batch["id"]], timeout_s=60)
    wait_until(lambda: receiver.accepted(), 30, "a delivery accepted")
    hold(1.5, "several more ticks: nothing is delivered again")

    assert [code for _, _, code in receiver.requests] == [500, 500, 200]
    bodies = {body for _, body, _ in receiver.requests}
    assert len(bodies) == 1  # the same announcement each time
    assert len({h[ID_HEADER] for h, _, _ in receiver.requests}) == 1  # the same webhook-id
    headers, body, _ = receiver.accepted()[0]
    # A receiver using the Standard Webhooks library verifies the real delivery.
    data = Webhook(secret).verify(body, headers)
    assert data["type"] == "batch.finished" and data["batch_id"] == batch["id"]
    assert data["status"] == "completed" and data["request_counts"]["succeeded"] == 3
    with pytest.raises(Exception, match="No matching signature"):
        Webhook(secret).verify(body + b" ", headers)
    assert str(json.loads(body)["id"]) == headers[ID_HEADER]
    assert "Describe" not in body.decode()  # ids and counts, never a prompt
    hook = _hook(batch["id"], "hooked")
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


INTERNAL_URLS = [
    "http://127.0.0.1:6379/x",
    "http://localhost:5432/x",
    "http://2130706433/x",
    "http://[::1]:8080/x",
    "http://169.254.169.254/latest/meta-data/",
    "http://10.1.2.3/x",
]


def test_internal_webhook_targets_are_refused_at_submit_through_every_surface(clean_db):
    key = make_tenant("ssrf")
    api = create_app().test_client()
    app = Flask("ssrf-host")
    ext = BatchGen(app)
    for url in INTERNAL_URLS:
        with pytest.raises(ValidationFailed, match="webhook_url must lead to a public address"):
            client.submit_batch([chat_line("s")], tenant="ssrf", webhook_url=url)
        with app.app_context(), pytest.raises(ValidationFailed, match="public address"):
            ext.submit_batch([chat_line("s")], tenant="ssrf", webhook_url=url)
        res = api.post(
            "/v1/batches",
            query_string={"webhook_url": url},
            data=jsonl([chat_line("s")]),
            content_type="application/jsonl",
            headers={"Authorization": f"Bearer {key}"},
        )
        assert res.status_code == 400, url
        assert "public address" in res.get_json()["error"]["message"]
    with db.session_scope() as session:  # nothing was stored
        assert session.scalar(sql_select(Batch.id).limit(1)) is None


def test_an_internal_target_is_refused_again_at_delivery_and_the_tenant_sees_no_reason(
    notify_env, monkeypatch
):
    # The operator set it (not checked then), or DNS answered a public address at
    # submit and a private one now: the delivery checks again and sends nothing.
    make_tenant("ssrf-late", webhook_url="http://127.0.0.1:6379/x")
    batch = client.submit_batch([chat_line("x")], tenant="ssrf-late")
    client.cancel_batch(batch["id"], tenant="ssrf-late")
    monkeypatch.setenv("BATCHGEN_WEBHOOK_ALLOW_NETS", "[]")
    get_settings.cache_clear()
    report = deliver_due(get_settings())
    assert (report.delivered, report.failed_attempts) == (0, 1)
    hook = _hook(batch["id"], "ssrf-late")
    assert hook["status"] == "pending" and hook["last_error"] == "delivery_failed"
    assert _stored_error(batch["id"]) == "refused_address"  # the operator's view


def test_a_delivery_connects_to_the_address_it_checked(notify_env, receiver, monkeypatch):
    """The host is resolved once, checked, and the connection goes to that address with
    the URL's host in the Host header (a second, rebinding answer is never asked for)."""
    answers = iter(["127.0.0.1", "10.9.9.9"])
    real = socket.getaddrinfo

    def resolver(host: str, *args: Any, **kw: Any) -> Any:
        if host != "hooks.test":
            return real(host, *args, **kw)
        ip = next(answers)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, args[0] if args else 80))]

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    receiver.failures = 0
    url = f"http://hooks.test:{receiver.port}/in"
    assert webhooks.post(url, b"{}", {}, ["127.0.0.0/8"], 5.0) is None
    headers = receiver.requests[0][0]
    assert headers["Host"] == f"hooks.test:{receiver.port}"
    assert webhooks.post(url, b"{}", {}, ["127.0.0.0/8"], 5.0) == "refused_address"
    assert len(receiver.requests) == 1


def test_a_receiver_that_stays_down_loses_nothing(notify_env):
    make_tenant("hook-down", webhook_url="http://127.0.0.1:9/unreachable")
    batch = client.submit_batch([chat_line("x")], tenant="hook-down")
    client.cancel_batch(batch["id"], tenant="hook-down")
    report = deliver_due(get_settings())
    assert (report.delivered, report.failed_attempts) == (0, 1)
    hook = _hook(batch["id"], "hook-down")
    assert hook["status"] == "pending" and hook["last_error"] == "delivery_failed"
    assert _stored_error(batch["id"]) == "unreachable"


@pytest.mark.slow
def test_a_dripping_receiver_is_cut_at_the_deadline_and_stalls_nobody(
    notify_env, simulator, workers
):
    """The dispatcher has one thread: were the delivery on its queue, or the row locked
    while the answer drips, the bystander's batch would wait for the whole drip."""
    from batchgen.registry import get_registry
    from batchgen.worker.names import CONTROL_QUEUE, NOTIFY_QUEUE

    drip = DripReceiver()
    deadline_s = 8
    env = {**notify_env, "BATCHGEN_WEBHOOK_TIMEOUT_S": str(deadline_s)}
    _set_env(env)
    try:
        make_tenant("dripped", webhook_url=drip.url)
        make_tenant("bystander")
        slow = client.submit_batch([chat_line("d")], tenant="dripped")
        client.cancel_batch(slow["id"], tenant="dripped")
        started = [
            workers([CONTROL_QUEUE], concurrency=1, env=env, name="dispatcher", wait=False),
            workers([*get_registry().queues, NOTIFY_QUEUE], beat=False, env=env, wait=False),
        ]
        for worker in started:
            worker.wait_ready()
        wait_until(
            lambda: drip.opened, 30, "the dripped answer opened"
        )  # the delivery is reading the dripped answer now
        other = client.submit_batch([chat_line(f"b-{i}") for i in range(4)], tenant="bystander")
        idle_with_lock = text(
            "SELECT count(*) FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid "
            "WHERE a.state LIKE 'idle in transaction%' "
            "AND a.state_change < now() - interval '1 second' "  # not between two statements
            "AND l.relation = 'batch_notifications'::regclass"
        )
        finished_during_drip = False

        def checked_until_cut() -> bool:  # every 0.2 s while the answer drips
            nonlocal finished_during_drip
            if drip.closed:
                return True
            with db.session_scope() as session:
                assert session.scalar(idle_with_lock) == 0  # nothing held during the send
                # and the row is not locked: another deliverer could take a lapsed lease
                session.execute(
                    text(
                        "SELECT id FROM batch_notifications WHERE batch_id = :b FOR UPDATE NOWAIT"
                    ),
                    {"b": slow["id"]},
                )
                finished = session.scalar(
                    sql_select(Batch.finished_at).where(Batch.id == other["id"])
                )
            finished_during_drip = finished_during_drip or (
                finished is not None and not drip.closed
            )
            return False

        # The client's deadline cuts the drip (how soon: asserted below).
        wait_until(checked_until_cut, deadline_s + 30, "the drip to be cut", poll_s=0.2)
        assert finished_during_drip  # another tenant's batch completed meanwhile
        # The client gave up at its deadline, not after 100 dripped bytes (100 s).
        assert drip.closed[0] - drip.opened[0] < deadline_s + 2
        wait_until(lambda: _stored_error(slow["id"]) == "timeout", 30, "the timeout stored")
        assert _hook(slow["id"], "dripped")["last_error"] == "delivery_failed"
    finally:
        drip.close()


def _host_worker(broker_url: str, calls: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "CELERY_BROKER_URL": broker_url,
        "HOST_CALLBACKS_FILE": str(calls),
        "PYTHONPATH": str(ROOT),
    }
    argv = [sys.executable, "-m", "celery", "-A", "tests.host_callbacks", "worker"]
    argv += ["-Q", "host.callbacks", "-P", "threads", "-c", "1", "--without-mingle"]
    argv += ["--without-gossip", "-n", "host@%h", "--loglevel", "WARNING"]
    return subprocess.Popen(
        argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


CALLBACK_ENV = {
    "BATCHGEN_CALLBACK_TASKS": '["hostapp.batch_done"]',
    "BATCHGEN_CALLBACK_QUEUES": '["host.callbacks"]',
}


@pytest.mark.slow
def test_a_host_celery_task_on_its_own_broker_is_called_once(
    notify_env, simulator, workers, tmp_path
):
    host_redis = RedisServer(port=free_port(), directory=tmp_path / "host-redis").start()
    calls = tmp_path / "callbacks.jsonl"
    env = {**notify_env, **CALLBACK_ENV, "BATCHGEN_CALLBACK_BROKER_URL": host_redis.url}
    _set_env(env)
    host = _host_worker(host_redis.url, calls)
    try:
        make_tenant("called")
        batch = client.submit_batch(
            [chat_line(f"c-{i}") for i in range(2)],
            tenant="called",
            on_finished="hostapp.batch_done",
            on_finished_queue="host.callbacks",
        )
        workers(env=env)
        wait_batches([batch["id"]], timeout_s=60)
        wait_until(lambda: calls.exists() and calls.read_text().strip(), 60, "the host task called")
        hold(1.5, "several more ticks: the host task is not called again")
        lines = [json.loads(x) for x in calls.read_text().splitlines()]
        # Nothing went to (or waits on) batchgen's own broker.
        ours = redis.Redis.from_url(get_settings().broker_url)
        assert ours.llen("host.callbacks") == 0
    finally:
        host.terminate()
        host.wait(15)
        host_redis.stop()
    assert lines == [{"batch_id": batch["id"], "status": "completed", "counts": lines[0]["counts"]}]
    assert lines[0]["counts"]["succeeded"] == 2 and lines[0]["counts"]["total"] == 2
    calls_row = next(
        n
        for n in client.batch_notifications(batch["id"], tenant="called")
        if n["channel"] == "celery"
    )
    assert calls_row["status"] == "delivered"


@pytest.mark.parametrize(
    ("task", "queue", "message"),
    [
        ("hostproj.tasks.delete_account", None, "is not one of the tasks"),
        ("batchgen.generate", None, "is not one of the tasks"),
        ("batchgen.nightly", None, "is not one of the tasks"),
        ("hostapp.batch_done", "a.brand.new.queue", "is not one of the queues"),
    ],
)
def test_on_finished_names_only_allowed_tasks_and_queues_on_every_surface(
    notify_env, task, queue, message
):
    _set_env(CALLBACK_ENV)
    key = make_tenant("callback-" + task.replace(".", "-") + str(queue))
    name = "callback-" + task.replace(".", "-") + str(queue)
    told = {"on_finished": task, **({"on_finished_queue": queue} if queue else {})}
    with pytest.raises(ValidationFailed, match=message):
        client.submit_batch([chat_line("x")], tenant=name, **told)
    app = Flask("callback-host")
    ext = BatchGen(app)
    with app.app_context(), pytest.raises(ValidationFailed, match=message):
        ext.submit_batch([chat_line("x")], tenant=name, **told)
    res = (
        create_app()
        .test_client()
        .post(
            "/v1/batches",
            query_string=told,
            data=jsonl([chat_line("x")]),
            content_type="application/jsonl",
            headers={"Authorization": f"Bearer {key}"},
        )
    )
    assert res.status_code == 400 and message in res.get_json()["error"]["message"]
    with db.session_scope() as session:
        assert session.scalar(sql_select(Batch.id).limit(1)) is None


def test_on_finished_is_refused_until_the_operator_lists_tasks(notify_env):
    make_tenant("no-callbacks")
    with pytest.raises(ValidationFailed, match="BATCHGEN_CALLBACK_TASKS") as refused:
        client.submit_batch([chat_line("x")], tenant="no-callbacks", on_finished="hostapp.done")
    assert refused.value.status_code == 400


def test_flask_signals_reach_only_their_app_once(notify_env, monkeypatch):
    monkeypatch.setattr(client, "_origin_sources", [])  # no Django site of another test
    threads_before = {t.name for t in threading.enumerate()}
    shop = Flask("shop")
    shop.config["BATCHGEN_SIGNAL_POLL_S"] = 0.1  # honoured by the command only
    shop_ext = BatchGen(shop)
    blog = Flask("blog")
    blog.config["BATCHGEN_APP_ID"] = "blog-site"
    blog_ext = BatchGen(blog)
    assert {t.name for t in threading.enumerate()} <= threads_before  # no poller started
    got: dict[str, list[dict[str, Any]]] = {"shop": [], "shop-2": [], "blog": []}

    def failing(sender: Flask, **payload: Any) -> None:
        raise RuntimeError("one receiver fails")

    def shop_receiver(sender: Flask, **payload: Any) -> None:
        got["shop"].append(payload)

    def shop_receiver_2(sender: Flask, **payload: Any) -> None:
        got["shop-2"].append(payload)

    def blog_receiver(sender: Flask, **payload: Any) -> None:
        got["blog"].append(payload)

    batch_finished.connect(failing, sender=shop)
    batch_finished.connect(shop_receiver, sender=shop)
    batch_finished.connect(shop_receiver_2, sender=shop)
    batch_finished.connect(blog_receiver, sender=blog)
    key = make_tenant("signalled")
    try:
        with shop.app_context():  # the Python API inside the app
            in_shop = shop_ext.submit_batch([chat_line("s")], tenant="signalled")
        res = blog.test_client().post(  # HTTP through the blog's mount
            "/batchgen/v1/batches",
            data=jsonl([chat_line("b")]),
            content_type="application/jsonl",
            headers={"Authorization": f"Bearer {key}"},
        )
        in_blog = res.get_json()
        outside = client.submit_batch([chat_line("o")], tenant="signalled")  # standalone
        for b in (in_shop, in_blog, outside):
            client.cancel_batch(b["id"], tenant="signalled")
        with db.session_scope() as session:
            origins = dict(session.execute(sql_select(Batch.id, Batch.origin)).all())
        assert origins == {in_shop["id"]: "shop", in_blog["id"]: "blog-site", outside["id"]: None}
        signals = [
            n["channel"] for n in client.batch_notifications(outside["id"], tenant="signalled")
        ]
        assert "signal" not in signals  # a standalone batch fires no host signal

        runner = shop.test_cli_runner()
        result = runner.invoke(args=["batchgen", "signals"])
        assert result.exit_code == 0 and "1 batch_finished signals sent" in result.output
        assert runner.invoke(args=["batchgen", "signals"]).output.startswith("0 ")
        assert blog_ext.deliver_signals(blog) == 1
        assert blog_ext.deliver_signals(blog) == 0
    finally:
        for r, app in ((failing, shop), (shop_receiver, shop), (shop_receiver_2, shop)):
            batch_finished.disconnect(r, sender=app)
        batch_finished.disconnect(blog_receiver, sender=blog)
    # Each app got its own batch, once, although one of the shop's receivers raised.
    assert [p["batch_id"] for p in got["shop"]] == [in_shop["id"]]
    assert [p["batch_id"] for p in got["shop-2"]] == [in_shop["id"]]
    assert [p["batch_id"] for p in got["blog"]] == [in_blog["id"]]
    (signal,) = [
        n
        for n in client.batch_notifications(in_shop["id"], tenant="signalled")
        if n["channel"] == "signal"
    ]
    assert (signal["status"], signal["attempts"]) == ("delivered", 1)


def test_old_announcements_are_swept(notify_env, monkeypatch):
    from sqlalchemy import func

    from batchgen.store import batch_notifications

    monkeypatch.setattr(client, "_origin_sources", [])  # no host app: no signal row
    make_tenant("swept", webhook_url="http://127.0.0.1:9/x")
    batch = client.submit_batch([chat_line("x")], tenant="swept")
    client.cancel_batch(batch["id"], tenant="swept")
    with db.session_scope() as session:
        assert batch_notifications.delete_old(session, retention_s=3600) == 0
        assert batch_notifications.delete_old(session, retention_s=0) == 1  # the webhook's
        left = session.scalar(sql_select(func.count()).select_from(BatchNotification))
    assert left == 0


def test_a_lapsed_lease_makes_a_send_due_again_and_the_late_sender_records_nothing(notify_env):
    from batchgen.domain.notifications import Channel
    from batchgen.store import batch_notifications

    make_tenant("leased", webhook_url="http://127.0.0.1:9/x")
    batch = client.submit_batch([chat_line("x")], tenant="leased")
    client.cancel_batch(batch["id"], tenant="leased")
    with db.session_scope() as session:
        first = batch_notifications.claim_send(session, [Channel.WEBHOOK], lease_s=0.3)
    with db.session_scope() as session:  # leased: nobody else takes it
        assert batch_notifications.claim_send(session, [Channel.WEBHOOK], lease_s=0.3) is None

    def claim_again() -> object:  # the first deliverer died mid-send: its lease runs out
        with db.session_scope() as session:
            return batch_notifications.claim_send(session, [Channel.WEBHOOK], lease_s=30)

    second = wait_until(claim_again, 10, "the lapsed lease's send due again")
    assert first is not None and second is not None and second.id == first.id
    assert second.attempts == first.attempts + 1
    with db.session_scope() as session:
        assert batch_notifications.record(session, first, None, 1.0) is None  # no longer its claim
        assert batch_notifications.record(session, second, None, 1.0) == "delivered"
    assert _hook(batch["id"], "leased")["status"] == "delivered"
