"""A host project's own Celery app, for the batch-finished callback test: its worker
listens on ``host.callbacks`` and appends each call it gets to ``HOST_CALLBACKS_FILE``.

    celery -A tests.host_callbacks worker -Q host.callbacks -P threads -c 1
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery

app = Celery("hostapp", broker=os.environ["CELERY_BROKER_URL"])
app.conf.update(task_serializer="json", accept_content=["json"], task_ignore_result=True)


@app.task(name="hostapp.batch_done")
def batch_done(batch_id: str, status: str, request_counts: dict[str, Any]) -> None:
    with open(os.environ["HOST_CALLBACKS_FILE"], "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"batch_id": batch_id, "status": status, "counts": request_counts}))
        fh.write("\n")
