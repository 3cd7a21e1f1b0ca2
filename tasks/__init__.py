"""Celery tasks only: dispatch, generate, sweep, offload, notify, retention, nightly. The
logic lives in batchgen (app/).

``celery -A batchgen.tasks worker`` finds the Celery application here as ``app``.
"""

from batchgen.tasks.celery_app import celery_app as app

celery = app

__all__ = ["app", "celery"]
