"""The Python API for Django views and jobs: thin, documented calls into :mod:`app.client`.

    from app.integrations.django.services import submit_batch, get_batch

    def describe(request, shop):
        batch = submit_batch(rows, tenant=shop, completion_window="2h")
        return JsonResponse(batch)

Errors are :class:`app.errors.BatchgenError`; a ``ClientError`` carries the
``status_code`` and ``to_dict()`` the HTTP API answers with.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from app import client
from app.client import RequestLines
from app.schema import Tenant
from app.status import Priority


def submit_batch(
    requests: RequestLines,
    *,
    tenant: str | Tenant,
    completion_window: str | float = "24h",
    metadata: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    priority: Priority | str = Priority.INTERACTIVE,
) -> dict[str, Any]:
    """Validate and store a batch, all or nothing (see :func:`app.client.submit_batch`)."""
    return client.submit_batch(
        requests,
        tenant=tenant,
        completion_window=completion_window,
        metadata=metadata,
        idempotency_key=idempotency_key,
        priority=priority,
    )


def get_batch(batch_id: str, *, tenant: str | Tenant) -> dict[str, Any]:
    """Status and ``request_counts`` of one of the tenant's batches."""
    return client.get_batch(batch_id, tenant=tenant)


def list_batches(
    *, tenant: str | Tenant, limit: int = 20, after: str | None = None
) -> list[dict[str, Any]]:
    """The tenant's batches, newest first."""
    return client.list_batches(tenant=tenant, limit=limit, after=after)


def iter_results(batch_id: str, *, tenant: str | Tenant) -> Iterator[dict[str, Any]]:
    """Finished items in input order, in the OpenAI Batch output format."""
    return client.iter_results(batch_id, tenant=tenant)


def cancel_batch(batch_id: str, *, tenant: str | Tenant) -> dict[str, Any]:
    """Cancel the batch: items not yet running end now."""
    return client.cancel_batch(batch_id, tenant=tenant)
