"""The dashboard's sign-in and session: who the browser is, and what guards it.

- Signing in with an API key opens a server-side session (:mod:`batchgen.limits.sessions`):
  the cookie holds a random token, never the key; signing out deletes the session.
  The cookie is HttpOnly, SameSite=Strict, scoped to the mount (its path is where the
  API is mounted, not ``/``) and ``Secure`` when the browser's side is https (the
  request's own scheme, or ``X-Forwarded-Proto`` with ``BATCHGEN_TRUSTED_PROXY``).
- The sign-in form refuses cross-site posts (login CSRF): the request's ``Origin``
  (or ``Sec-Fetch-Site``) must be this site, and the form carries a token equal to
  one in a cookie set with the form (double submit).
- Sign-ins are limited per client address and per key
  (``BATCHGEN_DASHBOARD_SIGNIN_ATTEMPTS`` in ``BATCHGEN_DASHBOARD_SIGNIN_WINDOW_S``):
  beyond that, 429 with Retry-After.
- A host bridge (the Django mount) may hand over a trusted operator identity in
  the WSGI environ (:data:`OPERATOR_ENVIRON_KEY`, never a header): the dashboard then
  shows the operator view without a key.
- Every dashboard answer forbids framing and content sniffing.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from urllib.parse import urlsplit

from flask import Response, request, url_for
from werkzeug.wrappers import Response as BaseResponse

from batchgen.config import get_settings
from batchgen.limits import sessions
from batchgen.limits.backend import get_redis
from batchgen.store import api_keys, tenants
from batchgen.store.db import session_scope
from batchgen.store.schema import Tenant

SESSION_COOKIE = "batchgen_session"
SIGNIN_COOKIE = "batchgen_signin"
# Set by a host's bridge in the WSGI environ (a client's headers arrive as HTTP_*,
# so no request can put it there): the name of an operator the host signed in.
OPERATOR_ENVIRON_KEY = "batchgen.operator"
SECURITY_HEADERS = {
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


class SigninRefused(Exception):
    """A sign-in refused before the key is looked at: status, message, Retry-After."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s


def is_https() -> bool:
    """Whether the browser talks https to us (through a trusted proxy's header too)."""
    if request.is_secure:
        return True
    if get_settings().api.trusted_proxy:
        proto = request.headers.get("X-Forwarded-Proto", "")
        return proto.split(",")[0].strip().lower() == "https"
    return False


def client_address() -> str:
    """The client's address: the connection's, or the trusted proxy's last hop entry."""
    if get_settings().api.trusted_proxy:
        forwarded = request.headers.get("X-Forwarded-For", "")
        hops = [hop.strip() for hop in forwarded.split(",") if hop.strip()]
        if hops:
            return hops[-1]  # what our proxy appended; earlier entries are the client's word
    return request.remote_addr or "unknown"


def cookie_path() -> str:
    """The mount the dashboard is served under (``/`` when at the root)."""
    page = url_for(".page")
    mount = page[: -len("/dashboard")] if page.endswith("/dashboard") else ""
    return mount or "/"


def _set_cookie(response: BaseResponse, name: str, value: str, max_age_s: float) -> None:
    response.set_cookie(
        name,
        value,
        max_age=int(max_age_s),
        httponly=True,
        samesite="Strict",
        secure=is_https(),
        path=cookie_path(),
    )


def _delete_cookie(response: BaseResponse, name: str) -> None:
    response.delete_cookie(
        name, path=cookie_path(), httponly=True, samesite="Strict", secure=is_https()
    )


def session_token() -> str | None:
    return request.cookies.get(SESSION_COOKIE) or None


def operator() -> str | None:
    """The operator a trusted host bridge signed in, if any."""
    name = request.environ.get(OPERATOR_ENVIRON_KEY)
    return name if isinstance(name, str) and name else None


def current_tenant() -> Tenant | None:
    """The tenant of the browser's live session (None: signed out, expired, its tenant
    suspended, or the key it signed in with revoked or expired)."""
    token = session_token()
    if token is None:
        return None
    found = sessions.of(get_redis(), token)
    if found is None:
        return None
    tenant_id, key_id = found
    with session_scope() as session:
        tenant = tenants.get_active(session, tenant_id)
        if tenant is None or (key_id is not None and not api_keys.works(session, key_id)):
            return None  # its tenant suspended, or the key it signed in with stopped
        session.expunge(tenant)
        return tenant


def csrf_token(token: str) -> str:
    """The token the dashboard's forms carry: bound to the session."""
    return hmac.new(token.encode(), b"batchgen-dashboard-csrf", hashlib.sha256).hexdigest()


def csrf_ok(form_token: str) -> bool:
    token = session_token()
    return token is not None and hmac.compare_digest(form_token, csrf_token(token))


def start_session(response: BaseResponse, tenant: Tenant, key_id: int | None = None) -> None:
    ttl_s = get_settings().dashboard.session_s
    token = sessions.create(get_redis(), tenant.id, ttl_s, key_id)
    _set_cookie(response, SESSION_COOKIE, token, ttl_s)
    _delete_cookie(response, SIGNIN_COOKIE)


def end_session(response: BaseResponse) -> None:
    token = session_token()
    if token is not None:
        sessions.delete(get_redis(), token)
    _delete_cookie(response, SESSION_COOKIE)


def signin_token() -> tuple[str, bool]:
    """The sign-in form's token: the one in the browser's cookie, or a new one (True:
    set it with :func:`remember_signin_token`)."""
    token = request.cookies.get(SIGNIN_COOKIE)
    if token:
        return token, False
    return secrets.token_urlsafe(24), True


def remember_signin_token(response: BaseResponse, token: str) -> None:
    _set_cookie(response, SIGNIN_COOKIE, token, get_settings().dashboard.session_s)


def same_origin() -> bool:
    """The request comes from a page of this site (a browser names a cross-site post's
    origin in ``Origin`` and ``Sec-Fetch-Site``)."""
    if request.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
        return False
    origin = request.headers.get("Origin")
    if origin is None:
        return True  # not a browser's cross-site post; the form token still has to match
    # The host only: behind a TLS proxy not declared trusted, the page's https origin
    # meets a request that looks like http; another site has another host anyway.
    return urlsplit(origin).netloc.lower() == request.host.lower()


def check_signin(key: str) -> None:
    """Refuse a cross-site sign-in, one without the form's token, and one over the
    limit (per client address and per key); counts the attempt."""
    if not same_origin():
        raise SigninRefused(403, "sign-in refused: the form was posted from another site")
    cookie = request.cookies.get(SIGNIN_COOKIE, "")
    form = request.form.get("csrf", "")
    if not cookie or not hmac.compare_digest(cookie, form):
        raise SigninRefused(403, "sign-in refused: reload the page and sign in again")
    settings = get_settings()
    client = get_redis()
    waits = []
    for kind, value in (("addr", client_address()), ("key", key)):
        if not value:
            continue
        count, left_s = sessions.count_attempt(
            client, kind, value, settings.dashboard.signin_window_s
        )
        if count > settings.dashboard.signin_attempts:
            waits.append(left_s)
    if waits:
        raise SigninRefused(
            429, "too many sign-in attempts: wait and try again", sessions.retry_after_s(max(waits))
        )


def secure(response: Response) -> Response:
    """Forbid framing and sniffing (and cache no signed-in page)."""
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    policy = response.headers["Content-Security-Policy"]
    if "frame-ancestors" not in policy:  # a page's own policy: add ours to it
        response.headers["Content-Security-Policy"] = f"{policy}; frame-ancestors 'none'"
    response.headers.setdefault("Cache-Control", "no-store")
    return response
