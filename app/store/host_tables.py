"""The host project's tables that nightly jobs read and write (batchgen.nightly), in a
database of the host's own (a SQLAlchemy URL): a product catalog read row by row, and
a descriptions table whose run's rows are replaced in one transaction.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

from sqlalchemy import Column, Date, MetaData, String, Table, Text, create_engine, select

from batchgen.errors import ConfigError

ROWS_PER_FETCH = 1000
ROWS_PER_INSERT = 1000


def read_rows(url: str, table_name: str, order_by: str) -> Iterator[dict[str, Any]]:
    """Every row of ``table_name`` (``schema.table`` or ``table``) as a dict, ordered by
    the column ``order_by``, fetched a thousand at a time; :class:`ConfigError` when the
    table has no such column."""
    engine = create_engine(url)
    try:
        schema, _, name = table_name.rpartition(".")
        table = Table(name, MetaData(), schema=schema or None, autoload_with=engine)
        if order_by not in table.c:
            raise ConfigError(f"catalog table {table_name} has no column {order_by!r}")
        query = select(table).order_by(table.c[order_by])
        with engine.connect() as conn:
            rows = conn.execute(query, execution_options={"yield_per": ROWS_PER_FETCH})
            for row in rows:
                yield dict(row._mapping)
    finally:
        engine.dispose()


def descriptions_table(name: str) -> Table:
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


def replace_run(
    url: str, table_name: str, job: str, day: dt.date, rows: Iterable[dict[str, Any]]
) -> int:
    """Replace the rows of run (``job``, ``day``) in the descriptions table with
    ``rows`` (``id``, ``locale``, ``description``), in one transaction, so that a rerun
    replaces them; returns how many were written."""
    table = descriptions_table(table_name)
    engine = create_engine(url)
    written = 0
    try:
        table.create(engine, checkfirst=True)
        with engine.begin() as conn:
            conn.execute(table.delete().where(table.c.job == job, table.c.run_date == day))
            source = iter(rows)
            while chunk := list(islice(source, ROWS_PER_INSERT)):
                conn.execute(
                    table.insert(),
                    [
                        {
                            "product_id": r["id"],
                            "job": job,
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
