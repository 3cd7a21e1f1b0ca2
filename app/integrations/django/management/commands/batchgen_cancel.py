"""``manage.py batchgen_cancel BATCH --tenant NAME``: cancel one of a tenant's batches."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from batchgen.errors import BatchgenError
from batchgen.integrations.django.services import cancel_batch


class Command(BaseCommand):
    help = "Cancel a batch: items not yet running end now, running calls are stopped."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("batch", help="The batch id.")
        parser.add_argument("--tenant", required=True, help="The tenant's name.")
        parser.add_argument("--json", action="store_true", help="Print the batch as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            batch = cancel_batch(options["batch"], tenant=options["tenant"])
        except BatchgenError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(
            json.dumps(batch) if options["json"] else f"{batch['id']} {batch['status']}"
        )
