"""Logging setup: plain or one JSON object per line; never prompt or completion text.

Our own log calls carry ids, sizes, token counts and timings. Three guards
keep request text out of logs written by others:

* The SDKs log full request bodies at DEBUG level, so their loggers are held
  at WARNING whatever the root level is.
* A database error's message may quote the statement's data (PostgreSQL's
  ``CONTEXT: JSON data, line 1: …`` quotes the prompt), so a record carrying
  one keeps only its class and SQLSTATE (:class:`DatabaseErrorRedactor`).
* Access logs of the HTTP servers (werkzeug, gunicorn, Django's runserver)
  keep the path, never the query string, where ``metadata`` travels
  (:func:`redact_access_logs`).
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from typing import Any

from pythonjsonlogger.json import JsonFormatter

from batchgen.config import get_settings

# Loggers that would print request or response bodies when verbose.
QUIET_LOGGERS = ("openai", "anthropic", "httpx", "httpcore", "urllib3")
# The access loggers of werkzeug's dev server, gunicorn and Django's runserver.
ACCESS_LOGGERS = ("werkzeug", "gunicorn.access", "django.server")
# The protocol at the end of a request line (and a colour code werkzeug may add).
_REQUEST_TAIL = re.compile(r"\s+HTTP/\d(?:\.\d)?\S*$")
_configured = False


def _is_database_error(exc: BaseException) -> bool:
    from sqlalchemy.exc import StatementError

    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg is a dependency
        return isinstance(exc, StatementError)
    return isinstance(exc, StatementError | psycopg.Error)


def _database_error_in(exc: BaseException | None) -> BaseException | None:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if _is_database_error(exc):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def describe_database_error(exc: BaseException) -> str:
    """``ClassName (sqlstate XXXXX)``: all of a database error a log may show."""
    orig = getattr(exc, "orig", exc)
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None) or "-"
    return f"{type(exc).__name__} (sqlstate {state})"


class DatabaseErrorRedactor(logging.Filter):
    """Replace a database error in a record (its traceback or an argument) by its
    class and SQLSTATE: the message may quote request text."""

    def filter(self, record: logging.LogRecord) -> bool:
        found = _database_error_in(record.exc_info[1] if record.exc_info else None)
        if found is not None:
            record.msg = f"{record.getMessage()} [{describe_database_error(found)}]"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        elif isinstance(record.args, tuple) and any(
            isinstance(a, BaseException) and _database_error_in(a) for a in record.args
        ):
            record.args = tuple(
                describe_database_error(a)
                if isinstance(a, BaseException) and _database_error_in(a)
                else a
                for a in record.args
            )
        return True


def strip_query(text: str) -> str:
    """A request line (``GET /p?q HTTP/1.1``) or URL without its query string."""
    head, sep, rest = text.partition("?")
    if not sep:
        return text
    tail = _REQUEST_TAIL.search(rest)
    return head + (tail.group(0) if tail else "")


class AccessLogRedactor(logging.Filter):
    """Drop query strings from access log records (werkzeug, gunicorn, Django)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, Mapping):  # gunicorn's atoms: r = request line, q = query
            atoms: dict[str, Any] = dict(args)
            for key in ("r", "f"):
                if isinstance(atoms.get(key), str):
                    atoms[key] = strip_query(atoms[key])
            if "q" in atoms:
                atoms["q"] = "-"
            record.args = atoms
        elif isinstance(args, tuple):
            record.args = tuple(strip_query(a) if isinstance(a, str) else a for a in args)
        if isinstance(record.msg, str) and not args:
            record.msg = strip_query(record.msg)
        return True


def redact_access_logs() -> None:
    """Keep query strings out of the HTTP servers' access logs (idempotent)."""
    for name in ACCESS_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, AccessLogRedactor) for f in logger.filters):
            logger.addFilter(AccessLogRedactor())


# Celery's own per-task lines ("received", "succeeded in") of the tasks that run every
# second or so: an idle dispatcher would log two of them per tick.
TICK_TASKS = (
    "batchgen.dispatch",
    "batchgen.sweep",
    "batchgen.offload",
    "batchgen.notify",
    "batchgen.retention",
)
CELERY_TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace")


class TickLogFilter(logging.Filter):
    """Drops Celery's INFO lines about the dispatch tick and the sweep (their failures,
    at WARNING and above, still pass); every other task's lines are kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        try:
            message = record.getMessage()
        except Exception:
            return True
        return not any(message.startswith(f"Task {name}[") for name in TICK_TASKS)


def quiet_ticks() -> None:
    """Install :class:`TickLogFilter` on Celery's task loggers (idempotent)."""
    for name in CELERY_TASK_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, TickLogFilter) for f in logger.filters):
            logger.addFilter(TickLogFilter())


def configure_logging(json_lines: bool | None = None, level: str | None = None) -> None:
    """Configure the root logger once per process (idempotent)."""
    global _configured
    redact_access_logs()
    quiet_ticks()
    if _configured:
        return
    settings = get_settings()
    use_json = settings.log.json_lines if json_lines is None else json_lines
    handler = logging.StreamHandler(sys.stderr)
    if use_json:
        handler.setFormatter(
            JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s %(process)d")
        )
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
        )
    handler.addFilter(DatabaseErrorRedactor())
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level or settings.log.level)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    _configured = True
