"""Logging setup: plain or one JSON object per line; never prompt or completion text.

Our own log calls carry ids, sizes, token counts and timings. The SDKs log
full request bodies at DEBUG level, so their loggers are held at WARNING
whatever the root level is.
"""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

from app.config import get_settings

# Loggers that would print request or response bodies when verbose.
QUIET_LOGGERS = ("openai", "anthropic", "httpx", "httpcore", "urllib3")
_configured = False


def configure_logging(json_lines: bool | None = None, level: str | None = None) -> None:
    """Configure the root logger once per process (idempotent)."""
    global _configured
    if _configured:
        return
    settings = get_settings()
    use_json = settings.log_json if json_lines is None else json_lines
    handler = logging.StreamHandler(sys.stderr)
    if use_json:
        handler.setFormatter(
            JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s %(process)d")
        )
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level or settings.log_level)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    _configured = True
