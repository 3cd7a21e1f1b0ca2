"""API keys: their scopes, which scope each route needs, and when a key works.

Pure. A tenant has many keys (``api_keys``); each holds a set of scopes:

- ``batches``: submit, read and cancel batches (OpenAI's and Anthropic's) and files;
- ``calls``: synchronous calls (chat/completions, messages, responses, embeddings);
- ``read``: read only (batches, results, files, usage, the status and metrics views);
- ``admin``: the tenant's own keys (``/v1/keys``), nothing else.

A route's requirement is a set of scopes of which the key must hold one. Routes
that name no scope (the model list, health) take any working key.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from enum import StrEnum

from batchgen.errors import Forbidden, ValidationFailed


class Scope(StrEnum):
    BATCHES = "batches"
    CALLS = "calls"
    READ = "read"
    ADMIN = "admin"


ALL_SCOPES: tuple[str, ...] = tuple(s.value for s in Scope)
# A new key's scopes unless it names its own: everything but key management.
DEFAULT_SCOPES: tuple[str, ...] = (Scope.BATCHES, Scope.CALLS, Scope.READ)
# A key rotated without saying when the old one stops keeps working this long.
DEFAULT_OVERLAP_S = 24 * 3600.0
MAX_OVERLAP_S = 90 * 24 * 3600.0
# last_used_at is written at most once per this many seconds per key.
LAST_USED_EVERY_S = 60.0
# What a key's secret starts with, and how much of it is kept to name it.
SECRET_PREFIX = "bg_"
SHOWN_PREFIX_CHARS = 12

_B, _C, _R, _A = Scope.BATCHES, Scope.CALLS, Scope.READ, Scope.ADMIN
_WRITE_BATCHES = frozenset({_B})
_READ_BATCHES = frozenset({_B, _R})
# Each route of the tenant API (Flask endpoint name) and the scopes that open it.
ROUTE_SCOPES: dict[str, frozenset[str]] = {
    "batchgen_api.create_batch": _WRITE_BATCHES,
    "batchgen_api.cancel_batch": _WRITE_BATCHES,
    "batchgen_api.upload_file": _WRITE_BATCHES,
    "batchgen_api.delete_file": _WRITE_BATCHES,
    "batchgen_api.create_message_batch": _WRITE_BATCHES,
    "batchgen_api.cancel_message_batch": _WRITE_BATCHES,
    "batchgen_api.list_batches": _READ_BATCHES,
    "batchgen_api.get_batch": _READ_BATCHES,
    "batchgen_api.batch_notifications": _READ_BATCHES,
    "batchgen_api.batch_results": _READ_BATCHES,
    "batchgen_api.list_files": _READ_BATCHES,
    "batchgen_api.get_file": _READ_BATCHES,
    "batchgen_api.file_content": _READ_BATCHES,
    "batchgen_api.list_message_batches": _READ_BATCHES,
    "batchgen_api.get_message_batch": _READ_BATCHES,
    "batchgen_api.message_batch_results": _READ_BATCHES,
    "batchgen_api.chat_completions": frozenset({_C}),
    "batchgen_api.messages": frozenset({_C}),
    "batchgen_api.responses": frozenset({_C}),
    "batchgen_api.embeddings": frozenset({_C}),
    "batchgen_api.usage": frozenset({_R}),
    "batchgen_api.status": frozenset({_R}),
    "batchgen_api.metrics": frozenset({_R}),
    "batchgen_admin.list_own_keys": frozenset({_A}),
    "batchgen_admin.create_own_key": frozenset({_A}),
    "batchgen_admin.rotate_own_key": frozenset({_A}),
    "batchgen_admin.revoke_own_key": frozenset({_A}),
}
# Routes any working key may call (what an SDK asks before anything else).
OPEN_ROUTES = frozenset(
    {"batchgen_api.list_models", "batchgen_api.get_model", "batchgen_api.healthz"}
)


def parse_scopes(scopes: Iterable[str] | str | None) -> list[str]:
    """Scopes as stored: known, each once, in :data:`ALL_SCOPES` order. None: the
    defaults; a string: comma separated."""
    if scopes is None:
        return list(DEFAULT_SCOPES)
    if isinstance(scopes, str):
        scopes = [s for s in (part.strip() for part in scopes.split(",")) if s]
    wanted = set()
    for scope in scopes:
        if not isinstance(scope, str) or scope not in ALL_SCOPES:
            raise ValidationFailed(
                f"unknown scope {scope!r}: scopes are {', '.join(ALL_SCOPES)}", field="scopes"
            )
        wanted.add(scope)
    if not wanted:
        raise ValidationFailed("a key needs at least one scope", field="scopes")
    return [s for s in ALL_SCOPES if s in wanted]


def check_scope(endpoint: str | None, scopes: Iterable[str]) -> None:
    """Raise :class:`KeyOutOfScope` (403) unless a key holding ``scopes`` may call the
    route ``endpoint`` (a Flask endpoint name; None or unlisted: any key may)."""
    needed = ROUTE_SCOPES.get(endpoint or "")
    held = set(scopes)
    if needed is None or held & needed:
        return
    names = " or ".join(sorted(needed))
    raise KeyOutOfScope(
        f"this API key's scopes ({', '.join(sorted(held))}) do not include {names}, "
        "which this request needs",
        needed=sorted(needed),
    )


# The dashboard shows a tenant's batches and submits and cancels them: signing in takes
# a key that may do both.
DASHBOARD_SCOPES = (Scope.BATCHES, Scope.READ)


def check_dashboard_scopes(scopes: Iterable[str]) -> None:
    """Raise :class:`KeyOutOfScope` unless a key holding ``scopes`` may sign in to the
    dashboard (it needs every one of :data:`DASHBOARD_SCOPES`)."""
    missing = [s.value for s in DASHBOARD_SCOPES if s not in set(scopes)]
    if missing:
        raise KeyOutOfScope(
            f"signing in to the dashboard needs a key with the scopes batches and read "
            f"(this one lacks {', '.join(missing)})",
            needed=missing,
        )


class KeyOutOfScope(Forbidden):
    """A working key without the scope the route needs (403 ``key_out_of_scope``)."""

    code = "key_out_of_scope"

    def __init__(self, message: str, *, needed: list[str]) -> None:
        super().__init__(message)
        self.needed = needed

    def to_dict(self) -> dict[str, object]:
        return {**super().to_dict(), "needed_scopes": self.needed}


def refusal(
    now: dt.datetime, expires_at: dt.datetime | None, revoked_at: dt.datetime | None
) -> str | None:
    """Why a key does not work at ``now`` (a 401's message), None when it does."""
    if revoked_at is not None and revoked_at <= now:
        return "this API key was revoked"
    if expires_at is not None and expires_at <= now:
        return "this API key has expired"
    return None


def last_used_due(
    now: dt.datetime, last_used_at: dt.datetime | None, every_s: float = LAST_USED_EVERY_S
) -> bool:
    """Whether a use at ``now`` is to be written (at most once per ``every_s``)."""
    return last_used_at is None or (now - last_used_at).total_seconds() >= every_s


def rotation_expiry(
    now: dt.datetime, current: dt.datetime | None, overlap_s: float | None
) -> dt.datetime:
    """When a rotated key stops: ``overlap_s`` from ``now`` (default a day), never later
    than it would have anyway."""
    if overlap_s is None:
        overlap_s = DEFAULT_OVERLAP_S
    if not 0 <= overlap_s <= MAX_OVERLAP_S:
        raise ValidationFailed(
            f"overlap_s must be between 0 and {MAX_OVERLAP_S:.0f}", field="overlap_s"
        )
    ends = now + dt.timedelta(seconds=overlap_s)
    return min(ends, current) if current is not None else ends


def parse_expiry(
    now: dt.datetime, expires_at: str | dt.datetime | None, expires_in_s: float | None
) -> dt.datetime | None:
    """A key's expiry from an ISO time (with its offset) or seconds from ``now``; it
    must lie in the future. Both None: it never expires."""
    if expires_at is not None and expires_in_s is not None:
        raise ValidationFailed("give expires_at or expires_in_s, not both", field="expires_at")
    if expires_in_s is not None:
        if not isinstance(expires_in_s, int | float) or expires_in_s <= 0:
            raise ValidationFailed("expires_in_s must be a positive number", field="expires_in_s")
        return now + dt.timedelta(seconds=float(expires_in_s))
    if expires_at is None:
        return None
    if isinstance(expires_at, str):
        try:
            expires_at = dt.datetime.fromisoformat(expires_at)
        except ValueError as exc:
            raise ValidationFailed(
                "expires_at must be an ISO 8601 time like 2026-12-01T00:00:00Z",
                field="expires_at",
            ) from exc
    if expires_at.tzinfo is None:
        raise ValidationFailed("expires_at needs a time zone (e.g. Z)", field="expires_at")
    if expires_at <= now:
        raise ValidationFailed("expires_at is in the past", field="expires_at")
    return expires_at


def shown_prefix(secret: str) -> str:
    """The start of a key kept in clear, to tell keys apart (never enough to use one)."""
    return secret[:SHOWN_PREFIX_CHARS]


def gcra_interval_ms(requests_per_min: int) -> int:
    """Milliseconds between requests at a steady ``requests_per_min``."""
    return max(1, round(60_000 / requests_per_min))
