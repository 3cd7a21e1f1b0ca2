"""Databases on a PostgreSQL server, by name: created when missing, dropped (the
embedded servers' and the tests' own databases, :mod:`batchgen.embedded`)."""

from __future__ import annotations

import psycopg
from psycopg import sql


def create_if_missing(url: str, name: str) -> None:
    """Create database ``name`` on the server of ``url`` (a libpq URL) unless it exists."""
    with psycopg.connect(url, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop(url: str, name: str) -> None:
    """Drop database ``name`` on the server of ``url`` if it exists, its sessions ended."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
