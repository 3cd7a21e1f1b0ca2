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
    batch_notifications,
    cancel_batch,
    cancel_message_batch,
    create_batch,
    create_message_batch,
    delete_file,
    get_batch,
    get_file,
    get_message_batch,
    iter_file_content,
    iter_message_batch_results,
    iter_results,
    list_batches,
    list_files_page,
    list_message_batches_page,
    submit_batch,
    upload_file,
    usage,
)

__all__ = [
    "batch_notifications",
    "cancel_batch",
    "cancel_message_batch",
    "create_batch",
    "create_message_batch",
    "delete_file",
    "get_batch",
    "get_file",
    "get_message_batch",
    "iter_file_content",
    "iter_message_batch_results",
    "iter_results",
    "list_batches",
    "list_files_page",
    "list_message_batches_page",
    "submit_batch",
    "upload_file",
    "usage",
]
