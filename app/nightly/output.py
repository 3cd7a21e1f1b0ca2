"""Writing a run's descriptions: a JSONL or CSV file (atomically) or a table."""

from __future__ import annotations

import csv
import datetime as dt
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from batchgen.atomic_files import replacing
from batchgen.nightly.jobs import Job, TableRef
from batchgen.store import host_tables


def description(row: dict[str, Any]) -> str | None:
    """The generated text of a result row (OpenAI Batch output), ``None`` for a failure."""
    if row.get("error") is not None:
        return None
    try:
        text = row["response"]["body"]["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None
    return text if isinstance(text, str) else None


def write_file(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write atomically (a temporary file renamed over the target): a rerun replaces it."""
    written = 0
    with replacing(path, newline="") as fh:
        if path.suffix.lower() == ".csv":
            writer = csv.DictWriter(fh, fieldnames=["id", "locale", "description"])
            writer.writeheader()
            for row in rows:
                writer.writerow(row)
                written += 1
        else:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
                written += 1
    return written


def write_table(ref: TableRef, job: Job, day: dt.date, rows: Iterable[dict[str, Any]]) -> int:
    """Replace the run's rows of the output table in one transaction; returns the count."""
    return host_tables.replace_run(ref.sqlalchemy_url(), ref.table, job.name, day, rows)


def write_text(path: Path, text: str) -> None:
    """Replace ``path``'s content atomically."""
    with replacing(path) as fh:
        fh.write(text)
