"""The Flask extension: mount the batch API in a host app and hand it the Python API.

    from flask import Flask
    from app.integrations.flask import BatchGen

    app = Flask(__name__)
    app.config["BATCHGEN_URL_PREFIX"] = "/llm"   # default "/batchgen"
    batchgen = BatchGen(app)                      # or BatchGen().init_app(app)

    @app.post("/shops/<shop>/describe")
    def describe(shop):
        batch = batchgen.submit_batch(rows, tenant=shop)   # or current_app.extensions["batchgen"]

The API's routes answer under the prefix exactly as the standalone API does
(``POST <prefix>/v1/batches`` …); a :class:`~app.errors.BatchgenError` raised
in any view of the host app becomes the same JSON error answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flask import Flask

from app import client
from app.client import RequestLines
from app.integrations import apply_settings
from app.schema import Tenant
from app.status import Priority

DEFAULT_URL_PREFIX = "/batchgen"
EXTENSION_KEY = "batchgen"


class BatchGen:
    """Flask extension: ``BatchGen(app)`` or ``BatchGen().init_app(app)``."""

    def __init__(self, app: Flask | None = None) -> None:
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Export the app's ``BATCHGEN_*`` config, mount the API, register the extension."""
        from app.api import blueprint

        apply_settings(app.config)
        prefix = app.config.setdefault("BATCHGEN_URL_PREFIX", DEFAULT_URL_PREFIX)
        app.register_blueprint(blueprint, url_prefix=(prefix or "").rstrip("/") or None)
        app.extensions[EXTENSION_KEY] = self

    # The Python API (app.client), for the host app's own views and jobs.

    def submit_batch(
        self,
        requests: RequestLines,
        *,
        tenant: str | Tenant,
        completion_window: str | float = "24h",
        metadata: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        priority: Priority | str = Priority.INTERACTIVE,
    ) -> dict[str, Any]:
        """Validate and store a batch for ``tenant`` (see :func:`app.client.submit_batch`)."""
        return client.submit_batch(
            requests,
            tenant=tenant,
            completion_window=completion_window,
            metadata=metadata,
            idempotency_key=idempotency_key,
            priority=priority,
        )

    def get_batch(self, batch_id: str, *, tenant: str | Tenant) -> dict[str, Any]:
        """Status and ``request_counts`` of one of the tenant's batches."""
        return client.get_batch(batch_id, tenant=tenant)

    def list_batches(
        self, *, tenant: str | Tenant, limit: int = 20, after: str | None = None
    ) -> list[dict[str, Any]]:
        """The tenant's batches, newest first."""
        return client.list_batches(tenant=tenant, limit=limit, after=after)

    def iter_results(self, batch_id: str, *, tenant: str | Tenant) -> Iterator[dict[str, Any]]:
        """Finished items in input order, in the OpenAI Batch output format."""
        return client.iter_results(batch_id, tenant=tenant)

    def cancel_batch(self, batch_id: str, *, tenant: str | Tenant) -> dict[str, Any]:
        """Cancel the batch: items not yet running end now."""
        return client.cancel_batch(batch_id, tenant=tenant)
