"""Flower behind its own basic auth everywhere that tells anything.

Flower 2 checks credentials only in handlers marked ``@tornado.web.authenticated``;
its ``/metrics`` is not, so its Prometheus text (task names, worker names, counts and
runtimes per task) is open to anyone who reaches the port, auth or not.
:func:`require_auth` marks it, in this process, before ``batchgen flower`` starts
Flower. ``/healthcheck`` stays open on purpose: it answers the constant ``OK`` and
nothing else, and probes (Docker, Kubernetes) call it without credentials.
"""

from __future__ import annotations

from typing import Any

GUARDED = "_batchgen_requires_auth"


def require_auth() -> None:
    """Make Flower's ``/metrics`` ask for the same auth as its other pages (idempotent)."""
    from flower.views import monitor
    from tornado import web

    handler: Any = monitor.Metrics
    if getattr(handler.get, GUARDED, False):
        return
    guarded = web.authenticated(handler.get)
    setattr(guarded, GUARDED, True)
    handler.get = guarded
