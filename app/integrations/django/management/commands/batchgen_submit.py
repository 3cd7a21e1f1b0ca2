"""``manage.py batchgen_submit FILE --tenant NAME``: submit a JSONL file as one batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from batchgen.errors import BatchgenError
from batchgen.integrations.django.services import submit_batch


class Command(BaseCommand):
    help = "Submit a JSONL file (OpenAI Batch input format) as one batch for a tenant."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", type=Path, help="JSONL requests, one per line.")
        parser.add_argument("--tenant", required=True, help="The tenant's name.")
        parser.add_argument(
            "--completion-window",
            default=None,
            help="e.g. 24h, 2h, 30m (default: BATCHGEN_DEFAULT_COMPLETION_WINDOW_S).",
        )
        parser.add_argument("--priority", choices=["interactive", "bulk"], default="interactive")
        parser.add_argument("--idempotency-key", default=None)
        parser.add_argument("--json", action="store_true", help="Print the batch as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        path: Path = options["file"]
        if not path.is_file():
            raise CommandError(f"no such file: {path}")
        try:
            batch = submit_batch(
                path,
                tenant=options["tenant"],
                completion_window=options["completion_window"],
                priority=options["priority"],
                idempotency_key=options["idempotency_key"],
            )
        except BatchgenError as exc:
            raise CommandError(str(exc)) from exc
        if options["json"]:
            self.stdout.write(json.dumps(batch))
        else:
            total = batch["request_counts"]["total"]
            self.stdout.write(f"{batch['id']} ({total} requests, {batch['status']})")
