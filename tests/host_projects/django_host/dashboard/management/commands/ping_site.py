"""``manage.py ping_site``: sends the site's ``ping`` task (``.delay()``) from a command."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from dashboard.tasks import ping


class Command(BaseCommand):
    def handle(self, *args: Any, **options: Any) -> None:
        ping.delay("command")
