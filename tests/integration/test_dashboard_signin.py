"""The dashboard's sign-in, session cookie and page headers, through Flask's test client
(real PostgreSQL and Redis): a server-side session scoped to the mount, login CSRF
refused, sign-ins limited per address and per key, no framing."""

from __future__ import annotations

import re
from http.cookies import SimpleCookie

import pytest
from flask import Flask

from batchgen.api import create_app
from batchgen.integrations.flask import BatchGen
from tests.helpers import dashboard_sign_in, make_tenant

pytestmark = pytest.mark.integration


def _form_token(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "the sign-in form carries no token"
    return found.group(1)


def _cookies(response) -> dict[str, SimpleCookie]:  # type: ignore[no-untyped-def]
    out = {}
    for header in response.headers.getlist("Set-Cookie"):
        cookie: SimpleCookie = SimpleCookie()
        cookie.load(header)
        for name in cookie:
            out[name] = cookie
    return out


_sign_in = dashboard_sign_in


@pytest.fixture
def web(clean_db):  # type: ignore[no-untyped-def]
    return create_app().test_client()


def test_the_cookie_is_a_session_that_dies_at_sign_out(web):
    key = make_tenant("acme")
    signed_in = _sign_in(web, key)
    assert signed_in.status_code == 302
    cookie = _cookies(signed_in)["batchgen_session"]["batchgen_session"]
    assert cookie.value != key and key not in signed_in.headers.getlist("Set-Cookie")[0]
    assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/"
    assert not cookie["secure"]  # plain http, no trusted proxy
    token = cookie.value
    assert 'id="batches"' in web.get("/dashboard").text

    # Another browser holding a copy of the cookie is signed out with it.
    copy = create_app().test_client()
    copy.set_cookie("batchgen_session", token)
    assert copy.get("/dashboard/fragment").status_code == 200
    assert web.post("/dashboard/logout").status_code == 302
    assert copy.get("/dashboard/fragment").status_code == 401
    assert 'id="key"' in copy.get("/dashboard").text  # the sign-in form again
    # A cookie holding the raw key (what the dashboard once set) opens nothing.
    raw = create_app().test_client()
    raw.set_cookie("batchgen_session", key)
    raw.set_cookie("batchgen_key", key)
    assert raw.get("/dashboard/fragment").status_code == 401


def test_a_revoked_key_ends_its_sessions(web):
    from batchgen.store import db, tenants

    key = make_tenant("acme")
    assert _sign_in(web, key).status_code == 302
    assert web.get("/dashboard/fragment").status_code == 200
    with db.session_scope() as session:
        tenants.revoke(session, "acme")
    assert web.get("/dashboard/fragment").status_code == 401


def test_revoking_the_key_a_session_signed_in_with_ends_that_session_only(web):
    from batchgen import tenant_admin

    make_tenant("acme")
    doomed = tenant_admin.create_key("acme", name="laptop", scopes=["batches", "read"])
    kept = tenant_admin.create_key("acme", name="desk", scopes=["batches", "read"])
    other = create_app().test_client()
    assert _sign_in(web, doomed["secret"]).status_code == 302
    assert _sign_in(other, kept["secret"]).status_code == 302
    tenant_admin.revoke_key("acme", doomed["id"])
    assert web.get("/dashboard/fragment").status_code == 401
    assert other.get("/dashboard/fragment").status_code == 200


def test_signing_in_needs_a_key_with_the_batches_and_read_scopes(web):
    from batchgen import tenant_admin

    make_tenant("acme")
    reader = tenant_admin.create_key("acme", name="reader", scopes=["read"])
    refused = _sign_in(web, reader["secret"])
    assert refused.status_code == 403 and "lacks batches" in refused.text
    assert "batchgen_session" not in _cookies(refused)


def test_cookie_scoped_to_the_mount_and_secure_behind_a_trusted_proxy(clean_db):
    key = make_tenant("acme")
    apps = {}
    for trusted in (False, True):
        app = Flask(f"host_{trusted}")
        app.config.update(BATCHGEN_URL_PREFIX="/llm", BATCHGEN_TRUSTED_PROXY=trusted)
        BatchGen(app)
        apps[trusted] = app
    https = {"X-Forwarded-Proto": "https"}

    plain = _sign_in(apps[False].test_client(), key, "/llm", headers=https)
    cookie = _cookies(plain)["batchgen_session"]["batchgen_session"]
    assert cookie["path"] == "/llm" and not cookie["secure"]  # the header is not trusted

    proxied = _sign_in(apps[True].test_client(), key, "/llm", headers=https)
    assert proxied.status_code == 302
    cookie = _cookies(proxied)["batchgen_session"]["batchgen_session"]
    assert cookie["path"] == "/llm" and cookie["secure"]

    direct = apps[False].test_client()
    signed_in = _sign_in(direct, key, "/llm", base_url="https://localhost")
    cookie = _cookies(signed_in)["batchgen_session"]["batchgen_session"]
    assert cookie["secure"]


def test_cross_site_sign_in_is_refused(web):
    key = make_tenant("acme")
    page = web.get("/dashboard")
    token = _form_token(page.text)
    # Another site's form (a login CSRF: the victim would be signed in as the attacker).
    forged = web.post(
        "/dashboard/login",
        data={"key": key, "csrf": token},
        headers={"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"},
    )
    assert forged.status_code == 403 and "batchgen_session" not in _cookies(forged)
    only_origin = web.post(
        "/dashboard/login", data={"key": key, "csrf": token}, headers={"Origin": "http://evil"}
    )
    assert only_origin.status_code == 403
    # A post without the form's token (no page of ours was loaded first).
    fresh = create_app().test_client()
    assert fresh.post("/dashboard/login", data={"key": key}).status_code == 403
    assert fresh.post("/dashboard/login", data={"key": key, "csrf": "x"}).status_code == 403
    # The site's own form.
    ok = web.post(
        "/dashboard/login",
        data={"key": key, "csrf": token},
        headers={"Origin": "http://localhost", "Sec-Fetch-Site": "same-origin"},
    )
    assert ok.status_code == 302 and "batchgen_session" in _cookies(ok)


def test_sign_in_is_rate_limited_per_address_and_per_key(clean_db, restore_env, monkeypatch):
    from batchgen.config import get_settings

    monkeypatch.setenv("BATCHGEN_DASHBOARD_SIGNIN_ATTEMPTS", "3")
    monkeypatch.setenv("BATCHGEN_TRUSTED_PROXY", "true")
    get_settings.cache_clear()
    key = make_tenant("acme")
    app = create_app()

    def attempt(key_tried: str, address: str):  # type: ignore[no-untyped-def]
        # A browser of its own each time: one not yet signed in.
        return _sign_in(app.test_client(), key_tried, headers={"X-Forwarded-For": address})

    # One address guessing keys: the fourth try is refused, even with the right key.
    assert [attempt(f"bg_guess{i}", "10.0.0.1").status_code for i in range(3)] == [401] * 3
    refused = attempt(key, "10.0.0.1")
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["Retry-After"]) <= 300
    assert "batchgen_session" not in _cookies(refused)
    assert attempt(key, "10.0.0.2").status_code == 302  # another address is not held up

    # One key tried from many addresses: held after three as well.
    assert [attempt("bg_target", f"10.1.0.{i}").status_code for i in range(3)] == [401] * 3
    assert attempt("bg_target", "10.1.0.99").status_code == 429


def test_dashboard_pages_forbid_framing_and_sniffing(web):
    key = make_tenant("acme")
    answers = [web.get("/dashboard"), _sign_in(web, key), web.get("/dashboard")]
    answers.append(web.get("/dashboard/fragment"))
    for answer in answers:
        assert answer.headers["X-Frame-Options"] == "DENY"
        assert "frame-ancestors 'none'" in answer.headers["Content-Security-Policy"]
        assert answer.headers["X-Content-Type-Options"] == "nosniff"
