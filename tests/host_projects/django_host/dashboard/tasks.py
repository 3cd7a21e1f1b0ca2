"""The host's own Celery app, on its own broker (HOST_BROKER_URL), queue django_host."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import worker_ready

# The test runs batchgen's processes in this folder: none of them may import this.
if os.environ.get("HOST_MARKS"):
    Path(os.environ["HOST_MARKS"], f"{Path(__file__).parent.name}.{__name__}").touch()

celery = Celery("django_host", broker=os.environ["HOST_BROKER_URL"])
celery.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    task_default_queue="django_host",
)


@celery.task(name="django_host.batch_done")
def batch_done(batch_id: str, status: str, *args: Any, **kwargs: Any) -> None:
    """batchgen's on_finished callback: the batch ended."""
    line = {"batch_id": batch_id, "status": status, "role": os.environ.get("HOST_ROLE")}
    with open(os.environ["HOST_CALLBACKS_FILE"], "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


@worker_ready.connect
def _ready(**_: Any) -> None:
    if os.environ.get("HOST_READY_FILE"):
        Path(os.environ["HOST_READY_FILE"]).touch()
