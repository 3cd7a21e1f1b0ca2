"""The host's receiver of batchgen's batch_finished signal."""

from __future__ import annotations

import json
import os
from typing import Any

from django.dispatch import receiver

from batchgen.integrations.django.signals import batch_finished


@receiver(batch_finished)
def on_batch_finished(sender: Any, batch_id: str, status: str, **extra: Any) -> None:
    line = {"batch_id": batch_id, "status": status, "role": os.environ.get("HOST_ROLE")}
    with open(os.environ["HOST_SIGNALS_FILE"], "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
