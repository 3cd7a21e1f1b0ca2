"""What every ``batchgen`` command shares: consoles, servers, errors and JSON output.

Exit codes: 0 ok, 1 an error (a clear message on stderr), 2 wrong usage.
Messages and progress bars go to stderr, results to stdout (``--json``:
one JSON document, an error's too, wrong usage included), and no command prints
prompt text.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Iterator
from typing import Any, NoReturn

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from sqlalchemy import exc as sa_exc
from typer.core import TyperGroup

from batchgen.config import Settings, get_settings
from batchgen.errors import BatchgenError

console = Console()
err = Console(stderr=True)

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
# The click context's mark of a command line that asked for --json.
JSON_META = "batchgen.json"
# PostgreSQL's SQLSTATE for a table that does not exist (the schema was never migrated).
UNDEFINED_TABLE = "42P01"


@contextlib.contextmanager
def services() -> Iterator[Settings]:
    """Ensure the servers run (embedded if no URLs are set), then yield fresh settings."""
    from batchgen import embedded

    with embedded.services(Settings().paths.data_dir):
        get_settings.cache_clear()
        yield get_settings()


def print_error(message: str) -> None:
    """Print ``error: message`` on stderr, the message as written (escaped: rich would
    take ``[embedded]`` in ``pip install 'batchgen-llm[embedded]'`` for markup)."""
    err.print(f"[red]error:[/red] {escape(message)}")


# Whether the running command line asked for --json (set by JsonErrorsGroup).
_json_asked: contextvars.ContextVar[bool] = contextvars.ContextVar("json_asked", default=False)
# The errors click reports itself: typer vendors click (typer._click) from 0.2x on, and
# its ClickException derives from TyperException; before, they are click's own.
CLICK_ERRORS = (click.ClickException, getattr(typer, "TyperException", click.ClickException))


def wants_json() -> bool:
    """Whether the running command line asked for ``--json``."""
    return _json_asked.get()


def _error_json(message: str, code: int, body: dict[str, Any] | None = None) -> None:
    fallback = {"code": "usage" if code == EXIT_USAGE else "error", "message": message}
    print_json({"error": body or fallback})


def _click_error_json(exc: Exception) -> None:
    """A click error (``format_message``, ``exit_code``) as the JSON document."""
    _error_json(exc.format_message(), exc.exit_code)  # type: ignore[attr-defined]


def fail(
    message: str, code: int = EXIT_ERROR, body: dict[str, Any] | None = None, as_json: bool = False
) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code``; under ``--json`` (or
    ``as_json``), the error (``body``, else ``{"code", "message"}``) is also the JSON
    document on stdout."""
    if as_json or wants_json():
        _error_json(message, code, body)
    print_error(message)
    raise typer.Exit(code)


class JsonErrorsGroup(TyperGroup):
    """The command group: under ``--json``, an error click reports itself (a missing
    argument, a bad option value, an unknown command: exit 2) is a JSON document on
    stdout too, as every other error is; its usual message still goes to stderr."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any
    ) -> Any:
        asked = "--json" in args
        try:
            ctx = super().make_context(info_name, args, parent, **extra)
        except CLICK_ERRORS as exc:
            if asked:
                _click_error_json(exc)
            raise
        ctx.meta[JSON_META] = asked
        return ctx

    def invoke(self, ctx: Any) -> Any:
        token = _json_asked.set(bool(ctx.meta.get(JSON_META)))
        try:
            return super().invoke(ctx)
        except CLICK_ERRORS as exc:
            if _json_asked.get():
                _click_error_json(exc)
            raise
        finally:
            _json_asked.reset(token)


@contextlib.contextmanager
def handled(as_json: bool = False) -> Iterator[None]:
    """Turn the project's errors into a message and exit code 1; with ``as_json``, the
    error is also the JSON document on stdout (``{"error": {"code", "message", …}}``),
    so a script reading stdout sees why."""
    try:
        yield
    except BatchgenError as exc:
        to_dict = getattr(exc, "to_dict", None)
        body = to_dict() if callable(to_dict) else {"code": "error", "message": str(exc)}
        fail(str(exc), body=body, as_json=as_json)
    except sa_exc.ProgrammingError as exc:
        if getattr(exc.orig, "sqlstate", None) != UNDEFINED_TABLE:
            raise
        message = (
            "the database has no batchgen tables: run `batchgen db upgrade`, or set "
            "DATABASE_URL to the database that has them"
        )
        fail(message, body={"code": "not_migrated", "message": message}, as_json=as_json)


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
