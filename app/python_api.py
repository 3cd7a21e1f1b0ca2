"""The Python API for trusted server-side code (a Django view, a Flask route, a job).

Each function opens its own transaction and names the tenant by name; the
HTTP API authenticates an API key and then calls the same functions with the
tenant it found. All raise the project's typed exceptions (:mod:`batchgen.errors`).

    from batchgen.python_api import submit_batch, get_batch, iter_results, cancel_batch

    batch = submit_batch(requests, tenant="acme", completion_window="2h")
    get_batch(batch["id"], tenant="acme")["request_counts"]

Tenants and keys are managed with the functions of :mod:`batchgen.tenant_admin`, also
importable from here (``create_tenant``, ``create_key``, ``rotate_key``, ...): each
change is written to the audit log with its ``actor``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from batchgen import tenant_admin
from batchgen.config import get_settings
from batchgen.domain.formats import message_batches
from batchgen.domain.formats.endpoints import BATCH_ENDPOINTS, unknown_endpoint
from batchgen.domain.lifecycle.deadlines import parse_duration_s
from batchgen.domain.lifecycle.status import Priority, parse_priority, sdk_priority
from batchgen.domain.notifications import retry_delay_s
from batchgen.domain.scheduling.offload import OffloadMode, parse_offload
from batchgen.domain.scheduling.routes import RouteMode, parse_route
from batchgen.domain.submission import SubmitOptions
from batchgen.errors import (
    ClientError,
    NotFound,
    Overloaded,
    ValidationFailed,
)
from batchgen.limits import counters
from batchgen.limits.backend import get_redis
from batchgen.registry import ModelSpec, ProviderKind, get_registry
from batchgen.store import api_keys, batches, db, files, tenants
from batchgen.store import batch_notifications as notifications
from batchgen.store.api_keys import Caller as Caller
from batchgen.store.db import session_scope
from batchgen.store.schema import Tenant as Tenant
from batchgen.telemetry import tracing
from batchgen.worker import cancellation, publish, webhooks
from batchgen.worker.call_answers import StreamPart as StreamPart
from batchgen.worker.call_answers import stream_call as stream_call
from batchgen.worker.call_answers import wait_call as wait_call
from batchgen.worker.call_runner import PendingCall as PendingCall
from batchgen.worker.call_runner import start_call as start_call

log = logging.getLogger(__name__)

# Tenant and key management (batchgen.tenant_admin), from here too.
audit_log = tenant_admin.audit_log
create_key = tenant_admin.create_key
create_tenant = tenant_admin.create_tenant
get_tenant = tenant_admin.get_tenant
list_keys = tenant_admin.list_keys
list_tenants = tenant_admin.list_tenants
resume_tenant = tenant_admin.resume_tenant
revoke_key = tenant_admin.revoke_key
rotate_key = tenant_admin.rotate_key
suspend_tenant = tenant_admin.suspend_tenant
update_key = tenant_admin.update_key
update_tenant = tenant_admin.update_tenant

RequestLines = Iterable[bytes] | Iterable[Mapping[str, Any]] | str | Path


def _tenant(session: Session, tenant: str | Tenant) -> Tenant:
    return tenants.find(session, tenant)


def as_lines(requests: RequestLines) -> Iterator[bytes]:
    """JSONL byte lines from a path, bytes lines, or request dicts."""
    if isinstance(requests, str | Path):
        with open(requests, "rb") as fh:
            yield from fh
        return
    for entry in requests:
        if isinstance(entry, bytes | bytearray):
            yield bytes(entry)
        else:
            yield json.dumps(entry, ensure_ascii=False).encode("utf-8") + b"\n"


def _count_rejection(tenant: str, reason: str) -> None:
    """Count a refused submit (metrics); never in a transaction, never raises."""
    try:
        counters.record_rejection(get_redis(), tenant, reason)
    except Exception as exc:  # the refusal itself is what the caller must see
        log.warning("could not count a rejection: %s", type(exc).__name__)


# Who is asking: each source names the host app (Flask, Django) a call is made in,
# or None. Context-bound sources (a Flask app context) come before process-wide ones
# (a Django site); the first answer wins. Registered by batchgen.integrations.
_origin_sources: list[Callable[[], str | None]] = []


def register_origin(source: Callable[[], str | None], *, process_wide: bool = False) -> None:
    """Make ``source`` name the host app of calls (``batches.origin``); once per source."""
    if source in _origin_sources:
        return
    if process_wide:
        _origin_sources.append(source)
    else:
        _origin_sources.insert(0, source)


def current_origin() -> str | None:
    """The id of the host app this call is made in (None: no host app)."""
    for source in _origin_sources:
        origin = source()
        if origin:
            return origin
    return None


def submit(
    tenant: str | Tenant, lines: Iterable[bytes], options: SubmitOptions
) -> tuple[dict[str, Any], bool]:
    """Store a batch in a transaction of its own; returns its description and ``created``.

    The transaction holds advisory locks (app/store/quotas.py), so it makes no network
    call but PostgreSQL's: a webhook URL's host is resolved and checked before it (a
    private or loopback target is a 400), a refusal is counted in Redis after the
    rollback, and the dispatcher is woken after the commit. Once the batch is
    committed, nothing turns the answer into an error.
    """
    name: str | None = None
    started_ns = time.time_ns()
    settings = get_settings()
    webhooks.check_url(options.webhook_url, settings.webhooks.allow_nets)
    if options.origin is None:
        options = dataclasses.replace(options, origin=current_origin())
    try:
        with session_scope() as session:
            owner = _tenant(session, tenant)
            name = owner.name
            batch, created = batches.store_batch(
                session, owner, lines, options, get_registry(), settings
            )
            described = batches.describe(session, batch)
            if settings.submit.dry_run:
                raise _DryRun(described)  # rolls the transaction back
    except _DryRun as dry:
        return {**dry.described, "dry_run": True}, False
    except (ClientError, Overloaded) as exc:
        if name is not None:
            _count_rejection(name, exc.code)
        raise
    if created:
        total = described["request_counts"]["total"]
        tracing.submitted(described["id"], name or "", total, started_ns)
        wake_dispatcher()
    return described, created


class _DryRun(Exception):
    """``BATCHGEN_DRY_RUN``: the batch was validated and described, and is not kept."""

    def __init__(self, described: dict[str, Any]) -> None:
        super().__init__("dry run")
        self.described = described


def wake_dispatcher() -> None:
    """Tell a dispatcher new work is waiting: best effort, it never raises.

    The batch is committed already and the beat tick releases it anyway, so a
    failure here (the broker down) is logged, never answered.
    """
    publish.wake_dispatcher_quietly()


def submit_batch(
    requests: RequestLines,
    *,
    tenant: str | Tenant,
    completion_window: str | float | None = None,
    metadata: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    priority: Priority | str = Priority.INTERACTIVE,
    offload: OffloadMode | str = OffloadMode.AUTO,
    route: RouteMode | str = RouteMode.AUTO,
    on_finished: str | None = None,
    on_finished_queue: str | None = None,
    webhook_url: str | None = None,
) -> dict[str, Any]:
    """Validate and store a batch (all or nothing), then wake the dispatcher.

    ``requests`` is a JSONL file path, an iterable of JSONL byte lines, or an
    iterable of dicts in the OpenAI Batch input format
    (``{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body"}``).
    With an ``idempotency_key`` this tenant already used for the same request,
    the existing batch is returned and nothing new is stored; for another
    request, :class:`~batchgen.errors.IdempotencyKeyReused` (422) is raised.
    ``offload``: may bulk items go to the provider's own Batch API (``auto``, the
    default, when the model offloads and the deadline allows; ``never``; ``always``).
    ``route``: the routes its items may take (``auto``, the default: by deadline and
    priority, standard calls for near deadlines, flex calls where the model offers them
    and the deadline leaves room, the provider's Batch API for the rest; ``standard``;
    ``flex``; ``batch``: see docs/offload.md).
    When the batch ends, ``on_finished`` (a Celery task name of the host's, sent to
    ``on_finished_queue``, default ``celery``) is called with the batch id, its status
    and counts (the operator lists the task names and queues a submit may name:
    ``BATCHGEN_CALLBACK_TASKS``, ``BATCHGEN_CALLBACK_QUEUES``), and ``webhook_url``
    (else the tenant's; a public address unless ``BATCHGEN_WEBHOOK_ALLOW_NETS`` opens
    more) gets a Standard Webhooks signed POST, at least once each. Called inside a
    Flask or Django host app, the batch is that app's (``origin``): its signal command
    fires its ``batch_finished``.
    """
    options = SubmitOptions(
        completion_window=completion_window,
        metadata=metadata,
        idempotency_key=idempotency_key,
        priority=parse_priority(priority),
        offload=parse_offload(offload),
        route=parse_route(route),
        on_finished=on_finished,
        on_finished_queue=on_finished_queue,
        webhook_url=webhook_url,
    )
    return submit(tenant, as_lines(requests), options)[0]


def get_batch(batch_id: str, *, tenant: str | Tenant) -> dict[str, Any]:
    """Status and ``request_counts`` of one of the tenant's batches (any, for an admin)."""
    with session_scope() as session:
        batch = batches.get_readable_batch(session, _tenant(session, tenant), batch_id)
        return batches.describe(session, batch)


def batch_notifications(batch_id: str, *, tenant: str | Tenant) -> list[dict[str, Any]]:
    """The batch's end announcements and their delivery so far (channel, attempts,
    status, last error code)."""
    with session_scope() as session:
        batch = batches.get_readable_batch(session, _tenant(session, tenant), batch_id)
        return notifications.of_batch(session, batch.id)


def deliver_signals(
    handler: Callable[[dict[str, Any]], None], limit: int = 100, *, origin: str
) -> int:
    """Call ``handler`` with the announcement of each finished batch of host app
    ``origin`` not yet handled (``{"type": "batch.finished", "batch_id", "status",
    "request_counts", "finished_at"}``); returns how many were handled.

    Once each: it is claimed in a transaction (``FOR UPDATE SKIP LOCKED``: several
    signal processes share the work) and recorded delivered in it when ``handler``
    returned, so only a crash mid-handler makes it come again. A ``handler`` that
    raises leaves it for a later try (the error's class is kept, never its text); the
    integrations' handlers catch each receiver's error, so one receiver's failure
    repeats no other's. Run by the host's signal command (``manage.py batchgen_signals``,
    ``flask batchgen signals``).
    """
    handled = 0
    for _ in range(limit):
        with session_scope() as session, notifications.claim_signal(session, origin) as due:
            if due is None:
                break
            try:
                handler(due.payload)
            except Exception as exc:
                delay_s = retry_delay_s(
                    due.attempts + 1, get_settings().webhooks.notify_retry_first_s
                )
                notifications.failed(session, due, f"handler:{type(exc).__name__}", delay_s)
                continue
            notifications.delivered(session, due)
            handled += 1
    return handled


def list_batches(
    *, tenant: str | Tenant, limit: int = 20, after: str | None = None
) -> list[dict[str, Any]]:
    """The tenant's batches, newest first."""
    return list(list_batches_page(tenant=tenant, limit=limit, after=after)["data"])


def list_batches_page(
    *, tenant: str | Tenant, limit: int = 20, after: str | None = None
) -> dict[str, Any]:
    """One page of the tenant's batches as the API lists them:
    ``{"object": "list", "data", "has_more", "first_id", "last_id"}``."""
    with session_scope() as session:
        owner = _tenant(session, tenant)
        page, has_more = batches.list_page(session, owner, limit=limit, after=after)
        data = [batches.describe(session, b) for b in page]
    return list_object(data, has_more)


def cursor_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page as Anthropic lists: ``{"data", "has_more", "first_id", "last_id"}``."""
    return {
        "data": data,
        "has_more": has_more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page as OpenAI lists: the cursor page, and ``"object": "list"``."""
    return {"object": "list", **cursor_page(data, has_more)}


def iter_results(batch_id: str, *, tenant: str | Tenant) -> Iterator[dict[str, Any]]:
    """Finished items of a batch in input order, OpenAI Batch output format."""
    with session_scope() as session:
        batch = batches.get_readable_batch(session, _tenant(session, tenant), batch_id)
        yield from batches.iter_results(session, batch)


def check_batch(batch_id: str, *, tenant: Tenant) -> None:
    """Raise :class:`NotFound` unless the (authenticated) tenant can read ``batch_id``
    (before a stream of its results starts)."""
    with session_scope() as session:
        batches.get_readable_batch(session, tenants.attach(session, tenant), batch_id)


def cancel_batch(batch_id: str, *, tenant: str | Tenant) -> dict[str, Any]:
    """Cancel one of the tenant's own batches (an admin key, too, cancels only its own):
    items not yet running end now; running calls are stopped."""
    return cancellation.cancel_batch(batch_id, tenant)


# --- files, and batches created from them (the OpenAI Files and Batches flow) -------

# An upload a batch is created from is held in memory up to this size, else on disk.
SPOOL_IN_MEMORY_BYTES = 4 * 1024 * 1024


def upload_file(
    content: bytes | str | Path,
    *,
    tenant: str | Tenant,
    filename: str | None = None,
    purpose: str = files.BATCH_PURPOSE,
    expires_after_s: int | None = None,
) -> dict[str, Any]:
    """Validate a batch input file (every line, as a submit would) and keep it in
    PostgreSQL; returns OpenAI's ``FileObject``. ``content`` is the bytes or a path."""
    if isinstance(content, str | Path):
        path = Path(content)
        filename = filename or path.name
        content = path.read_bytes()
    with session_scope() as session:
        stored = files.store_file(
            session,
            _tenant(session, tenant),
            content,
            filename=filename or "upload.jsonl",
            purpose=purpose,
            expires_after_s=expires_after_s,
            registry=get_registry(),
            settings=get_settings(),
        )
        return files.describe_file(stored)


def get_file(file_id: str, *, tenant: str | Tenant) -> dict[str, Any]:
    """One of the tenant's files (an upload, or a batch's output or error file)."""
    with session_scope() as session:
        owner = _tenant(session, tenant)
        output = files.get_output_file(session, owner, file_id, sized=True)
        if output is not None:
            return files.describe_output(session, output)
        return files.describe_file(files.get_file(session, owner, file_id))


def check_file(file_id: str, *, tenant: str | Tenant) -> None:
    """Raise :class:`NotFound` unless the tenant can read ``file_id`` (before a stream)."""
    with session_scope() as session:
        owner = _tenant(session, tenant)
        if files.get_output_file(session, owner, file_id) is None:
            files.get_file(session, owner, file_id)


def iter_file_content(file_id: str, *, tenant: str | Tenant) -> Iterator[bytes]:
    """A file's content in chunks; a batch's output or error file is rendered from its
    results as it is read."""
    with session_scope() as session:
        owner = _tenant(session, tenant)
        output = files.get_output_file(session, owner, file_id)
        if output is not None:
            yield from files.output_chunks(session, output)
        else:
            yield from files.upload_pieces(session, owner, file_id)


def list_files_page(
    *,
    tenant: str | Tenant,
    limit: int = 10_000,
    after: str | None = None,
    order: str = "desc",
    purpose: str | None = None,
) -> dict[str, Any]:
    """One page of the tenant's uploads, as ``client.files.list()`` pages them."""
    with session_scope() as session:
        owner = _tenant(session, tenant)
        page, has_more = files.list_page(
            session, owner, limit=limit, after=after, order=order, purpose=purpose
        )
        data = [files.describe_file(f) for f in page]
    return list_object(data, has_more)


def delete_file(file_id: str, *, tenant: str | Tenant) -> dict[str, Any]:
    """Delete one of the tenant's uploads; batches made from it are not touched."""
    with session_scope() as session:
        return files.delete_file(session, _tenant(session, tenant), file_id)


TOLD = ("on_finished", "on_finished_queue", "webhook_url")


def _told(told: dict[str, str | None]) -> dict[str, str | None]:
    """Who is told when the batch ends (:func:`submit_batch`'s keywords of that name)."""
    unknown = sorted(set(told) - set(TOLD))
    if unknown:
        raise TypeError(f"unexpected keyword arguments: {', '.join(unknown)}")
    return told


def create_batch(
    *,
    tenant: str | Tenant,
    input_file_id: str,
    endpoint: str | None = None,
    completion_window: str | float = "24h",
    metadata: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    priority: Priority | str | None = None,
    offload: OffloadMode | str = OffloadMode.AUTO,
    route: RouteMode | str = RouteMode.AUTO,
    key_id: int | None = None,
    **told: str | None,
) -> tuple[dict[str, Any], bool]:
    """A batch of the requests of an uploaded file (``client.batches.create``); returns
    its description and ``created`` (False: the idempotency key replayed a batch).
    ``endpoint`` (``/v1/chat/completions``, ``/v1/responses`` or ``/v1/embeddings``) is
    the one every line's ``url`` must name (None: the one they name).
    Without ``priority``, a window of 24 h or more makes it bulk (Batch API eligible)."""
    if endpoint is not None and endpoint not in BATCH_ENDPOINTS:
        raise ValidationFailed(unknown_endpoint(endpoint), field="endpoint")
    chosen = sdk_priority(priority, parse_duration_s(completion_window))
    options = SubmitOptions(
        completion_window=completion_window,
        metadata=metadata,
        idempotency_key=idempotency_key,
        priority=chosen,
        input_file_id=input_file_id,
        endpoint=endpoint,
        offload=parse_offload(offload),
        route=parse_route(route),
        on_finished=_told(told).get("on_finished"),
        on_finished_queue=told.get("on_finished_queue"),
        webhook_url=told.get("webhook_url"),
        key_id=key_id,
    )
    # The upload goes through admission line by line from a temporary file (on disk past
    # a few MB), filled piece by piece: never whole in memory.
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY_BYTES) as spool:
        with session_scope() as session:
            for piece in files.upload_pieces(session, _tenant(session, tenant), input_file_id):
                spool.write(piece)
        spool.seek(0)
        return submit(tenant, spool, options)


# --- Anthropic's Message Batches --------------------------------------------------

ResultsUrl = Callable[[str], str]


def _message_batch(session: Session, batch: Any, results_url: ResultsUrl | None) -> dict[str, Any]:
    url = results_url(batch.id) if results_url is not None else None
    return batches.describe_message_batch(session, batch, url)


def _served_by_anthropic(request: Any) -> bool:
    """Whether the request's model is served by Anthropic providers only (an unknown
    model too: its line is refused for that, by admission)."""
    params = request.get("params") if isinstance(request, dict) else None
    model = params.get("model") if isinstance(params, dict) else None
    spec = get_registry().get(model) if isinstance(model, str) else None
    return spec is None or all(d.provider is ProviderKind.ANTHROPIC for d in spec.deployments)


def message_line(index: int, request: Any) -> dict[str, Any]:
    """A Messages request (``{custom_id, params}``) as a line of the item format,
    refused by name where its model's provider could not be sent all of it."""
    return message_batches.to_chat_line(index, request, anthropic=_served_by_anthropic(request))


def create_message_batch(
    requests: list[Any],
    *,
    tenant: str | Tenant,
    idempotency_key: str | None = None,
    priority: Priority | str | None = None,
    completion_window: str | float | None = None,
    metadata: dict[str, Any] | None = None,
    offload: OffloadMode | str = OffloadMode.AUTO,
    route: RouteMode | str = RouteMode.AUTO,
    key_id: int | None = None,
    **told: str | None,
) -> tuple[dict[str, Any], bool]:
    """A batch of Message Batch requests (``client.messages.batches.create``), stored
    all or nothing like any other; returns Anthropic's ``MessageBatch`` and ``created``.
    ``completion_window`` and ``metadata`` are ours (the SDK has neither); without
    ``priority``, a window of 24 h or more (the default) makes it bulk."""
    if not isinstance(requests, list) or not requests:
        raise ValidationFailed("requests must be a non-empty list", field="requests")
    lines = [message_line(i, r) for i, r in enumerate(requests)]
    window_s = (
        parse_duration_s(completion_window)
        if completion_window is not None
        else get_settings().submit.default_completion_window_s
    )
    chosen = sdk_priority(priority, window_s)
    options = SubmitOptions(
        completion_window=completion_window,
        metadata=metadata,
        idempotency_key=idempotency_key,
        priority=chosen,
        endpoint=message_batches.MESSAGES,
        offload=parse_offload(offload),
        route=parse_route(route),
        on_finished=_told(told).get("on_finished"),
        on_finished_queue=told.get("on_finished_queue"),
        webhook_url=told.get("webhook_url"),
        key_id=key_id,
    )
    described, created = submit(tenant, as_lines(lines), options)
    with session_scope() as session:
        batch = batches.get_readable_batch(session, _tenant(session, tenant), described["id"])
        return _message_batch(session, batch, None), created


def get_message_batch(
    batch_id: str, *, tenant: str | Tenant, results_url: ResultsUrl | None = None
) -> dict[str, Any]:
    """One batch as Anthropic's ``MessageBatch`` (``results_url`` once it has ended, if
    the caller says where results are served)."""
    with session_scope() as session:
        batch = batches.get_readable_batch(session, _tenant(session, tenant), batch_id)
        return _message_batch(session, batch, results_url)


def list_message_batches_page(
    *,
    tenant: str | Tenant,
    limit: int = 20,
    after_id: str | None = None,
    before_id: str | None = None,
    results_url: ResultsUrl | None = None,
) -> dict[str, Any]:
    """One page of the tenant's Message Batches, newest first, as the Anthropic SDK
    pages them (``data``, ``has_more``, ``first_id``, ``last_id``)."""
    with session_scope() as session:
        owner = _tenant(session, tenant)
        page, has_more = batches.list_page(
            session,
            owner,
            limit=limit,
            after=after_id,
            before=before_id,
            endpoint=message_batches.MESSAGES,
            max_limit=1000,
        )
        data = [_message_batch(session, b, results_url) for b in page]
    return cursor_page(data, has_more)


def cancel_message_batch(batch_id: str, *, tenant: str | Tenant) -> dict[str, Any]:
    """Cancel one of the tenant's batches; Anthropic's ``MessageBatch`` after it."""
    cancel_batch(batch_id, tenant=tenant)
    return get_message_batch(batch_id, tenant=tenant)


def iter_message_batch_results(batch_id: str, *, tenant: str | Tenant) -> Iterator[dict[str, Any]]:
    """Finished requests as Anthropic's ``MessageBatchIndividualResponse``, in input order."""
    for row in iter_results(batch_id, tenant=tenant):
        yield message_batches.to_individual_response(row)


# --- synchronous calls (POST /v1/chat/completions, /v1/messages) --------------------
# Run in this process (batchgen.worker.call_runner) and waited for, whole or as a stream
# (batchgen.worker.call_answers): start_call, wait_call, stream_call.


def usage(
    *,
    tenant: str | Tenant | None,
    start: str | None = None,
    end: str | None = None,
    group_by: str = "model",
) -> list[dict[str, Any]]:
    """Requests, tokens, cost and waste per model, day (or tenant, for ``tenant=None``:
    the admin view over all tenants) between ``start`` and ``end`` (ISO dates)."""
    import datetime as dt

    from batchgen.store import usage as usage_report

    first, last = usage_report.parse_range(start, end, dt.datetime.now(dt.UTC).date())
    with session_scope() as session:
        tenant_id = None if tenant is None else _tenant(session, tenant).id
        return usage_report.report(session, first, last, group_by, tenant_id)


# --- the registry's models (``GET /v1/models``), as either SDK reads them -----------


def _registry_created() -> int:
    """When the registry was last written (Unix seconds): the models' ``created``."""
    try:
        return int(Path(get_settings().paths.models_file).stat().st_mtime)
    except OSError:
        return 0


def _openai_model(spec: ModelSpec, created: int) -> dict[str, Any]:
    """OpenAI's ``Model`` (``owned_by``: the provider kind)."""
    return {"id": spec.name, "object": "model", "created": created, "owned_by": spec.provider.value}


def _anthropic_model(spec: ModelSpec, created: int) -> dict[str, Any]:
    """Anthropic's ``ModelInfo``, with the registry's context window and output cap."""
    import datetime as dt

    return {
        "type": "model",
        "id": spec.name,
        "display_name": spec.name,
        "created_at": dt.datetime.fromtimestamp(created, dt.UTC).isoformat().replace("+00:00", "Z"),
        "lifecycle": "active",
        "max_input_tokens": spec.context_window,
        "max_tokens": spec.output_cap,
    }


def list_models() -> list[dict[str, Any]]:
    """Every model of the registry as OpenAI's ``Model`` objects, in registry order."""
    created = _registry_created()
    return [_openai_model(spec, created) for spec in get_registry()]


def get_model(name: str, *, anthropic: bool = False) -> dict[str, Any]:
    """One model of the registry (OpenAI's shape, or Anthropic's); :class:`NotFound` for
    a name it does not have."""
    registry = get_registry()
    spec = registry.get(name)
    if spec is None:
        raise NotFound(registry.unknown(name), field="model")
    shape = _anthropic_model if anthropic else _openai_model
    return shape(spec, _registry_created())


def list_models_page(
    *, limit: int = 20, after_id: str | None = None, before_id: str | None = None
) -> dict[str, Any]:
    """One page of the registry's models in Anthropic's list shape (``data``,
    ``has_more``, ``first_id``, ``last_id``), paged by model id as its SDK pages."""
    if not 1 <= limit <= 1000:
        raise ValidationFailed("limit must be between 1 and 1000", field="limit")
    specs = list(get_registry())
    names = [spec.name for spec in specs]
    for cursor, field in ((after_id, "after_id"), (before_id, "before_id")):
        if cursor is not None and cursor not in names:
            raise ValidationFailed(
                f"{field} {cursor!r} is not a model of the registry", field=field
            )
    if before_id is not None:
        end = names.index(before_id)
        start = max(0, end - limit)
        has_more = start > 0
    else:
        start = names.index(after_id) + 1 if after_id is not None else 0
        end = min(len(specs), start + limit)
        has_more = end < len(specs)
    created = _registry_created()
    data = [_anthropic_model(spec, created) for spec in specs[start:end]]
    return cursor_page(data, has_more)


# --- the deployment's state, for the status view and the metrics ---------------------

# A database error of an unmigrated schema (the 503 that names `batchgen db upgrade`).
UNMIGRATED_SQLSTATES = db.UNMIGRATED_SQLSTATES


def session_factory() -> Callable[[], AbstractContextManager[Session]]:
    """What opens a transaction of its own, for a reader that opens one per scrape
    (:class:`batchgen.monitoring.metrics.StateCollector`)."""
    return session_scope


def authenticate(secret: str | None) -> Caller:
    """The API key ``secret`` is and its tenant (detached), or :class:`Unauthorized`;
    one statement, autocommit (:func:`batchgen.store.api_keys.authenticate`)."""
    with db.autocommit() as connection:  # one statement: no transaction around it
        return api_keys.authenticate(connection, secret)


# What an operator may change on a tenant beside its weight, webhook and admin flag.
TENANT_LIMITS = tenants.LIMITS


def status_snapshot() -> dict[str, Any]:
    """Per-model backlog, throughput and budget use, per-tenant progress
    (:func:`batchgen.monitoring.snapshot.snapshot`), read in a transaction of its own."""
    from batchgen.monitoring.snapshot import snapshot

    with session_scope() as session:
        return snapshot(session, get_redis(), get_registry(), get_settings())


def schema_behind() -> str | None:
    """Why the database is not at the newest migration (None: it is)."""
    return db.schema_behind()


def dashboard_batches(
    tenant: Tenant | None, limit: int, usage: list[dict[str, Any]]
) -> dict[str, Any]:
    """The dashboard's list of batches and its charts (``tenant`` None: a host's operator,
    every tenant's, read only), in one transaction."""
    from batchgen.monitoring import pages

    with session_scope() as session:
        return {
            "batches": pages.batch_rows(session, tenant, limit),
            "charts": pages.charts(session, get_registry(), tenant, usage),
        }


def dashboard_batch(tenant: Tenant, batch_id: str) -> dict[str, Any]:
    """One batch as its dashboard page shows it; :class:`NotFound` unless the tenant may
    read it."""
    from batchgen.monitoring import pages

    with session_scope() as session:
        return pages.batch_page(session, tenant, batch_id)
