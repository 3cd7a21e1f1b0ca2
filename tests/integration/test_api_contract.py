"""The API's contract under bad input and failures: JSON errors, honest answers,
no lock held across a network call, idempotency keys bound to one request,
nothing of a request in a log (issue 10, cases 12-28 of the API)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from urllib.parse import urlsplit

import pytest
from sqlalchemy import func, select

from batchgen import python_api as client
from batchgen.api import create_app
from batchgen.config import get_settings
from batchgen.errors import OverQuota
from batchgen.store import db
from batchgen.store.schema import Batch, Item, Tenant
from tests.helpers import chat_line, jsonl, make_tenant, wait_batches
from tests.tcp_proxy import TcpProxy
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

SECRET = "Confidential merger with Initech"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _stored() -> tuple[int, int]:
    with db.session_scope() as s:
        return (
            s.scalar(select(func.count()).select_from(Batch)),
            s.scalar(select(func.count()).select_from(Item)),
        )


def _batches_of(tenant: str) -> int:
    with db.session_scope() as s:
        return s.scalar(
            select(func.count())
            .select_from(Batch)
            .join(Tenant, Tenant.id == Batch.tenant_id)
            .where(Tenant.name == tenant)
        )


@pytest.fixture
def celery_configured(clean_db: dict[str, str]) -> None:
    """Load the Celery app's configuration now: it reads the settings once, and the
    test below points them at another Redis for a while."""
    from batchgen.tasks.celery_app import celery_app

    assert celery_app.conf.broker_url


def test_refused_submit_does_not_hold_the_admission_lock_across_redis(
    clean_db, celery_configured, monkeypatch
):
    """Case 12: the rejection counter is written after the rollback, so a slow Redis
    delays only the refused caller, never another tenant's valid submit."""
    make_tenant("capped", max_pending_items=1)
    make_tenant("valid")
    target = urlsplit(clean_db["REDIS_URL"])
    with TcpProxy(target.hostname or "127.0.0.1", target.port or 6379) as proxy:
        slow_url = f"redis://127.0.0.1:{proxy.port}{target.path}?socket_timeout=120"
        monkeypatch.setattr(get_settings().redis, "url", slow_url)
        proxy.hold.set()
        refused: list[BaseException] = []

        def refuse() -> None:
            try:
                client.submit_batch([chat_line("r1"), chat_line("r2")], tenant="capped")
            except OverQuota as exc:
                refused.append(exc)

        first = threading.Thread(target=refuse)
        first.start()
        assert proxy.held.wait(30), "the refused submit never wrote to Redis"
        second = threading.Thread(
            target=client.submit_batch,
            args=([chat_line("v1")],),
            kwargs={"tenant": "valid"},
            daemon=True,
        )
        second.start()
        try:
            # The refused submit is stuck in Redis right now; the valid one must commit anyway.
            stored = wait_until(
                lambda: _batches_of("valid") == 1,
                30,
                "a valid submit stored while another tenant's Redis write is stuck",
            )
            still_held = first.is_alive()
        finally:
            proxy.release.set()
            first.join(60)
            second.join(60)
    assert stored, "a valid submit waited for another tenant's Redis write"
    assert still_held
    assert len(refused) == 1
    assert _batches_of("capped") == 0


def test_submit_answer_survives_a_failing_dispatcher_wakeup(clean_db, tmp_path):
    """Case 14: once the batch is committed, a failing wake-up (the broker down) never
    turns the answer into an error; in a host project with its own ``tasks`` module
    the wake-up (``batchgen.tasks``) is not shadowed."""
    make_tenant("host")
    script = (
        "import json\n"
        "from batchgen import python_api as client\n"
        "rows = [{'custom_id': 'a', 'method': 'POST', 'url': '/v1/chat/completions',\n"
        "         'body': {'model': 'sim-small', 'max_tokens': 5,\n"
        "                  'messages': [{'role': 'user', 'content': 'hi'}]}}]\n"
        "print(json.dumps(client.submit_batch(rows, tenant='host')))\n"
    )
    host = tmp_path / "host_project"
    host.mkdir()
    (host / "tasks.py").write_text("# the host project's own Celery tasks\n")
    env = {**os.environ, "BATCHGEN_LOG_LEVEL": "WARNING"}
    runs = [
        (host, env),  # `tasks` is the host's module, the wake-up is batchgen.tasks'
        (tmp_path, {**env, "CELERY_BROKER_URL": "redis://127.0.0.1:1/0"}),  # broker down
    ]
    ids = []
    for cwd, run_env in runs:
        done = subprocess.run(
            [sys.executable, "-c", script],
            cwd=cwd,
            env=run_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        ids.append(json.loads(done.stdout.splitlines()[-1])["id"])
    assert _batches_of("host") == 2 and len(set(ids)) == 2


def test_idempotency_key_reused_with_a_different_request_is_422(clean_db):
    """Case 15: a key names one request; another body or other parameters under the
    same key are refused (IETF Idempotency-Key draft), and validation is never skipped."""
    api = create_app().test_client()
    key = make_tenant("acme")
    headers = {**_auth(key), "Idempotency-Key": "order-42"}
    body = jsonl([chat_line("a"), chat_line("b")])
    first = api.post("/v1/batches?priority=bulk", data=body, headers=headers)
    assert first.status_code == 200

    other_body = api.post(
        "/v1/batches?priority=bulk", data=jsonl([chat_line("a")]), headers=headers
    )
    assert other_body.status_code == 422, other_body.json
    assert other_body.json["error"]["code"] == "idempotency_key_reused"
    assert "order-42" in other_body.json["error"]["message"]
    other_params = api.post("/v1/batches?priority=interactive", data=body, headers=headers)
    assert other_params.status_code == 422
    invalid = api.post("/v1/batches?priority=bulk", data=b"{oops\n", headers=headers)
    assert invalid.status_code == 400 and invalid.json["error"]["line"] == 1
    bad_window = api.post(
        "/v1/batches?priority=bulk&completion_window=soon", data=body, headers=headers
    )
    assert bad_window.status_code == 400

    # The same request again: the same batch, however its JSON is spelled.
    respelled = b"\r\n".join(
        json.dumps(row, indent=None, separators=(", ", " : ")).encode()
        for row in (chat_line("a"), chat_line("b"))
    )
    replay = api.post("/v1/batches?priority=bulk", data=respelled, headers=headers)
    assert replay.status_code == 200 and replay.json["id"] == first.json["id"]
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert _stored() == (1, 2)

    from batchgen.errors import IdempotencyKeyReused

    client.submit_batch([chat_line("p")], tenant="acme", idempotency_key="py-1", metadata={"a": 1})
    with pytest.raises(IdempotencyKeyReused):
        client.submit_batch(
            [chat_line("p")], tenant="acme", idempotency_key="py-1", metadata={"a": 2}
        )


def test_every_error_is_json(clean_db, monkeypatch):
    """Case 16: unknown paths, wrong methods and unexpected failures answer JSON in the
    documented shape, never an HTML page."""
    api = create_app().test_client()
    key = make_tenant("acme")
    missing = api.get("/v1/nothing-here", headers=_auth(key))
    assert missing.status_code == 404 and missing.is_json
    assert missing.json["error"]["code"] == "not_found"
    wrong = api.delete("/v1/batches", headers=_auth(key))
    assert wrong.status_code == 405 and wrong.is_json
    assert wrong.json["error"]["code"] == "method_not_allowed"
    assert "POST" in wrong.headers["Allow"]

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"bug while reading {SECRET}")

    monkeypatch.setattr(client, "get_batch", broken)
    failed = api.get("/v1/batches/batch_0123", headers=_auth(key))
    assert failed.status_code == 500 and failed.is_json
    assert failed.json == {"error": {"code": "internal", "message": "internal error"}}


def test_flask_extension_errors_are_json_under_its_prefix_only(clean_db, monkeypatch):
    """Case 16 under the Flask extension: JSON below the prefix, the host's pages elsewhere."""
    from flask import Flask

    from batchgen.integrations.flask import BatchGen

    key = make_tenant("acme")
    host = Flask("host")
    host.config["BATCHGEN_URL_PREFIX"] = "/llm"
    BatchGen(host)

    @host.get("/page")
    def page() -> str:
        return "<p>host page</p>"

    web = host.test_client()
    missing = web.get("/llm/v1/nothing-here", headers=_auth(key))
    assert missing.status_code == 404 and missing.json["error"]["code"] == "not_found"
    wrong = web.put("/llm/v1/batches", headers=_auth(key))
    assert wrong.status_code == 405 and wrong.json["error"]["code"] == "method_not_allowed"
    host_missing = web.get("/elsewhere")
    assert host_missing.status_code == 404 and not host_missing.is_json  # the host's own page
    assert web.get("/page").data == b"<p>host page</p>"

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(client, "list_batches_page", broken)
    failed = web.get("/llm/v1/batches", headers=_auth(key))
    assert failed.status_code == 500 and failed.json["error"]["code"] == "internal"


def test_has_more_is_false_on_an_exactly_full_last_page(clean_db):
    """Case 17."""
    api = create_app().test_client()
    key = make_tenant("acme")
    ids = [
        api.post("/v1/batches", data=jsonl([chat_line(f"c{i}")]), headers=_auth(key)).json["id"]
        for i in range(4)
    ]
    full = api.get("/v1/batches?limit=4", headers=_auth(key)).json
    assert [b["id"] for b in full["data"]] == ids[::-1]
    assert full["has_more"] is False
    page1 = api.get("/v1/batches?limit=2", headers=_auth(key)).json
    assert page1["has_more"] is True
    page2 = api.get(f"/v1/batches?limit=2&after={page1['last_id']}", headers=_auth(key)).json
    assert [b["id"] for b in page2["data"]] == ids[1::-1]
    assert page2["has_more"] is False
    assert client.list_batches(tenant="acme", limit=2) == page1["data"]


def _deadline_passed(batch_id: str, custom_id: str | None = None) -> bool:
    """True when the batch's items (or the one named) are past their deadline."""
    where = [Item.batch_id == batch_id, Item.deadline_at > func.now()]
    if custom_id is not None:
        where.append(Item.custom_id == custom_id)
    with db.session_scope() as s:
        return s.scalar(select(func.count()).select_from(Item).where(*where)) == 0


def _sweep() -> None:
    from batchgen.worker.sweep import sweep

    with db.session_scope() as session:
        sweep(session, get_settings())


def test_batch_whose_items_all_expired_ends_expired(clean_db):
    """Case 18: nothing ran, everything expired: the batch says ``expired``."""
    api = create_app().test_client()
    key = make_tenant("late")
    rows = jsonl([chat_line(f"e{i}") for i in range(3)])
    res = api.post("/v1/batches?completion_window=200ms", data=rows, headers=_auth(key))
    batch_id = res.json["id"]
    wait_until(lambda: _deadline_passed(batch_id), 10, "the deadline passed")
    _sweep()
    info = api.get(f"/v1/batches/{batch_id}", headers=_auth(key)).json
    assert info["status"] == "expired"
    assert info["request_counts"]["expired"] == 3 and info["finished_at"] is not None


def test_partly_expired_batch_completes_and_counts_the_expired(clean_db, simulator, workers):
    """Case 18: some items ran: ``completed``, with the expired ones in ``request_counts``."""
    api = create_app().test_client()
    key = make_tenant("mixed")
    rows = [chat_line("e0"), chat_line("ok1"), chat_line("ok2")]
    rows[0]["timeout"] = "200ms"
    batch_id = api.post("/v1/batches", data=jsonl(rows), headers=_auth(key)).json["id"]
    wait_until(lambda: _deadline_passed(batch_id, custom_id="e0"), 10, "e0's deadline passed")
    _sweep()  # expires e0, whose own deadline passed; the others have a day
    workers(concurrency=2)
    wait_batches([batch_id], timeout_s=60)
    info = api.get(f"/v1/batches/{batch_id}", headers=_auth(key)).json
    assert info["status"] == "completed"
    counts = info["request_counts"]
    assert (counts["expired"], counts["succeeded"], counts["total"]) == (1, 2, 3)


def test_nul_character_is_refused_before_the_database_and_never_logged(clean_db, caplog):
    """Case 23: ``\\u0000`` (legal JSON, refused by jsonb) is a 400 that names the line
    and field; no request text reaches a log, and odd ids are plain 400/404s."""
    caplog.set_level(logging.DEBUG)
    api = create_app().test_client()
    key = make_tenant("acme")
    nul_prompt = jsonl([chat_line("ok"), chat_line("nul", text=f"{SECRET} \u0000 tail")])
    res = api.post("/v1/batches", data=nul_prompt, headers=_auth(key))
    assert res.status_code == 400, res.json
    assert res.json["error"]["line"] == 2
    assert res.json["error"]["param"] == "body.messages[0].content"
    surrogate = json.dumps(chat_line("s", text="x")).replace('"x"', '"\\ud800"').encode()
    assert api.post("/v1/batches", data=surrogate, headers=_auth(key)).status_code == 400
    meta = json.dumps({"note": f"{SECRET} \u0000"})
    res = api.post(f"/v1/batches?metadata={meta}", data=jsonl([chat_line("m")]), headers=_auth(key))
    assert res.status_code == 400 and res.json["error"]["param"] == "metadata"
    assert _stored() == (0, 0)

    after = api.get("/v1/batches?after=%00", headers=_auth(key))
    assert after.status_code == 400 and after.json["error"]["param"] == "after"
    assert api.get("/v1/batches/%00", headers=_auth(key)).status_code == 404
    assert api.post("/v1/batches/%00/cancel", headers=_auth(key)).status_code == 404
    nul_key = {**_auth(key), "Idempotency-Key": "k\x00"}
    assert api.post("/v1/batches", data=jsonl([chat_line("k")]), headers=nul_key).status_code == 400
    with pytest.raises(Exception) as info:
        client.submit_batch([chat_line("t")], tenant="acme\x00")
    assert getattr(info.value, "status_code", None) == 404
    logged = "\n".join(r.getMessage() + str(r.exc_info) for r in caplog.records)
    assert SECRET not in logged


def test_submit_while_postgres_is_down_is_json_503(clean_db, monkeypatch):
    """Case 24: PostgreSQL unreachable → 503 JSON with Retry-After, not an HTML 500."""
    api = create_app().test_client()
    key = make_tenant("acme")
    monkeypatch.setattr(get_settings().database, "url", "postgresql://postgres@127.0.0.1:1/down")
    res = api.post("/v1/batches", data=jsonl([chat_line("a")]), headers=_auth(key))
    assert res.status_code == 503, res.data[:200]
    assert res.json["error"]["code"] == "database_unavailable"
    assert int(res.headers["Retry-After"]) >= 1


def test_metrics_and_status_while_redis_is_down_are_json_503(
    clean_db, celery_configured, monkeypatch
):
    """Case 24: Redis unreachable → /metrics and /v1/status answer 503 JSON with Retry-After."""
    api = create_app().test_client()
    admin = make_tenant("ops", is_admin=True)
    monkeypatch.setattr(get_settings().redis, "url", "redis://127.0.0.1:1/0")
    for path in ("/metrics", "/v1/status"):
        res = api.get(path, headers=_auth(admin))
        assert res.status_code == 503, (path, res.data[:200])
        assert res.json["error"]["code"] == "redis_unavailable"
        assert int(res.headers["Retry-After"]) >= 1


def test_admin_key_reads_but_cannot_cancel_another_tenants_batch(clean_db):
    """Case 27: admin keys read every tenant's batches; a cancel is the owner's alone."""
    api = create_app().test_client()
    owner = make_tenant("owner")
    admin = make_tenant("ops", is_admin=True)
    batch_id = api.post("/v1/batches", data=jsonl([chat_line("a")]), headers=_auth(owner)).json[
        "id"
    ]
    assert api.get(f"/v1/batches/{batch_id}", headers=_auth(admin)).status_code == 200
    assert api.get(f"/v1/batches/{batch_id}/results", headers=_auth(admin)).status_code == 200
    res = api.post(f"/v1/batches/{batch_id}/cancel", headers=_auth(admin))
    assert res.status_code == 404 and res.json["error"]["code"] == "not_found"
    assert api.get(f"/v1/batches/{batch_id}", headers=_auth(owner)).json["status"] == "in_progress"
    own = api.post(f"/v1/batches/{batch_id}/cancel", headers=_auth(owner))
    assert own.status_code == 200 and own.json["status"] == "cancelled"


def test_metrics_need_the_token_or_an_admin_key(clean_db, monkeypatch):
    """Case 28: /metrics names tenants and their usage, so it is never open."""
    api = create_app().test_client()
    tenant = make_tenant("acme")
    admin = make_tenant("ops", is_admin=True)
    monkeypatch.setattr(get_settings().api, "metrics_token", None)
    assert api.get("/metrics").status_code == 401
    assert api.get("/metrics", headers=_auth(tenant)).status_code == 403
    assert api.get("/metrics", headers=_auth(admin)).status_code == 200
    monkeypatch.setattr(get_settings().api, "metrics_token", "scrape-secret-1")
    assert api.get("/metrics", headers=_auth("scrape-secret-1")).status_code == 200
    assert api.get("/metrics", headers=_auth("scrape-secret-2")).status_code == 401
    assert api.get("/metrics").status_code == 401


def test_access_log_records_no_query_string(clean_db, caplog):
    """Case 28: the HTTP server's access log keeps the path, never the query string
    (``metadata`` travels there)."""
    import urllib.request

    from werkzeug.serving import make_server

    caplog.set_level(logging.INFO, logger="werkzeug")
    server = make_server("127.0.0.1", 0, create_app(), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = (
            f"http://127.0.0.1:{server.server_port}/healthz?metadata=%7B%22n%22%3A%22{SECRET}%22%7D"
        )
        with urllib.request.urlopen(url.replace(" ", "%20")) as res:
            assert res.status == 200
        wait_until(
            lambda: any("/healthz" in r.getMessage() for r in caplog.records), 5, "the log line"
        )
    finally:
        server.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == "werkzeug"]
    assert any("GET /healthz" in line for line in lines)
    assert not any("metadata" in line or "Initech" in line for line in lines)


def test_database_error_text_never_reaches_a_log(clean_db):
    """Case 23: PostgreSQL quotes the offending data in its error (``CONTEXT: JSON
    data …``); a logged database error keeps only its class and SQLSTATE."""
    import io

    from sqlalchemy import text
    from sqlalchemy.exc import DataError

    from batchgen.logs import DatabaseErrorRedactor

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(DatabaseErrorRedactor())
    logger = logging.getLogger("tests.redaction")
    logger.addHandler(handler)
    try:
        with pytest.raises(DataError) as info, db.session_scope() as s:
            s.execute(text("SELECT CAST(:doc AS jsonb)"), {"doc": json.dumps({"p": SECRET + "\0"})})
        assert SECRET in str(info.value)  # what would have been logged
        try:
            raise RuntimeError("storing the result failed") from info.value
        except RuntimeError:
            logger.exception("could not store item %d", 7)
        logger.warning("failed: %s", info.value)
    finally:
        logger.removeHandler(handler)
    logged = out.getvalue()
    assert SECRET not in logged
    assert "could not store item 7 [DataError (sqlstate 22P05)]" in logged
    assert "failed: DataError (sqlstate 22P05)" in logged
