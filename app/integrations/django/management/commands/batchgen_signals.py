"""``manage.py batchgen_signals [--once] [--interval S]``: send ``batch_finished`` for
batches that ended (the site's receivers run in this process)."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from batchgen.integrations.django.signals import deliver_signals


class Command(BaseCommand):
    help = "Send the batch_finished signal for every batch that ended (at least once each)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="One pass, then exit.")
        parser.add_argument("--interval", type=float, default=2.0, help="Seconds between passes.")

    def handle(self, *args: Any, **options: Any) -> None:
        while True:
            sent = deliver_signals()
            if options["once"]:
                self.stdout.write(f"{sent} batch_finished signals sent")
                return
            time.sleep(options["interval"])
