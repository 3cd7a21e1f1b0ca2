"""The Python API for Django views and jobs: thin, documented calls into :mod:`batchgen.python_api`.

    from batchgen.integrations.django.services import submit_batch, get_batch

    def describe(request, shop):
        batch = submit_batch(rows, tenant=shop, completion_window="2h")
        return JsonResponse(batch)

Errors are :class:`batchgen.errors.BatchgenError`; a ``ClientError`` carries the
``status_code`` and ``to_dict()`` the HTTP API answers with.
"""

from __future__ import annotations

from batchgen.python_api import (
    cancel_batch,
    get_batch,
    iter_results,
    list_batches,
    submit_batch,
    usage,
)

__all__ = ["cancel_batch", "get_batch", "iter_results", "list_batches", "submit_batch", "usage"]
