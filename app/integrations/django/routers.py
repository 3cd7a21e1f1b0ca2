"""Where batchgen's models live: the database alias ``BATCHGEN_DJANGO_DATABASE``
(default ``"batchgen"``), which the site declares in ``DATABASES`` with
:func:`database_from_url`. Django never migrates them (Alembic owns the schema).

    DATABASES["batchgen"] = database_from_url(BATCHGEN_DATABASE_URL)
    DATABASE_ROUTERS = ["batchgen.integrations.django.routers.BatchgenRouter"]
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

APP_LABEL = "batchgen"
DEFAULT_ALIAS = "batchgen"


def alias() -> str:
    from django.conf import settings

    return str(getattr(settings, "BATCHGEN_DJANGO_DATABASE", DEFAULT_ALIAS))


def database_from_url(url: str) -> dict[str, Any]:
    """A ``DATABASES`` entry for batchgen's PostgreSQL URL (``postgresql://u:p@h:5432/db``;
    libpq's query parameters too: ``?host=/run/postgresql`` for a socket folder,
    ``sslmode=…`` and the others go to ``OPTIONS``)."""
    parts = urlsplit(url)
    if parts.scheme.split("+")[0] not in ("postgresql", "postgres"):
        raise ValueError("batchgen's database is PostgreSQL: a postgresql:// URL")
    query = dict(parse_qsl(parts.query))
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": query.pop("host", None) or parts.hostname or "",
        "PORT": query.pop("port", None) or str(parts.port or ""),
        "OPTIONS": query,
    }


class BatchgenRouter:
    """Reads of batchgen's models go to its alias; nothing of them is written or migrated."""

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return alias() if model._meta.app_label == APP_LABEL else None

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return alias() if model._meta.app_label == APP_LABEL else None

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool | None:
        labels = {obj1._meta.app_label, obj2._meta.app_label}
        return True if labels == {APP_LABEL} else None

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return False if app_label == APP_LABEL else None
