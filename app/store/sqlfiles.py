"""SQL that SQLAlchemy cannot express cleanly lives in app/store/sql/*.sql, loaded by name."""

from __future__ import annotations

import functools
from importlib import resources

from sqlalchemy import TextClause, text


@functools.cache
def query(name: str) -> TextClause:
    """The statement in ``app/store/sql/<name>.sql``."""
    return text(resources.files("batchgen.store").joinpath("sql", f"{name}.sql").read_text("utf-8"))
