"""The rules of API keys (batchgen.domain.keys), and that every route of the tenant API
names the scopes that open it."""

from __future__ import annotations

import datetime as dt

import pytest
from flask import Flask

from batchgen.domain import keys
from batchgen.errors import ValidationFailed

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


def test_scopes_are_known_once_each_in_order_and_default_to_all_but_admin():
    assert keys.parse_scopes(None) == ["batches", "calls", "read"]
    assert keys.parse_scopes(["read", "batches", "read"]) == ["batches", "read"]
    assert keys.parse_scopes("admin, calls") == ["calls", "admin"]
    for bad in (["root"], [], "", [3]):
        with pytest.raises(ValidationFailed):
            keys.parse_scopes(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("endpoint", "scopes", "allowed"),
    [
        ("batchgen_api.create_batch", ["batches"], True),
        ("batchgen_api.create_batch", ["read", "calls", "admin"], False),
        ("batchgen_api.get_batch", ["read"], True),
        ("batchgen_api.get_batch", ["batches"], True),
        ("batchgen_api.get_batch", ["calls"], False),
        ("batchgen_api.chat_completions", ["calls"], True),
        ("batchgen_api.messages", ["batches", "read"], False),
        ("batchgen_api.usage", ["read"], True),
        ("batchgen_api.usage", ["batches", "calls"], False),
        ("batchgen_admin.create_own_key", ["admin"], True),
        ("batchgen_admin.create_own_key", ["batches", "calls", "read"], False),
        ("batchgen_api.list_models", ["calls"], True),
        (None, ["read"], True),
    ],
)
def test_each_route_opens_to_its_scopes(endpoint, scopes, allowed):
    if allowed:
        keys.check_scope(endpoint, scopes)
    else:
        with pytest.raises(keys.KeyOutOfScope) as refused:
            keys.check_scope(endpoint, scopes)
        assert refused.value.status_code == 403
        assert refused.value.to_dict()["code"] == "key_out_of_scope"
        assert refused.value.to_dict()["needed_scopes"]


def test_every_route_of_the_tenant_api_names_its_scopes():
    """A new route must say which scopes open it (else any key would): it is in
    ROUTE_SCOPES or, deliberately, in OPEN_ROUTES."""
    from batchgen.admin_api import admin_blueprint
    from batchgen.api import blueprint

    app = Flask("routes")
    app.register_blueprint(blueprint)
    app.register_blueprint(admin_blueprint)
    tenant_routes = {
        rule.endpoint
        for rule in app.url_map.iter_rules()
        if rule.endpoint.startswith(("batchgen_api.", "batchgen_admin."))
        and not rule.endpoint.startswith("batchgen_admin.admin_")  # operators' own auth
    }
    unnamed = tenant_routes - set(keys.ROUTE_SCOPES) - keys.OPEN_ROUTES
    assert unnamed == set()
    assert set(keys.ROUTE_SCOPES) <= tenant_routes  # no stale names


def test_a_key_works_until_its_expiry_or_revocation():
    hour = dt.timedelta(hours=1)
    assert keys.refusal(NOW, None, None) is None
    assert keys.refusal(NOW, NOW + hour, None) is None
    assert keys.refusal(NOW, NOW, None) == "this API key has expired"
    assert keys.refusal(NOW, NOW + hour, NOW - hour) == "this API key was revoked"


def test_the_last_use_is_due_once_a_minute():
    assert keys.last_used_due(NOW, None)
    assert not keys.last_used_due(NOW, NOW - dt.timedelta(seconds=59))
    assert keys.last_used_due(NOW, NOW - dt.timedelta(seconds=60))


def test_a_rotated_key_stops_after_the_overlap_never_later_than_it_would_have():
    day = dt.timedelta(seconds=keys.DEFAULT_OVERLAP_S)
    assert keys.rotation_expiry(NOW, None, None) == NOW + day
    assert keys.rotation_expiry(NOW, None, 0) == NOW
    soon = NOW + dt.timedelta(minutes=5)
    assert keys.rotation_expiry(NOW, soon, 3600) == soon
    for bad in (-1, keys.MAX_OVERLAP_S + 1):
        with pytest.raises(ValidationFailed):
            keys.rotation_expiry(NOW, None, bad)


def test_an_expiry_is_a_future_time_with_its_zone_or_seconds_from_now():
    assert keys.parse_expiry(NOW, None, None) is None
    assert keys.parse_expiry(NOW, None, 60) == NOW + dt.timedelta(seconds=60)
    assert keys.parse_expiry(NOW, "2027-01-01T00:00:00Z", None) == dt.datetime(
        2027, 1, 1, tzinfo=dt.UTC
    )
    for at, in_s in (
        ("2027-01-01T00:00:00Z", 60),
        ("2020-01-01T00:00:00Z", None),
        ("2027-01-01T00:00:00", None),
        ("soon", None),
        (None, 0),
        (None, "60"),
    ):
        with pytest.raises(ValidationFailed):
            keys.parse_expiry(NOW, at, in_s)  # type: ignore[arg-type]


def test_a_key_is_named_by_a_prefix_too_short_to_use():
    secret = "bg_" + "x" * 43
    assert keys.shown_prefix(secret) == "bg_xxxxxxxxx" and len(keys.shown_prefix(secret)) == 12
    assert keys.gcra_interval_ms(60) == 1000 and keys.gcra_interval_ms(7) == 8571


def test_operator_keys_match_by_their_hash_only():
    import hashlib

    from batchgen.admin_api import operator_of

    entries = [
        f"ops:{hashlib.sha256(b'k1').hexdigest()}",
        f"ci:{hashlib.sha256(b'k2').hexdigest()}",
    ]
    assert operator_of("k2", entries) == "ci"
    assert operator_of("k3", entries) is None
    assert operator_of(hashlib.sha256(b"k1").hexdigest(), entries) is None  # the hash is no key


def test_operator_key_entries_are_checked_at_start():
    from pydantic import ValidationError

    from batchgen.config import Settings

    good = f"ops:{'a' * 64}"
    assert Settings(admin_keys=[good]).api.admin_keys == [good]
    for bad in ("ops", "ops:abc", f":{'a' * 64}", "ops:" + "A" * 64):
        with pytest.raises(ValidationError):
            Settings(admin_keys=[bad])
