"""``manage.py batchgen_usage [--tenant NAME] [--from DAY] [--to DAY]``: usage and cost."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from batchgen.errors import BatchgenError
from batchgen.integrations.django.services import usage


class Command(BaseCommand):
    help = "Requests, tokens, cost and waste per model (or day, or tenant) from the ledger."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--tenant", default=None, help="One tenant (default: all tenants).")
        parser.add_argument("--from", dest="start", default=None, help="First day, YYYY-MM-DD.")
        parser.add_argument("--to", dest="end", default=None, help="Last day, YYYY-MM-DD.")
        parser.add_argument(
            "--group-by", choices=["model", "day", "tenant", "deployment"], default="model"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            rows = usage(
                tenant=options["tenant"],
                start=options["start"],
                end=options["end"],
                group_by=options["group_by"],
            )
        except BatchgenError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(json.dumps(rows, default=str))
