"""The Flask extension: the batch API under the host's prefix, the Python API on the app,
and the example app; a real worker processes what the host app submits."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType

import pytest
from flask import Flask

from batchgen.api import create_app
from batchgen.integrations.flask import BatchGen, app_scope
from tests import http_client
from tests.helpers import chat_line, jsonl, make_tenant, message_request, wait_batches
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("flask_example", ROOT / "examples/flask_app.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_host_app_submits_worker_processes_results_come_back(clean_db, simulator, workers):
    worker = workers(concurrency=8, wait=False)  # starts while we submit
    key = make_tenant("acme")
    host = Flask("host")
    host.config["BATCHGEN_URL_PREFIX"] = "/llm"
    ext = BatchGen(host)
    assert host.extensions["batchgen"] is ext

    @host.post("/describe")
    def describe():  # a host view calling the Python API through the extension
        batch = host.extensions["batchgen"].submit_batch(
            [chat_line(f"view-{i}") for i in range(5)], tenant="acme"
        )
        return batch

    web = host.test_client()
    standalone = create_app().test_client()
    via_view = web.post("/describe").json
    rows = [chat_line(f"http-{i}", text=f"Product {i}: a lamp.") for i in range(12)]
    res = web.post("/llm/v1/batches?priority=bulk", data=jsonl(rows), headers=_auth(key))
    assert res.status_code == 200, res.json
    assert res.json["priority"] == "bulk" and res.json["request_counts"]["total"] == 12
    batch_id = res.json["id"]

    worker.wait_ready()
    wait_batches([batch_id, via_view["id"]], timeout_s=60)

    info = web.get(f"/llm/v1/batches/{batch_id}", headers=_auth(key))
    assert info.status_code == 200 and info.json["status"] == "completed"
    assert info.json == standalone.get(f"/v1/batches/{batch_id}", headers=_auth(key)).json
    results = web.get(f"/llm/v1/batches/{batch_id}/results", headers=_auth(key))
    assert results.mimetype == "application/jsonl"
    assert (
        results.data == standalone.get(f"/v1/batches/{batch_id}/results", headers=_auth(key)).data
    )
    lines = [json.loads(line) for line in results.data.splitlines()]
    assert [r["custom_id"] for r in lines] == [f"http-{i}" for i in range(12)]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in lines)

    # The Python API on the extension reads the same data.
    assert ext.get_batch(via_view["id"], tenant="acme")["request_counts"]["succeeded"] == 5
    assert len(list(ext.iter_results(via_view["id"], tenant="acme"))) == 5
    assert {b["id"] for b in ext.list_batches(tenant="acme")} == {batch_id, via_view["id"]}
    assert ext.cancel_batch(batch_id, tenant="acme")["status"] == "completed"  # already done

    # Errors: the same status and JSON as the standalone API, also from host views.
    for method, path, kwargs in [
        ("get", "/v1/batches/batch_nope", {"headers": _auth(key)}),
        ("get", "/v1/batches", {}),
        ("post", "/v1/batches", {"data": b"{not json\n", "headers": _auth(key)}),
        ("get", "/v1/batches", {"headers": _auth("bg_wrong")}),
    ]:
        ours = getattr(web, method)("/llm" + path, **kwargs)
        theirs = getattr(standalone, method)(path, **kwargs)
        assert (ours.status_code, ours.json) == (theirs.status_code, theirs.json), path
        assert ours.status_code in (400, 401, 404) and "error" in ours.json


def test_init_app_default_prefix_and_example_app(clean_db, simulator, workers, restore_env):
    worker = workers(concurrency=8, wait=False)
    key = make_tenant("shop-1")
    example = _example()
    app = example.create_app({"BATCHGEN_MAX_BATCH_LINES": 3, "TESTING": True})
    # The host's config makes the app's settings; the environment is left alone.
    assert app_scope(app).settings.submit.max_batch_lines == 3
    assert "BATCHGEN_MAX_BATCH_LINES" not in os.environ
    web = app.test_client()

    too_many = web.post(
        "/batchgen/v1/batches",
        data=jsonl([chat_line(f"x{i}") for i in range(4)]),
        headers=_auth(key),
    )
    assert too_many.status_code == 413 and too_many.json["error"]["code"] == "payload_too_large"
    assert web.post("/shops/nobody/descriptions", json=[{"id": 1, "name": "x"}]).status_code == 404

    products = [{"id": f"sku-{i}", "name": f"Lamp {i}", "colour": "red"} for i in range(3)]
    accepted = web.post("/shops/shop-1/descriptions", json=products)
    assert accepted.status_code == 202, accepted.json
    worker.wait_ready()
    wait_batches([accepted.json["batch"]], timeout_s=60)
    done = web.get(f"/shops/shop-1/descriptions/{accepted.json['batch']}")
    assert done.status_code == 200 and done.json["status"] == "completed"
    assert sorted(done.json["descriptions"]) == ["sku-0", "sku-1", "sku-2"]
    assert web.get("/batchgen/healthz").json == {"ok": True}


def test_the_sdk_routes_under_the_host_prefix(clean_db, simulator):
    """The files flow and Message Batches answer under the extension's prefix; the
    results_url a Message Batch gives names the prefix; the extension offers the calls."""
    import io

    key = make_tenant("flask-sdk")
    host = Flask("host-sdk")
    host.config["BATCHGEN_URL_PREFIX"] = "/llm"
    ext = BatchGen(host)
    web = host.test_client()
    content = jsonl([chat_line(f"f-{i}") for i in range(2)])
    res = web.post(
        "/llm/v1/files",
        data={"file": (io.BytesIO(content), "in.jsonl"), "purpose": "batch"},
        headers=_auth(key),
    )
    assert res.status_code == 200, res.json
    made = web.post("/llm/v1/batches", json={"input_file_id": res.json["id"]}, headers=_auth(key))
    assert made.status_code == 200 and made.json["input_file_id"] == res.json["id"]
    assert ext.get_file(res.json["id"], tenant="flask-sdk")["bytes"] == len(content)

    request = message_request("m")
    batch = web.post(
        "/llm/v1/messages/batches", json={"requests": [request]}, headers={"x-api-key": key}
    )
    assert batch.status_code == 200, batch.json
    web.post(f"/llm/v1/messages/batches/{batch.json['id']}/cancel", headers={"x-api-key": key})
    ended = web.get(f"/llm/v1/messages/batches/{batch.json['id']}", headers={"x-api-key": key})
    assert ended.json["results_url"] == (
        f"http://localhost/llm/v1/messages/batches/{batch.json['id']}/results"
    )
    rows = web.get(ended.json["results_url"], headers={"x-api-key": key})
    assert [json.loads(x)["result"]["type"] for x in rows.data.splitlines()] == ["canceled"]

    # A synchronous call under the prefix runs in the host's process, no worker needed.
    answer = web.post(
        "/llm/v1/chat/completions",
        json={
            "model": "sim-small",
            "max_tokens": 20,
            "messages": [{"role": "user", "content": "hi"}],
        },
        headers=_auth(key),
    )
    assert answer.status_code == 200, answer.json
    assert (
        answer.json["object"] == "chat.completion"
        and answer.json["choices"][0]["message"]["content"]
    )


def test_a_call_retried_after_a_provider_error_needs_no_worker(clean_db, simulator):
    """A synchronous call's attempt that failed with a 5xx is retried where the call
    runs (the host's process), after its backoff: no worker or dispatcher is needed."""
    import threading

    from tests.helpers import sim_config

    key = make_tenant("retried")
    host = Flask("host-retry")
    host.config["BATCHGEN_URL_PREFIX"] = "/llm"
    BatchGen(host)
    web = host.test_client()
    http_client.post(f"{simulator.base_url}/_sim/reset", timeout=10)
    sim_config(simulator.base_url, fault_rate=1.0, fault_kinds=["5xx"])
    answers: list = []
    body = {"model": "sim-small", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}

    def call() -> None:
        try:
            headers = {**_auth(key), "X-Request-Timeout": "30"}
            answers.append(web.post("/llm/v1/chat/completions", json=body, headers=headers))
        except BaseException as exc:
            answers.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        wait_until(
            lambda: http_client.get(f"{simulator.base_url}/_sim/log", timeout=10).json(),
            20,
            lambda: f"an attempt to reach the provider: {answers}",
        )
    finally:
        sim_config(simulator.base_url, fault_rate=0.0)
    caller.join(30)
    (answer,) = answers
    assert answer.status_code == 200, answer.json
    statuses = [
        e["status"] for e in http_client.get(f"{simulator.base_url}/_sim/log", timeout=10).json()
    ]
    assert statuses[0] >= 500 and statuses[-1] == 200


@pytest.fixture(scope="module")
def second_database(services):
    """A second batchgen database on the test server, migrated, dropped at the end."""
    from batchgen import embedded
    from batchgen.store import db

    name = f"batchgen_test_{os.getpid()}_b"
    embedded.drop_database(services["server_url"], name)
    url = embedded.ensure_database(services["server_url"], name)
    from batchgen.config import Settings

    db.upgrade(Settings(DATABASE_URL=url).sqlalchemy_url)
    yield url
    embedded.drop_database(services["server_url"], name)


def test_two_apps_in_one_process_each_see_only_their_own(clean_db, second_database):
    """Two host apps with two databases: requests, app contexts and the extension's
    Python API of each use that app's database, and the environment is left alone."""
    from flask import current_app
    from sqlalchemy.engine import make_url

    from batchgen.config import get_settings
    from batchgen.store.db import get_engine

    environ_before = dict(os.environ)
    apps, exts = {}, {}
    for name, url in (("a", clean_db["DATABASE_URL"]), ("b", second_database)):
        apps[name] = Flask(f"host_{name}")
        apps[name].config.update(
            BATCHGEN_DATABASE_URL=url, BATCHGEN_MAX_BATCH_LINES=100 + ord(name)
        )
        exts[name] = BatchGen(apps[name])

        @apps[name].get("/whoami")
        def whoami():  # a host view: batchgen's settings are the app's own
            return {"app": current_app.name, "max": get_settings().submit.max_batch_lines}

    assert dict(os.environ) == environ_before
    keys = {}
    for name, app in apps.items():
        with app.app_context():  # a host's CLI command or job pushes its app's context
            keys[name] = make_tenant("acme")
            assert (
                get_engine().url.database == make_url(app.config["BATCHGEN_DATABASE_URL"]).database
            )
    assert get_settings().database.url == clean_db["DATABASE_URL"]  # outside: the process's

    ids: dict[str, set[str]] = {"a": set(), "b": set()}
    for name, app in apps.items():
        web = app.test_client()
        assert web.get("/whoami").json == {"app": f"host_{name}", "max": 100 + ord(name)}
        res = web.post(
            "/batchgen/v1/batches",
            data=jsonl([chat_line(f"{name}-http")]),
            headers=_auth(keys[name]),
        )
        assert res.status_code == 200, res.json
        ids[name].add(res.json["id"])
        # The Python API on the extension, outside any request or app context.
        ids[name].add(exts[name].submit_batch([chat_line(f"{name}-py")], tenant="acme")["id"])

    for name, other in (("a", "b"), ("b", "a")):
        web = apps[name].test_client()
        listed = web.get("/batchgen/v1/batches", headers=_auth(keys[name]))
        assert listed.status_code == 200, listed.json
        assert {b["id"] for b in listed.json["data"]} == ids[name]
        assert {b["id"] for b in exts[name].list_batches(tenant="acme")} == ids[name]
        one = sorted(ids[name])[0]
        assert len(list(exts[name].iter_results(one, tenant="acme"))) == 0  # none done yet
        # The other app's key and batches do not exist here.
        assert web.get("/batchgen/v1/batches", headers=_auth(keys[other])).status_code == 401
        theirs = sorted(ids[other])[0]
        assert (
            web.get(f"/batchgen/v1/batches/{theirs}", headers=_auth(keys[name])).status_code == 404
        )
    assert dict(os.environ) == environ_before

    # Teardown: the apps' engines are disposed (and opened again on next use).
    with exts["b"].scope().active():
        engine_b = get_engine()
    assert engine_b.url.database == make_url(second_database).database
    assert engine_b.pool.checkedin() > 0  # connections kept for the next request
    exts["a"].close()
    exts["b"].close()
    assert engine_b.pool.checkedin() == 0
    assert {b["id"] for b in exts["b"].list_batches(tenant="acme")} == ids["b"]
    exts["b"].close()


def test_the_admin_api_is_mounted_under_the_hosts_prefix(clean_db):
    """The host's BATCHGEN_ADMIN_KEYS (its config, not the environment) name the
    operators of /<prefix>/admin/v1; a tenant key is refused there."""
    import hashlib

    operator = "bg_host-operator-key"
    key = make_tenant("acme")
    host = Flask("host")
    host.config["BATCHGEN_URL_PREFIX"] = "/llm"
    host.config["BATCHGEN_ADMIN_KEYS"] = [
        f"host-ops:{hashlib.sha256(operator.encode()).hexdigest()}"
    ]
    BatchGen(host)
    web = host.test_client()
    made = web.post("/llm/admin/v1/tenants", json={"name": "globex"}, headers=_auth(operator))
    assert made.status_code == 201, made.json
    with host.app_context():
        from batchgen import tenant_admin

        assert tenant_admin.audit_log(tenant="globex")[-1]["actor"] == "operator:host-ops"
    refused = web.get("/llm/admin/v1/tenants", headers=_auth(key))
    assert refused.status_code == 403 and refused.json["error"]["code"] == "operator_key_required"
    assert web.get("/admin/v1/tenants", headers=_auth(operator)).status_code == 404  # prefix only
