"""Many API keys per tenant, over the HTTP API (in process, real PostgreSQL and Redis):
scopes (403 ``key_out_of_scope``), expiry and revocation (401), rotation with
overlap, last use written at most once a minute, a key's own requests per minute,
and a tenant's own key management with an ``admin`` key."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from sqlalchemy import func, select, text, update

from batchgen import tenant_admin
from batchgen.api import create_app
from batchgen.store import db
from batchgen.store.schema import ApiKey, AuditEntry, Batch, Item
from tests.helpers import chat_line, make_tenant

pytestmark = pytest.mark.integration

GOOD = json.dumps(chat_line("ok-1")).encode()
CHAT = {"model": "sim-small", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}


@pytest.fixture
def api(clean_db):
    return create_app().test_client()


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _stored() -> tuple[int, int]:
    with db.session_scope() as s:
        return (
            s.scalar(select(func.count()).select_from(Batch)),
            s.scalar(select(func.count()).select_from(Item)),
        )


def _key(tenant: str, *scopes: str, **kw) -> dict:
    return tenant_admin.create_key(tenant, name="k-" + "-".join(scopes), scopes=list(scopes), **kw)


def test_the_first_key_of_a_tenant_holds_every_scope(api):
    owner = make_tenant("acme")
    assert api.get("/v1/batches", headers=_auth(owner)).status_code == 200
    assert api.get("/v1/keys", headers=_auth(owner)).status_code == 200
    [listed] = tenant_admin.list_keys("acme")
    assert listed["scopes"] == ["batches", "calls", "read", "admin"]
    assert listed["name"] == "default" and owner.startswith(listed["prefix"])
    assert "secret" not in listed and "key_hash" not in listed


def test_a_key_out_of_scope_gets_403_naming_the_scope_and_nothing_is_stored(api):
    make_tenant("acme")
    reader = _key("acme", "read")["secret"]
    caller = _key("acme", "calls")["secret"]
    batcher = _key("acme", "batches")["secret"]

    refused = api.post("/v1/batches", data=GOOD, headers=_auth(reader))
    assert refused.status_code == 403
    assert refused.json["error"]["code"] == "key_out_of_scope"
    assert refused.json["error"]["needed_scopes"] == ["batches"]
    assert _stored() == (0, 0)
    assert api.get("/v1/batches", headers=_auth(reader)).status_code == 200
    assert api.get("/v1/usage", headers=_auth(reader)).status_code == 200

    # A call out of scope is refused before its body is read (a broken body: still 403).
    for secret in (reader, batcher):
        call = api.post(
            "/v1/chat/completions",
            data=b"{not json",
            headers={**_auth(secret), "Content-Type": "application/json"},
        )
        assert call.status_code == 403 and call.json["error"]["code"] == "key_out_of_scope"
        assert call.json["error"]["needed_scopes"] == ["calls"]

    assert api.post("/v1/batches", data=GOOD, headers=_auth(caller)).status_code == 403
    assert api.get("/v1/batches", headers=_auth(caller)).status_code == 403
    assert api.get("/v1/usage", headers=_auth(batcher)).status_code == 403
    made = api.post("/v1/batches", data=GOOD, headers=_auth(batcher))
    assert made.status_code == 200, made.json
    assert api.get(f"/v1/batches/{made.json['id']}", headers=_auth(batcher)).status_code == 200
    # Any working key lists the models (what an SDK asks first).
    for secret in (reader, caller, batcher):
        assert api.get("/v1/models", headers=_auth(secret)).status_code == 200
    # Key management needs the admin scope...
    assert api.get("/v1/keys", headers=_auth(batcher)).json["error"]["code"] == "key_out_of_scope"
    # ... which opens nothing else.
    keeper = _key("acme", "admin")["secret"]
    assert api.get("/v1/keys", headers=_auth(keeper)).status_code == 200
    assert api.get("/v1/batches", headers=_auth(keeper)).status_code == 403


def test_the_status_view_needs_the_read_scope_as_well_as_an_admin_tenant(api):
    make_tenant("ops", is_admin=True)
    caller = _key("ops", "calls")["secret"]
    refused = api.get("/v1/status", headers=_auth(caller))
    assert refused.status_code == 403 and refused.json["error"]["code"] == "key_out_of_scope"
    make_tenant("acme")
    reader = _key("acme", "read")["secret"]  # the scope, of a tenant that is no admin
    assert api.get("/v1/status", headers=_auth(reader)).json["error"]["code"] == "forbidden"


def test_a_batch_records_the_key_it_was_made_with(api):
    make_tenant("acme")
    made = _key("acme", "batches")
    batch = api.post("/v1/batches", data=GOOD, headers=_auth(made["secret"])).json
    with db.session_scope() as s:
        assert s.scalar(select(Batch.key_id).where(Batch.id == batch["id"])) == made["id"]


def test_an_expired_key_is_401_and_an_expiry_in_the_past_is_refused(api):
    make_tenant("acme")
    made = _key("acme", "read", expires_in_s=3600)
    assert made["expires_at"] is not None
    assert api.get("/v1/batches", headers=_auth(made["secret"])).status_code == 200
    with db.session_scope() as s:
        s.execute(
            update(ApiKey)
            .where(ApiKey.id == made["id"])
            .values(expires_at=func.now() - dt.timedelta(seconds=1))
        )
    expired = api.get("/v1/batches", headers=_auth(made["secret"]))
    assert expired.status_code == 401 and "expired" in expired.json["error"]["message"]
    from batchgen.errors import ValidationFailed

    with pytest.raises(ValidationFailed, match="in the past"):
        tenant_admin.create_key("acme", name="old", expires_at="2020-01-01T00:00:00Z")
    with pytest.raises(ValidationFailed, match="time zone"):
        tenant_admin.create_key("acme", name="naive", expires_at="2999-01-01T00:00:00")


def test_revoking_one_key_leaves_the_others(api):
    owner = make_tenant("acme")
    doomed = _key("acme", "read")
    other = _key("acme", "read")["secret"]
    tenant_admin.revoke_key("acme", doomed["id"])
    refused = api.get("/v1/batches", headers=_auth(doomed["secret"]))
    assert refused.status_code == 401 and "revoked" in refused.json["error"]["message"]
    assert api.get("/v1/batches", headers=_auth(other)).status_code == 200
    assert api.get("/v1/batches", headers=_auth(owner)).status_code == 200
    states = {k["id"]: k["state"] for k in tenant_admin.list_keys("acme")}
    assert states[doomed["id"]] == "revoked" and list(states.values()).count("active") == 2


def test_rotation_keeps_both_keys_working_until_the_overlap_ends(api):
    make_tenant("acme")
    old = _key("acme", "batches", "read", requests_per_min=100)
    rotated = tenant_admin.rotate_key("acme", old["id"], overlap_s=3600)
    new = rotated["new"]
    assert new["secret"] != old["secret"] and new["rotated_from"] == old["id"]
    assert new["scopes"] == ["batches", "read"] and new["requests_per_min"] == 100
    assert new["expires_at"] is None
    ends = dt.datetime.fromisoformat(rotated["old"]["expires_at"])
    assert 3590 < (ends - dt.datetime.now(dt.UTC)).total_seconds() <= 3600
    for secret in (old["secret"], new["secret"]):  # the overlap: both work
        assert api.get("/v1/batches", headers=_auth(secret)).status_code == 200
    # A later rotation of the new key, with no overlap: the new key stops at once.
    again = tenant_admin.rotate_key("acme", new["id"], overlap_s=0)
    assert api.get("/v1/batches", headers=_auth(new["secret"])).status_code == 401
    assert api.get("/v1/batches", headers=_auth(again["new"]["secret"])).status_code == 200
    assert api.get("/v1/batches", headers=_auth(old["secret"])).status_code == 200
    from batchgen.errors import Conflict

    with pytest.raises(Conflict, match="expired"):  # a stopped key is not rotated again
        tenant_admin.rotate_key("acme", new["id"])


def test_the_last_use_is_written_at_most_once_a_minute(api):
    make_tenant("acme")
    made = _key("acme", "read")

    def row() -> tuple[dt.datetime | None, str]:
        with db.session_scope() as s:
            found = s.execute(
                text("SELECT last_used_at, xmin::text FROM api_keys WHERE id = :id"),
                {"id": made["id"]},
            ).one()
            return found[0], found[1]

    assert row()[0] is None
    api.get("/v1/batches", headers=_auth(made["secret"]))
    first, version = row()
    assert first is not None
    for _ in range(5):  # uses within the minute: no write at all (the row is untouched)
        assert api.get("/v1/batches", headers=_auth(made["secret"])).status_code == 200
    assert row() == (first, version)
    with db.session_scope() as s:  # a minute later
        s.execute(
            update(ApiKey)
            .where(ApiKey.id == made["id"])
            .values(last_used_at=ApiKey.last_used_at - dt.timedelta(seconds=61))
        )
    api.get("/v1/batches", headers=_auth(made["secret"]))
    later, _ = row()
    assert later is not None and later >= first  # written again, at this use
    assert [k["last_used_at"] for k in tenant_admin.list_keys("acme") if k["id"] == made["id"]] == [
        later.isoformat()
    ]


def test_a_request_never_waits_for_another_noting_the_keys_last_use(api):
    """While another transaction holds the key's row (a twin request writing its last
    use), a request with the key is answered without waiting for it."""
    import threading

    make_tenant("acme")
    made = _key("acme", "read")
    answers: list[int] = []
    with db.get_engine().connect() as holder:
        holder.execute(text("SELECT 1 FROM api_keys WHERE id = :id FOR UPDATE"), {"id": made["id"]})
        asking = threading.Thread(
            target=lambda: answers.append(
                api.get("/v1/batches", headers=_auth(made["secret"])).status_code
            )
        )
        asking.start()
        asking.join(60)  # a request blocked on the row would still be waiting
        assert not asking.is_alive() and answers == [200]
        holder.rollback()
    with db.session_scope() as s:  # it skipped the write: the next use notes it
        assert s.scalar(select(ApiKey.last_used_at).where(ApiKey.id == made["id"])) is None


def test_a_keys_own_requests_per_minute_is_429_with_retry_after(api):
    make_tenant("acme")
    limited = _key("acme", "read", requests_per_min=3)["secret"]
    free = _key("acme", "read")["secret"]
    answers = [api.get("/v1/batches", headers=_auth(limited)) for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert answers[3].json["error"]["code"] == "key_rate_limited"
    assert 1 <= int(answers[3].headers["Retry-After"]) <= 20
    # Another key of the tenant is not held by it.
    assert all(api.get("/v1/batches", headers=_auth(free)).status_code == 200 for _ in range(5))


def test_the_key_rate_is_a_steady_bucket_on_redis(clean_db):
    """A minute's requests at once, then one per interval (GCRA, Redis's script on a
    clock the test passes)."""
    from batchgen.limits import key_rate
    from batchgen.limits.backend import get_redis

    client = get_redis()
    t0 = 1_000_000.0
    waits = [key_rate.take(client, 77, 6, now_s=t0) for _ in range(7)]
    assert waits[:6] == [0.0] * 6 and waits[6] == pytest.approx(10.0)
    assert key_rate.take(client, 77, 6, now_s=t0 + 9.9) > 0
    assert key_rate.take(client, 77, 6, now_s=t0 + 10.0) == 0.0
    assert key_rate.take(client, 78, 6, now_s=t0) == 0.0  # each key its own


def test_a_tenant_manages_its_own_keys_with_an_admin_key(api):
    owner = make_tenant("acme")
    make_tenant("globex")
    other_tenant_key = tenant_admin.list_keys("globex")[0]["id"]
    made = api.post(
        "/v1/keys",
        json={"name": "ci", "scopes": ["batches"], "requests_per_min": 50},
        headers=_auth(owner),
    )
    assert made.status_code == 201, made.json
    secret = made.json["secret"]
    assert made.json["scopes"] == ["batches"] and secret.startswith(made.json["prefix"])
    listed = api.get("/v1/keys", headers=_auth(owner)).json["data"]
    assert {k["name"] for k in listed} == {"default", "ci"}
    assert secret not in json.dumps(listed)
    rotated = api.post(
        f"/v1/keys/{made.json['id']}/rotate", json={"overlap_s": 60}, headers=_auth(owner)
    )
    assert rotated.status_code == 201 and rotated.json["new"]["secret"] != secret
    revoked = api.delete(f"/v1/keys/{made.json['id']}", headers=_auth(owner))
    assert revoked.status_code == 200 and revoked.json["state"] == "revoked"
    # Another tenant's key is not this tenant's to touch.
    foreign = api.delete(f"/v1/keys/{other_tenant_key}", headers=_auth(owner))
    assert foreign.status_code == 404
    bad = api.post("/v1/keys", json={"name": "x", "scopes": ["root"]}, headers=_auth(owner))
    assert bad.status_code == 400 and "unknown scope" in bad.json["error"]["message"]
    with db.session_scope() as s:
        actions = s.execute(
            select(AuditEntry.action, AuditEntry.actor).order_by(AuditEntry.id)
        ).all()
    owner_id = tenant_admin.list_keys("acme")[0]["id"]
    mine = [a for a, who in actions if who == f"tenant:acme/key:{owner_id}"]
    assert mine == ["key.create", "key.rotate", "key.revoke"]


def test_a_suspended_tenant_is_401_for_every_key_until_resumed(api):
    owner = make_tenant("acme")
    second = _key("acme", "read")["secret"]
    tenant_admin.suspend_tenant("acme")
    for secret in (owner, second):
        refused = api.get("/v1/batches", headers=_auth(secret))
        assert refused.status_code == 401 and "suspended" in refused.json["error"]["message"]
    tenant_admin.resume_tenant("acme")
    assert api.get("/v1/batches", headers=_auth(second)).status_code == 200
