"""The site's tasks, ``@shared_task`` as in Celery's "First steps with Django": bound to
the current app, which must be the site's (host_site/celery.py), never batchgen's."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from celery import shared_task

# The test runs batchgen's processes in this folder: none of them may import this.
if os.environ.get("HOST_MARKS"):
    Path(os.environ["HOST_MARKS"], f"{Path(__file__).parent.name}.{__name__}").touch()


def _record(variable: str, line: dict[str, Any]) -> None:
    with open(os.environ[variable], "a", encoding="utf-8") as out:
        out.write(json.dumps({**line, "role": os.environ.get("HOST_ROLE")}) + "\n")


@shared_task(name="django_host.batch_done")
def batch_done(batch_id: str, status: str, *args: Any, **kwargs: Any) -> None:
    """batchgen's on_finished callback: the batch ended."""
    _record("HOST_CALLBACKS_FILE", {"batch_id": batch_id, "status": status})


@shared_task
def ping(origin: str) -> None:
    """A site task sent with ``.delay()`` from the web, a command or another task."""
    _record("HOST_PINGS_FILE", {"origin": origin})


@shared_task
def relay() -> None:
    """Run in the site's worker, with batchgen loaded there: sends a ping on."""
    from batchgen import python_api  # noqa: F401  (a task of the site uses batchgen)

    ping.delay("worker")
    _record("HOST_PINGS_FILE", {"origin": "relay"})
