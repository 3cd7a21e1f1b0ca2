"""Celery tasks only: dispatch, generate, sweep. The logic lives in app/."""
