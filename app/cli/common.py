"""What every ``batchgen`` command shares: consoles, servers, errors and JSON output.

Exit codes: 0 ok, 1 an error (a clear message on stderr), 2 wrong usage.
Messages and progress bars go to stderr, results to stdout (``--json``:
one JSON document), and no command prints prompt text.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from sqlalchemy import exc as sa_exc

from batchgen.config import Settings, get_settings
from batchgen.errors import BatchgenError

console = Console()
err = Console(stderr=True)

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
# PostgreSQL's SQLSTATE for a table that does not exist (the schema was never migrated).
UNDEFINED_TABLE = "42P01"


@contextlib.contextmanager
def services() -> Iterator[Settings]:
    """Ensure the servers run (embedded if no URLs are set), then yield fresh settings."""
    from batchgen import embedded

    with embedded.services(Settings().data_dir):
        get_settings.cache_clear()
        yield get_settings()


def print_error(message: str) -> None:
    """Print ``error: message`` on stderr, the message as written (escaped: rich would
    take ``[embedded]`` in ``pip install 'batchgen-llm[embedded]'`` for markup)."""
    err.print(f"[red]error:[/red] {escape(message)}")


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code``."""
    print_error(message)
    raise typer.Exit(code)


@contextlib.contextmanager
def handled(as_json: bool = False) -> Iterator[None]:
    """Turn the project's errors into a message and exit code 1; with ``as_json``, the
    error is also the JSON document on stdout (``{"error": {"code", "message", …}}``),
    so a script reading stdout sees why."""
    try:
        yield
    except BatchgenError as exc:
        if as_json:
            to_dict = getattr(exc, "to_dict", None)
            body = to_dict() if callable(to_dict) else {"code": "error", "message": str(exc)}
            print_json({"error": body})
        fail(str(exc))
    except sa_exc.ProgrammingError as exc:
        if getattr(exc.orig, "sqlstate", None) != UNDEFINED_TABLE:
            raise
        message = (
            "the database has no batchgen tables: run `batchgen db upgrade`, or set "
            "DATABASE_URL to the database that has them"
        )
        if as_json:
            print_json({"error": {"code": "not_migrated", "message": message}})
        fail(message)


def print_json(data: Any) -> None:
    """One JSON document on stdout."""
    typer.echo(json.dumps(data, default=str))


def progress() -> Progress:
    """A progress bar on stderr (counts, elapsed time)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
    )
