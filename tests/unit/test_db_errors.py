"""Which database errors a worker waits out (retrying the transaction) and which it raises."""

from __future__ import annotations

import psycopg
from sqlalchemy import exc

from batchgen.store.db import is_transient


def _wrapped(cls: type[exc.DBAPIError], orig: Exception) -> exc.DBAPIError:
    return cls("SELECT 1", None, orig)


def test_outages_and_pool_time_outs_are_transient():
    assert is_transient(exc.TimeoutError("QueuePool limit reached"))
    assert is_transient(psycopg.OperationalError("connection refused"))
    assert is_transient(_wrapped(exc.OperationalError, psycopg.OperationalError("gone")))
    assert is_transient(_wrapped(exc.InterfaceError, psycopg.InterfaceError("closed")))


def test_wrong_statements_are_not_transient():
    assert not is_transient(_wrapped(exc.IntegrityError, psycopg.IntegrityError("dup")))
    assert not is_transient(_wrapped(exc.ProgrammingError, psycopg.ProgrammingError("syntax")))
    assert not is_transient(ValueError("not a database error"))
