"""``manage.py check`` for batchgen: the settings it cannot run without, named.

Inside Django nothing starts embedded servers, so a site without batchgen's
database and Redis configured would only fail at the first call. These checks
say so at start-up instead, naming the setting to add: the servers' addresses
(E001, E002), and the database alias batchgen's models are read through when the
site uses them (the admin is installed, or the router is): E003. Nothing here
connects to a server (``manage.py check`` must stay fast and offline).
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


ROUTER = "batchgen.integrations.django.routers.BatchgenRouter"


@register()
def batchgen_database_alias(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """An error when batchgen's models are in use (the admin or the router is installed)
    but ``DATABASES`` has no entry for their alias (``BATCHGEN_DJANGO_DATABASE``)."""
    from django.apps import apps
    from django.conf import settings
    from django.db import connections

    from batchgen.integrations.django.routers import DEFAULT_ALIAS, alias

    routed = ROUTER in [str(r) for r in getattr(settings, "DATABASE_ROUTERS", [])]
    if not (routed or apps.is_installed("django.contrib.admin")):
        return []
    name = alias()
    if name in connections.settings:
        return []
    named = (
        "the default alias" if name == DEFAULT_ALIAS else "the alias BATCHGEN_DJANGO_DATABASE names"
    )
    return [
        Error(
            f"DATABASES has no entry {name!r}, {named} for batchgen's tables (its admin "
            "and models read them there)",
            hint=f'add DATABASES["{name}"] = database_from_url(BATCHGEN_DATABASE_URL) '
            "(from batchgen.integrations.django.routers), or set BATCHGEN_DJANGO_DATABASE "
            "to the alias of batchgen's database",
            id="batchgen.E003",
        )
    ]
