"""Host-framework integrations: a Flask extension and a reusable Django app.

Both mount the same HTTP API (:mod:`batchgen.api`) under a prefix the host app
chooses and hand trusted server code the Python API (:mod:`batchgen.python_api`).
Settings named ``BATCHGEN_*`` in the host app's configuration are exported to
the environment, where the one settings object (:mod:`batchgen.config`) and every
child process (a worker started from the host) read them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "BATCHGEN_"
# Keys the integrations read themselves; they are no settings of the service.
LOCAL_KEYS = frozenset({"BATCHGEN_URL_PREFIX"})


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float | PurePath):
        return str(value)
    return json.dumps(value)  # lists and dicts, as pydantic-settings parses them


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
