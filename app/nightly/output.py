"""Writing a run's descriptions: a JSONL or CSV file (atomically) or a table."""

from __future__ import annotations

import csv
import datetime as dt
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Date, MetaData, String, Table, Text, create_engine

from batchgen.atomic_files import replacing
from batchgen.nightly.catalog import chunks
from batchgen.nightly.jobs import Job, TableRef


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


def output_table(name: str) -> Table:
    """The descriptions table a job writes to (created when missing)."""
    schema, _, table = name.rpartition(".")
    return Table(
        table,
        MetaData(),
        Column("product_id", String(512), primary_key=True),
        Column("job", String(100), primary_key=True),
        Column("run_date", Date, primary_key=True),
        Column("locale", String(35)),
        Column("description", Text),
        schema=schema or None,
    )


def write_table(ref: TableRef, job: Job, day: dt.date, rows: Iterable[dict[str, Any]]) -> int:
    """Replace the run's rows of the output table in one transaction; returns the count."""
    table = output_table(ref.table)
    engine = create_engine(ref.sqlalchemy_url())
    written = 0
    try:
        table.create(engine, checkfirst=True)
        with engine.begin() as conn:  # one transaction: a rerun replaces the run's rows
            conn.execute(table.delete().where(table.c.job == job.name, table.c.run_date == day))
            for chunk in chunks(rows, 1000):
                conn.execute(
                    table.insert(),
                    [
                        {
                            "product_id": r["id"],
                            "job": job.name,
                            "run_date": day,
                            "locale": r["locale"],
                            "description": r["description"],
                        }
                        for r in chunk
                    ],
                )
                written += len(chunk)
    finally:
        engine.dispose()
    return written


def write_text(path: Path, text: str) -> None:
    """Replace ``path``'s content atomically."""
    with replacing(path) as fh:
        fh.write(text)
