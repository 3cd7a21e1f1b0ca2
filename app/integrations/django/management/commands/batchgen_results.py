"""``manage.py batchgen_results BATCH --tenant NAME [-o FILE]``: a batch's results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from batchgen.atomic_files import replacing
from batchgen.errors import BatchgenError
from batchgen.integrations.django.services import iter_results


class Command(BaseCommand):
    help = "Write a batch's finished results (OpenAI Batch output format) as JSONL."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("batch", help="The batch id.")
        parser.add_argument("--tenant", required=True, help="The tenant's name.")
        parser.add_argument(
            "-o", "--output", type=Path, default=None, help="A file (default: stdout)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            rows = iter_results(options["batch"], tenant=options["tenant"])
            first = next(rows, None)  # the batch is checked before anything is written
            lines = (json.dumps(row, ensure_ascii=False) for row in _chain(first, rows))
            output: Path | None = options["output"]
            if output is None:
                for line in lines:
                    self.stdout.write(line)
                return
            written = 0
            with replacing(output) as fh:
                for line in lines:
                    fh.write(line + "\n")
                    written += 1
        except BatchgenError as exc:
            raise CommandError(str(exc)) from exc
        self.stderr.write(f"{written} results written to {output}")


def _chain(first: Any, rest: Any) -> Any:
    if first is not None:
        yield first
        yield from rest
