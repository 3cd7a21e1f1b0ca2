"""``manage.py batchgen_signals [--follow] [--poll-s S]``: send ``batch_finished`` for the
site's batches that ended (the site's receivers run in this process, and only here)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from batchgen.integrations import DEFAULT_SIGNAL_POLL_S, SIGNAL_POLL_KEY, run_signals
from batchgen.integrations.django.signals import deliver_signals


class Command(BaseCommand):
    help = (
        "Send the batch_finished signal for this site's batches that ended, once each; "
        "--follow keeps sending as batches end."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--follow", action="store_true", help="Keep delivering.")
        parser.add_argument(
            "--poll-s", type=float, default=None, help="Seconds between polls (default 1)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from django.conf import settings

        poll_s = options["poll_s"] or float(
            getattr(settings, SIGNAL_POLL_KEY, None) or DEFAULT_SIGNAL_POLL_S
        )
        sent = run_signals(deliver_signals, follow=options["follow"], poll_s=poll_s)
        self.stdout.write(f"{sent} batch_finished signals sent")
