"""``manage.py describe SHOP``: a host job submitting a batch through batchgen's service
function, then looking at both dashboards; prints JSON."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.test import Client

from batchgen.integrations.django.services import submit_batch


class Command(BaseCommand):
    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("shop")

    def handle(self, *args: Any, **options: Any) -> None:
        shop = options["shop"]
        rows = [
            {
                "custom_id": f"{shop}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "sim-small",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": f"Describe product {i}."}],
                },
            }
            for i in range(3)
        ]
        batch = submit_batch(
            rows,
            tenant=shop,
            on_finished="django_host.batch_done",
            on_finished_queue="django_host",
        )
        client = Client()
        self.stdout.write(
            json.dumps(
                {
                    "batch": batch,
                    "host_dashboard": client.get("/dashboard/").content.decode(),
                    "batchgen_dashboard": client.get("/llm/dashboard").content.decode(),
                }
            )
        )
