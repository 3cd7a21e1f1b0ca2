"""``manage.py check`` for batchgen: the settings it cannot run without, named.

Inside Django nothing starts embedded servers, so a site without batchgen's
database and Redis configured would only fail at the first call. These checks
say so at start-up instead, naming the setting to add. Nothing here connects to
a server (``manage.py check`` must stay fast and offline).
"""

from __future__ import annotations

import os
from typing import Any

from django.core.checks import Error, register

# (what is needed, the names that provide it, the check's id)
REQUIRED = (
    ("batchgen's PostgreSQL database", ("BATCHGEN_DATABASE_URL", "DATABASE_URL"), "batchgen.E001"),
    ("batchgen's Redis", ("BATCHGEN_REDIS_URL", "REDIS_URL"), "batchgen.E002"),
)


@register()
def batchgen_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """An error for each server batchgen has no address for (a setting of the site,
    exported by the app at start-up, or the environment)."""
    errors = []
    for what, names, check_id in REQUIRED:
        if not any(os.environ.get(name) for name in names):
            errors.append(
                Error(
                    f"no address for {what}",
                    hint=f"set {names[0]} in the Django settings (or {names[1]} in the "
                    "environment)",
                    id=check_id,
                )
            )
    return errors
