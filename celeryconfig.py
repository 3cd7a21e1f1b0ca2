"""Celery's settings live in the package: ``batchgen.celeryconfig`` (app/celeryconfig.py).

Kept in the checkout for tools started from its root; not installed, so a host project's own
``celeryconfig`` is never shadowed."""

from batchgen.celeryconfig import *  # noqa: F403
