"""Host-framework integrations: a Flask extension and a reusable Django app.

Both mount the same HTTP API (:mod:`batchgen.api`) under a prefix the host app
chooses and hand trusted server code the Python API (:mod:`batchgen.python_api`).

Settings named ``BATCHGEN_*`` in a Flask app's configuration make that app's own
:class:`~batchgen.config.Settings` (:func:`settings_from_config`, over the
environment, which is left alone), so two apps in one process keep two databases.
A Django site has one settings module: its ``BATCHGEN_*`` settings are exported to
the environment (:func:`apply_settings`), where the settings object and every child
process (a worker started from the site) read them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.config import Settings

log = logging.getLogger(__name__)

PREFIX = "BATCHGEN_"
# Keys the integrations read themselves; they are no settings of the service.
APP_ID_KEY = "BATCHGEN_APP_ID"  # the host app's id: its batches' origin
SIGNAL_POLL_KEY = "BATCHGEN_SIGNAL_POLL_S"  # the signal command's --poll-s default
LOCAL_KEYS = frozenset({"BATCHGEN_URL_PREFIX", APP_ID_KEY, SIGNAL_POLL_KEY})
DEFAULT_SIGNAL_POLL_S = 1.0


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float | PurePath):
        return str(value)
    return json.dumps(value)  # lists and dicts, as pydantic-settings parses them


def settings_from_config(config: Mapping[str, Any]) -> Settings:
    """The settings of a host app: its config's ``BATCHGEN_*`` entries over the
    environment (the config wins), validated as the environment would be (a bad
    value is a :class:`pydantic.ValidationError` naming it). ``os.environ`` is not
    touched."""
    from batchgen.config import FLAT_NAMES, Settings

    values: dict[str, Any] = {}
    for key, value in config.items():
        if not key.startswith(PREFIX) or key in LOCAL_KEYS or value is None:
            continue
        name = key[len(PREFIX) :].lower()
        if name not in FLAT_NAMES:
            continue  # not a service setting (pydantic-settings ignores it too)
        values[name] = value  # Settings routes the flat name to its concern
    return Settings(**values)


def apply_settings(config: Mapping[str, Any]) -> dict[str, str]:
    """Export the ``BATCHGEN_*`` entries of a host app's config; returns what was set.

    The host's configuration wins over the environment. The settings cache is
    cleared so the next :func:`batchgen.config.get_settings` sees the new values.
    """
    from batchgen.config import get_settings

    exported = {
        key: _env_value(value)
        for key, value in config.items()
        if key.startswith(PREFIX) and key not in LOCAL_KEYS and value is not None
    }
    for key, value in exported.items():
        # BATCHGEN_DATABASE_URL (and _REDIS_URL, _CELERY_BROKER_URL) win over the
        # conventional names, which a 12-factor host sets for its own database.
        os.environ[key] = value
    get_settings.cache_clear()
    return exported


def run_signals(
    deliver: Callable[[], int],
    *,
    follow: bool,
    poll_s: float,
    stop: Callable[[], bool] = lambda: False,
) -> int:
    """The host's signal command: ``deliver`` what is due (the app's own batches), once,
    or with ``follow`` again every ``poll_s`` seconds until ``stop()`` (or the process
    ends); returns how many were delivered. The one place a host's ``batch_finished``
    receivers run: no thread is started in whatever else imports the app."""
    sent = 0
    while True:
        try:
            sent += deliver()
        except Exception as exc:  # the database is away: try again at the next poll
            if not follow:
                raise
            log.warning("batchgen signals: %s; polling on", type(exc).__name__)
        if not follow or stop():
            return sent
        time.sleep(poll_s)
