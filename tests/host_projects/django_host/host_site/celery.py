"""The site's own Celery app, laid out as Celery's "First steps with Django": its
settings are the ``CELERY_*`` names of the Django settings (its own broker,
HOST_BROKER_URL; queue django_host), its tasks the ``@shared_task`` functions of the
installed apps' ``tasks.py``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import worker_ready

# The test runs batchgen's processes in this folder: none of them may import this.
if os.environ.get("HOST_MARKS"):
    Path(os.environ["HOST_MARKS"], f"{Path(__file__).parent.name}.{__name__}").touch()

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "host_site.settings")

app = Celery("host_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_ready.connect
def _ready(**_: Any) -> None:
    if os.environ.get("HOST_READY_FILE"):
        Path(os.environ["HOST_READY_FILE"]).touch()
