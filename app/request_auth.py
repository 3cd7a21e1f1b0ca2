"""Who a request is: its API key, checked once per request (works, holds a scope the
route needs, is within its own rate), and the tenant it belongs to. Shared by the
tenant API (:mod:`batchgen.api`) and the admin API (:mod:`batchgen.admin_api`)."""

from __future__ import annotations

from flask import g, request

from batchgen.domain import keys as key_rules
from batchgen.errors import KeyRateLimited
from batchgen.limits import key_rate
from batchgen.limits.backend import get_redis
from batchgen.python_api import Caller, authenticate


def bearer() -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def api_key() -> str | None:
    """The tenant key: ``Authorization: Bearer`` (OpenAI's SDK), else ``x-api-key``
    (Anthropic's SDK)."""
    return bearer() or (request.headers.get("x-api-key", "").strip() or None)


def current_key() -> Caller:
    """The request's API key and tenant, checked once per request: it works (else 401),
    it holds a scope the route needs (else 403 ``key_out_of_scope``) and is within its
    own requests per minute (else 429 ``key_rate_limited``). One indexed lookup (one
    statement, autocommit), no cache: a revoked key is refused from its next request on."""
    if "caller" not in g:
        caller = authenticate(api_key())  # one statement, autocommit
        key_rules.check_scope(request.endpoint, caller.scopes)
        if caller.requests_per_min is not None:
            wait_s = key_rate.take(get_redis(), caller.key_id, caller.requests_per_min)
            if wait_s > 0:
                raise KeyRateLimited(
                    f"this API key's limit of {caller.requests_per_min} requests per minute "
                    "is used up",
                    retry_after_s=wait_s,
                )
        g.caller = caller
    found: Caller = g.caller
    return found
