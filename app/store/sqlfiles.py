"""SQL that SQLAlchemy cannot express cleanly lives in app/store/sql/*.sql, loaded by name.

A line ``--! include <name>`` is replaced by ``sql/include/<name>.sql`` (a part that
two statements share, such as the daily totals that follow a ledger row).

Comment lines and indentation are for the reader of the file and are left out of the
statement: psycopg caches the parsing of a statement only up to 4 096 bytes (longer ones
are parsed again on every execution), and the hot path's record of an answer was longer
with them (tests/unit/test_architecture.py checks every statement fits). No string
literal in these files spans lines, so no indentation is inside one.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

from sqlalchemy import TextClause, text

_INCLUDE = re.compile(r"^--! include ([a-z_]+)$", re.MULTILINE)
_COMMENT_LINE = re.compile(r"^\s*--.*(?:\n|$)", re.MULTILINE)
_INDENT = re.compile(r"^[ \t]+", re.MULTILINE)
# A bind parameter ``:name`` (not a ``::type`` cast, not a time literal's colon).
_BIND = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


def _read(*parts: str) -> str:
    return resources.files("batchgen.store").joinpath("sql", *parts).read_text("utf-8")


def source(name: str) -> str:
    """The text of ``app/store/sql/<name>.sql``, its includes in place."""

    def part(match: re.Match[str]) -> str:
        return _read("include", f"{match.group(1)}.sql").rstrip("\n")

    return _INDENT.sub("", _COMMENT_LINE.sub("", _INCLUDE.sub(part, _read(f"{name}.sql"))))


@functools.cache
def query(name: str) -> TextClause:
    """The statement in ``app/store/sql/<name>.sql``."""
    return text(source(name))


@functools.cache
def driver_query(name: str, binary: bool = False) -> str:
    """The statement in ``app/store/sql/<name>.sql`` as psycopg itself takes it
    (``:name`` becomes ``%(name)s``, a ``%`` is doubled), for
    :func:`batchgen.store.db.driver_rows`. ``binary``: every parameter goes in
    PostgreSQL's binary format (``%(name)b``): a pack's arrays of answers, whose JSON
    the text format escapes element by element (quotes and backslashes, in Python),
    go as they are."""
    return _BIND.sub(r"%(\1)b" if binary else r"%(\1)s", source(name).replace("%", "%%"))
