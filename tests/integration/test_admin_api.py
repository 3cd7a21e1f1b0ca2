"""The admin API (/admin/v1) over HTTP, in process, on real PostgreSQL and Redis: only
an operator key (BATCHGEN_ADMIN_KEYS) opens it (a tenant key of any scope is 403, no
key 401, before the body is read); tenants, quotas, weights, suspension and keys are
managed there, and each change is an audit log row without a secret."""

from __future__ import annotations

import hashlib
import json

import pytest

from batchgen.api import create_app
from batchgen.config import get_settings
from tests.helpers import make_tenant

pytestmark = pytest.mark.integration

OPERATOR_KEY = "bg_operator-secret-for-tests-0123456789"


@pytest.fixture
def api(clean_db, monkeypatch):
    digest = hashlib.sha256(OPERATOR_KEY.encode()).hexdigest()
    monkeypatch.setenv("BATCHGEN_ADMIN_KEYS", json.dumps([f"ops:{digest}"]))
    get_settings.cache_clear()
    yield create_app().test_client()
    monkeypatch.delenv("BATCHGEN_ADMIN_KEYS")
    get_settings.cache_clear()


OPS = {"Authorization": f"Bearer {OPERATOR_KEY}"}


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_only_an_operator_key_opens_the_admin_api_and_before_any_body_is_read(api):
    tenant_key = make_tenant("acme", is_admin=True)  # every scope, of an admin tenant
    assert api.get("/admin/v1/tenants", headers=OPS).status_code == 200
    for headers, status, code in (
        ({}, 401, "unauthorized"),
        (_auth("bg_nobody"), 401, "unauthorized"),
        ({"Authorization": f"Bearer {OPERATOR_KEY}x"}, 401, "unauthorized"),
        (_auth(tenant_key), 403, "operator_key_required"),
        ({"x-api-key": tenant_key}, 403, "operator_key_required"),
    ):
        listed = api.get("/admin/v1/tenants", headers=headers)
        assert (listed.status_code, listed.json["error"]["code"]) == (status, code), headers
        # A broken body is never looked at before the caller is known.
        made = api.post(
            "/admin/v1/tenants",
            data=b"{broken",
            headers={**headers, "Content-Type": "application/json"},
        )
        assert (made.status_code, made.json["error"]["code"]) == (status, code), headers
    with_body = api.post("/admin/v1/tenants", data=b"{broken", headers=OPS)
    assert with_body.status_code == 400  # the operator's broken body: now it is read


def test_no_operator_key_configured_leaves_the_admin_api_shut(clean_db, monkeypatch):
    monkeypatch.delenv("BATCHGEN_ADMIN_KEYS", raising=False)
    get_settings.cache_clear()
    client = create_app().test_client()
    assert client.get("/admin/v1/tenants", headers=OPS).status_code == 401


def test_an_operator_provisions_a_tenant_and_its_keys(api):
    made = api.post(
        "/admin/v1/tenants",
        json={"name": "acme", "weight": 2, "daily_token_quota": 50000, "tokens_per_min": 900},
        headers=OPS,
    )
    assert made.status_code == 201, made.json
    first = made.json["api_key"]
    assert made.json["weight"] == 2 and made.json["daily_token_quota"] == 50000
    assert first["scopes"] == ["batches", "calls", "read", "admin"]
    assert api.get("/v1/batches", headers=_auth(first["secret"])).status_code == 200
    assert api.post("/admin/v1/tenants", json={"name": "acme"}, headers=OPS).status_code == 409

    assert [t["name"] for t in api.get("/admin/v1/tenants", headers=OPS).json["data"]] == ["acme"]
    changed = api.patch(
        "/admin/v1/tenants/acme",
        json={"weight": 5, "tokens_per_min": None, "max_pending_items": 100},
        headers=OPS,
    )
    assert changed.status_code == 200, changed.json
    assert (changed.json["weight"], changed.json["tokens_per_min"]) == (5, None)
    for bad in ({"weight": 0}, {"daily_token_quota": -1}, {"key_hash": "x"}, {"weight": "2"}):
        refused = api.patch("/admin/v1/tenants/acme", json=bad, headers=OPS)
        assert refused.status_code == 400, bad
    assert api.get("/admin/v1/tenants/nobody", headers=OPS).status_code == 404

    key = api.post(
        "/admin/v1/tenants/acme/keys",
        json={"name": "nightly", "scopes": ["batches"], "expires_in_s": 86400},
        headers=OPS,
    )
    assert key.status_code == 201 and key.json["expires_at"] is not None
    secret = key.json["secret"]
    shown = api.get("/admin/v1/tenants/acme", headers=OPS).json
    assert [k["name"] for k in shown["keys"]] == ["default", "nightly"]
    assert secret not in json.dumps(shown)
    patched = api.patch(
        f"/admin/v1/tenants/acme/keys/{key.json['id']}",
        json={"requests_per_min": 30, "scopes": ["batches", "read"]},
        headers=OPS,
    )
    assert patched.json["requests_per_min"] == 30 and patched.json["scopes"] == ["batches", "read"]
    rotated = api.post(
        f"/admin/v1/tenants/acme/keys/{key.json['id']}/rotate", json={"overlap_s": 120}, headers=OPS
    )
    assert rotated.status_code == 201
    for working in (secret, rotated.json["new"]["secret"]):
        assert api.get("/v1/batches", headers=_auth(working)).status_code == 200
    revoked = api.post(f"/admin/v1/tenants/acme/keys/{key.json['id']}/revoke", headers=OPS)
    assert revoked.json["state"] == "revoked"
    assert api.get("/v1/batches", headers=_auth(secret)).status_code == 401

    newest = rotated.json["new"]
    gone = api.delete(f"/admin/v1/tenants/acme/keys/{newest['id']}", headers=OPS)
    assert gone.json["state"] == "revoked"
    assert api.get("/v1/batches", headers=_auth(newest["secret"])).status_code == 401
    assert api.post("/admin/v1/tenants/acme/suspend", headers=OPS).json["suspended"] is True
    assert api.get("/v1/batches", headers=_auth(first["secret"])).status_code == 401
    assert api.post("/admin/v1/tenants/acme/resume", headers=OPS).json["suspended"] is False
    assert api.get("/v1/batches", headers=_auth(first["secret"])).status_code == 200

    log = api.get("/admin/v1/audit?tenant=acme", headers=OPS).json["data"]
    assert [e["action"] for e in reversed(log)] == [
        "tenant.create",
        "key.create",
        "tenant.update",
        "key.create",
        "key.update",
        "key.rotate",
        "key.revoke",
        "key.revoke",
        "tenant.suspend",
        "tenant.resume",
    ]
    assert {e["actor"] for e in log} == {"operator:ops"}
    update = next(e for e in log if e["action"] == "tenant.update")
    assert (update["before"]["weight"], update["after"]["weight"]) == (2, 5)
    # No secret and no hash in the log.
    dumped = json.dumps(log)
    for shown_once in (first["secret"], secret, rotated.json["new"]["secret"]):
        assert shown_once not in dumped
        assert hashlib.sha256(shown_once.encode()).hexdigest() not in dumped
    assert api.get("/admin/v1/audit?limit=501", headers=OPS).status_code == 400
    paged = api.get(f"/admin/v1/audit?limit=2&before={log[1]['id']}", headers=OPS).json["data"]
    assert [e["id"] for e in paged] == [log[2]["id"], log[3]["id"]]
