"""The hot path's statements run on psycopg itself (store.db.driver_rows): the same
answers, the same errors and the same pool behaviour as through SQLAlchemy."""

from __future__ import annotations

import pytest
from sqlalchemy import exc, text

from batchgen.store import db
from batchgen.store.sqlfiles import driver_query


def test_rows_are_named_and_typed_as_through_sqlalchemy(clean_db):
    statement = "SELECT %(n)s::int AS n, now() AS at, '{\"a\": 1}'::jsonb AS doc, '50%%' AS pct"
    with db.autocommit() as connection:
        (row,) = db.driver_rows(connection, statement, {"n": 7})
        through = connection.execute(
            text("SELECT :n ::int AS n, now() AS at, '{\"a\": 1}'::jsonb AS doc, '50%' AS pct"),
            {"n": 7},
        ).one()
    assert (row.n, row.doc, row.pct) == (7, {"a": 1}, "50%")
    assert (type(row.at), type(row.doc)) == (type(through.at), type(through.doc))
    assert (row.n, row.doc, row.pct) == (through.n, through.doc, through.pct)


def test_a_statement_without_rows_returns_no_rows_in_the_sessions_transaction(clean_db):
    with db.session_scope() as session:
        assert db.driver_rows(session, "CREATE TEMP TABLE t (x int)", {}) == []
        db.driver_rows(session, "INSERT INTO t VALUES (%(x)s)", {"x": 3})
        assert session.scalar(text("SELECT x FROM t")) == 3  # one transaction, one connection


def test_a_wrong_statement_raises_sqlalchemys_error_without_its_parameters(clean_db):
    with db.autocommit() as connection:
        with pytest.raises(exc.ProgrammingError) as raised:
            db.driver_rows(connection, "SELECT %(secret)s::int FROM nowhere", {"secret": "p-7731"})
        assert not raised.value.connection_invalidated
        assert not db.is_transient(raised.value)
        assert "p-7731" not in str(raised.value)
        (row,) = db.driver_rows(connection, "SELECT 1 AS one", {})  # the connection still works
    assert row.one == 1


def test_a_killed_backend_invalidates_the_connection_and_the_next_checkout_works(clean_db):
    with db.autocommit() as connection:
        (victim,) = db.driver_rows(connection, "SELECT pg_backend_pid() AS pid", {})
        with db.autocommit() as other:
            other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": victim.pid})
        with pytest.raises(exc.OperationalError) as raised:
            db.driver_rows(connection, "SELECT 1 AS one", {})
        assert raised.value.connection_invalidated
        assert db.is_transient(raised.value)
        assert connection.invalidated
    with db.autocommit() as connection:
        (row,) = db.driver_rows(connection, "SELECT pg_backend_pid() AS pid", {})
    assert row.pid != victim.pid


def test_arrays_in_the_binary_format_arrive_as_they_were_sent(clean_db):
    """A pack's statements send their parameters in the binary format: numbers, text,
    NULLs and JSON (quotes, backslashes, braces, non-ASCII) arrive unchanged."""
    from decimal import Decimal

    from psycopg.types.json import Jsonb

    from batchgen import json_codec

    answers = [{"content": 'say "hi" \\ {a,b} caf\u00e9 \U0001f642', "n": [1, None]}, {}]
    params = {
        "ids": [1, 2**40],
        "costs": [Decimal("0.000123"), None],
        "names": ['a "b", {c}', None],
        "answers": [Jsonb(a, dumps=json_codec.dumps) for a in answers],
        "flag": True,
    }
    statement = (
        "SELECT CAST(%(ids)b AS bigint[]) AS ids, CAST(%(costs)b AS numeric[]) AS costs, "
        "CAST(%(names)b AS text[]) AS names, CAST(%(answers)b AS jsonb[]) AS answers, "
        "%(flag)b AS flag"
    )
    with db.autocommit() as connection:
        (row,) = db.driver_rows(connection, statement, params)
    assert row.ids == params["ids"] and row.costs == params["costs"]
    assert row.names == params["names"] and row.answers == answers and row.flag is True


def test_hot_statements_name_every_parameter_for_psycopg():
    for name in ("item_claim_sent", "item_succeed_answered"):
        statement = driver_query(name)
        assert "%(item_id)s" in statement and ":item_id" not in statement
        assert "%(attempt)s" in statement
        binary = driver_query(name, binary=True)
        assert "%(item_id)b" in binary and "%(item_id)s" not in binary
