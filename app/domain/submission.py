"""A submission's decisions, pure: its options checked, each item's route and prompt
prefix key, the bounds of a request file, and the admission verdicts (backlog,
tenant and file quotas) on counts the store read.

The store (:mod:`batchgen.store.batches`, :mod:`batchgen.store.quotas`) reads and
writes; what it stores, and whether a submit is refused, is decided here. Nothing
here touches a database: the counts a verdict needs are its arguments.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from batchgen.config import Settings
from batchgen.domain.formats.admission import (
    UNSTORABLE,
    ItemDraft,
    Limits,
    RequestFingerprint,
    fitting,
    parse_lines,
    unstorable_path,
)
from batchgen.domain.formats.endpoints import (
    BATCH_ENDPOINTS,
    CHAT_COMPLETIONS,
    MESSAGES,
    line_endpoint,
    unknown_endpoint,
)
from batchgen.domain.formats.prompt_cache import PrefixKeys
from batchgen.domain.lifecycle.deadlines import parse_duration_s
from batchgen.domain.lifecycle.status import ItemStatus, Priority
from batchgen.domain.notifications import (
    DEFAULT_CALLBACK_QUEUE,
    check_callback,
    check_task_name,
    check_webhook_url,
)
from batchgen.domain.scheduling.offload import OfflineWindow, OffloadMode, parse_offload
from batchgen.domain.scheduling.routes import (
    FlexWindow,
    ItemRoute,
    RouteMode,
    Routes,
    asks_flex,
    choose_route,
    offload_of,
    parse_route,
)
from batchgen.errors import (
    FileQuotaExceeded,
    IdempotencyKeyReused,
    Overloaded,
    OverQuota,
    PayloadTooLarge,
    ValidationFailed,
)
from batchgen.registry import FLEX_KINDS, ModelSpec, Registry

MAX_IDEMPOTENCY_KEY_CHARS = 200
MIN_RETRY_AFTER_S = 1.0


@dataclass(frozen=True, kw_only=True)
class SubmitOptions:
    # None: the settings' default_completion_window_s.
    completion_window: str | float | None = None
    metadata: dict[str, Any] | None = None
    idempotency_key: str | None = None
    priority: Priority = Priority.INTERACTIVE
    # The upload the lines come from (POST /v1/batches with input_file_id).
    input_file_id: str | None = None
    # The API the batch was submitted to: an endpoint of OpenAI's Batch API (every line's
    # url; None: the one the lines name), or Anthropic's Message Batches (MESSAGES: the
    # lines translated from its requests, chat lines).
    endpoint: str | None = None
    # May its bulk items go to the provider's own Batch API (batchgen.domain.scheduling.offload)?
    offload: OffloadMode | str = OffloadMode.AUTO
    # Which routes its items may take: standard calls, flex calls, the provider's Batch
    # API (batchgen.domain.scheduling.routes; auto: by deadline and priority).
    route: RouteMode | str = RouteMode.AUTO
    # Told when it ends (batchgen.domain.notifications): a Celery task of the host's by
    # name (sent to on_finished_queue, default Celery's "celery"), and a webhook.
    on_finished: str | None = None
    on_finished_queue: str | None = None
    webhook_url: str | None = None
    # The host app (Flask, Django: its BATCHGEN_APP_ID) it came through; None: the
    # standalone API. Only that app's signal command fires its batch_finished.
    origin: str | None = None
    # The API key it is submitted with (usage by key); None: not through a key.
    key_id: int | None = None


def submission_limits(settings: Settings) -> Limits:
    """The bounds of one request file, upload or submit alike."""
    return Limits(
        max_lines=settings.submit.max_batch_lines,
        max_bytes=settings.submit.max_body_bytes,
        max_tokenize_bytes=settings.submit.max_tokenize_bytes,
    )


def count_lines(lines: Iterable[bytes], registry: Registry, settings: Settings) -> int:
    """The request lines of an upload, each checked as a submit checks it."""
    return sum(1 for _ in parse_lines(lines, registry, submission_limits(settings)))


# --- routes and prompt prefix keys ---------------------------------------------------


def routes_of(spec: ModelSpec) -> Routes:
    """The model's routes beside standard calls, as the route rule sees them."""
    offline = spec.offline_route
    return Routes(
        batch=None if offline is None else OfflineWindow(offline.turnaround_s, offline.fallback_s),
        flex=None if spec.flex is None else FlexWindow.of(spec.flex),
        flex_on_request=spec.provider.value in FLEX_KINDS,
    )


def cache_min_tokens(registry: Registry) -> Callable[[str], int | None]:
    """A model's shortest cached prefix (None: the model keeps no prefix keys)."""

    def of(model: str) -> int | None:
        spec = registry[model]
        return spec.prompt_cache_min_tokens if spec.prompt_cache else None

    return of


def prefix_keys(registry: Registry) -> PrefixKeys:
    """The prompt prefix keys of one submission's items (by each model's cache rule)."""
    return PrefixKeys(cache_min_tokens(registry), lambda m: registry[m].encoding)


def check_route(
    line_no: int, mode: RouteMode, offload: OffloadMode, spec: ModelSpec, routes: Routes
) -> None:
    """A batch that names a route its model does not have is refused, naming the line."""
    if offload is OffloadMode.ALWAYS and routes.batch is None:
        named = "route 'batch'" if mode is RouteMode.BATCH else "offload 'always'"
        raise ValidationFailed(
            f"line {line_no}: {named} but model {spec.name!r} has no offline "
            "route (offload = true in the registry)",
            field="route" if mode is RouteMode.BATCH else "offload",
        )
    if mode is RouteMode.FLEX and routes.flex is None:
        raise ValidationFailed(
            f"line {line_no}: route 'flex' but model {spec.name!r} has no flex route "
            f'([models."{spec.name}".flex] in the registry)',
            field="route",
        )


# --- a submit's options and lines ----------------------------------------------------


def check_options(options: SubmitOptions, default_window_s: int) -> float:
    """Validate the submit's parameters; returns the completion window in seconds."""
    key = options.idempotency_key
    if key is not None:
        if len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
            raise ValidationFailed(
                f"Idempotency-Key longer than {MAX_IDEMPOTENCY_KEY_CHARS} characters",
                field="Idempotency-Key",
            )
        if not key.isprintable():
            raise ValidationFailed(
                "Idempotency-Key must be printable characters", field="Idempotency-Key"
            )
    if options.endpoint is not None and options.endpoint not in (*BATCH_ENDPOINTS, MESSAGES):
        raise ValidationFailed(unknown_endpoint(options.endpoint), field="endpoint")
    window_s = (
        float(default_window_s)
        if options.completion_window is None
        else parse_duration_s(options.completion_window)
    )
    if options.metadata is not None:
        if not isinstance(options.metadata, dict):
            raise ValidationFailed("metadata must be an object", field="metadata")
        bad = unstorable_path(options.metadata)
        if bad is not None:
            raise ValidationFailed(f"metadata: {bad or 'a key'} {UNSTORABLE}", field="metadata")
    return window_s


@dataclass
class Prepared:
    """A submit's parameters checked and its lines under way (parsed as they are read)."""

    window_s: float
    endpoint: str | None
    priority: Priority
    route: RouteMode
    offload: OffloadMode
    on_finished: str | None
    queue: str | None
    webhook_url: str | None
    key: str | None
    fingerprint: RequestFingerprint
    drafts: Iterator[ItemDraft]
    first: ItemDraft


def prepare(
    tokens_per_min: int | None,
    lines: Iterable[bytes],
    options: SubmitOptions,
    registry: Registry,
    settings: Settings,
) -> Prepared:
    """What a submit checks before anything is stored; ``tokens_per_min`` is the
    tenant's own bound (None: none)."""
    window_s = check_options(options, settings.submit.default_completion_window_s)
    endpoint = options.endpoint
    priority = Priority(options.priority)
    route = parse_route(options.route)
    offload = offload_of(route, parse_offload(options.offload))
    on_finished = check_task_name(options.on_finished)
    queue = check_task_name(options.on_finished_queue, "on_finished_queue")
    check_callback(
        on_finished,
        queue,
        settings.webhooks.callback_tasks,
        settings.webhooks.callback_queues,
        DEFAULT_CALLBACK_QUEUE,
    )
    webhook_url = check_webhook_url(options.webhook_url)
    told = {"on_finished": on_finished, "on_finished_queue": queue, "webhook_url": webhook_url}
    key = options.idempotency_key or None
    fingerprint = RequestFingerprint(
        {
            "endpoint": endpoint or CHAT_COMPLETIONS,
            "completion_window_s": window_s,
            "metadata": options.metadata,
            "priority": priority.value,
            **({"offload": offload.value} if offload is not OffloadMode.AUTO else {}),
            **({"route": route.value} if route is not RouteMode.AUTO else {}),
            **{k: v for k, v in told.items() if v is not None},
            **({"input_file_id": options.input_file_id} if options.input_file_id else {}),
        }
    )
    limits = submission_limits(settings)
    expected = line_endpoint(endpoint) if endpoint is not None else None
    parsed = parse_lines(lines, registry, limits, expected)
    drafts = fingerprint.track(fitting(parsed, registry, tokens_per_min))
    first = next(drafts)  # the lines name the batch's endpoint when the caller did not
    drafts = itertools.chain([first], drafts)
    return Prepared(
        window_s,
        endpoint,
        priority,
        route,
        offload,
        on_finished,
        queue,
        webhook_url,
        key,
        fingerprint,
        drafts,
        first,
    )


def check_replay(
    stored_sha256: str | None,
    key: str | None,
    batch_id: str,
    drafts: Iterable[ItemDraft],
    fingerprint: RequestFingerprint,
) -> None:
    """May the batch an Idempotency-Key named answer this request? Only once the
    request proves to be the same one.

    The request is validated in full first (a bad request is a 400 whether or
    not its key was used). Batches stored before fingerprints existed replay
    as before.
    """
    for _ in drafts:
        pass
    if stored_sha256 not in (None, fingerprint.hexdigest()):
        raise IdempotencyKeyReused(
            f"Idempotency-Key {key!r} was used for a different request "
            f"(batch {batch_id}); send a new key with a new request",
            field="Idempotency-Key",
        )


def call_needs_full_store(
    options: SubmitOptions, max_pending_items: int | None, daily_token_quota: int | None
) -> bool:
    """Whether a call must be stored as a batch is (a replay to find under its
    Idempotency-Key, or a tenant with quotas to check), not in one statement."""
    if options.idempotency_key or options.priority != Priority.CALL:
        return True
    return max_pending_items is not None or daily_token_quota is not None


# --- each item's route and row ---------------------------------------------------------


@dataclass(frozen=True)
class BatchFrame:
    """What an item's row takes of its batch."""

    id: str
    route: str
    offload: str
    priority: str
    created_at: dt.datetime
    deadline_at: dt.datetime


@dataclass
class Tally:
    """A submission's items added up as their rows are made: each model's estimated
    tokens of online work (offloaded items are not the online backlog), and each
    model's items and tokens in all (``admitted``: ``[items, tokens]``)."""

    online_tokens: dict[str, int] = field(default_factory=dict)
    admitted: dict[str, list[int]] = field(default_factory=dict)


def item_rows(
    drafts: Iterable[ItemDraft],
    batch: BatchFrame,
    tenant_id: int,
    tally: Tally,
    registry: Registry,
    keys: dict[str, int],
    prefixes: PrefixKeys,
) -> Iterator[dict[str, Any]]:
    """Rows to insert, each ``pending`` or ``offloaded`` with its route (by
    :func:`batchgen.domain.scheduling.routes.choose_route`) and its prompt prefix's key
    (``prefixes``), added up in ``tally`` on the way. Each model's items are keyed in
    input order from ``keys[model]`` (default 1), which the rows move on."""
    mode, priority = RouteMode(batch.route), Priority(batch.priority)
    offload = OffloadMode(batch.offload)
    for d in drafts:
        deadline = batch.deadline_at
        if d.timeout_s is not None:
            deadline = min(deadline, batch.created_at + dt.timedelta(seconds=d.timeout_s))
        spec = registry[d.model]
        routes = routes_of(spec)
        check_route(d.line_no, mode, offload, spec, routes)
        route = choose_route(
            mode=mode,
            offload=offload,
            priority=priority,
            routes=routes,
            deadline_left_s=(deadline - batch.created_at).total_seconds(),
            asked_flex=asks_flex(d.body),
        )
        offline = route is ItemRoute.BATCH
        tokens = d.prompt_tokens_est + d.max_tokens
        tally.online_tokens.setdefault(d.model, 0)
        if not offline:
            tally.online_tokens[d.model] += tokens
        counted = tally.admitted.setdefault(d.model, [0, 0])
        counted[0] += 1
        counted[1] += tokens
        key = keys.get(d.model, 1)
        keys[d.model] = key + 1
        yield {
            "batch_id": batch.id,
            "tenant_id": tenant_id,
            "line_no": d.line_no,
            "custom_id": d.custom_id,
            "model": d.model,
            "priority_rank": priority.rank,
            "body": d.body_json if d.body_json is not None else json.dumps(d.body),
            "prompt_tokens_est": d.prompt_tokens_est,
            "max_tokens": d.max_tokens,
            "status": (ItemStatus.OFFLOADED if offline else ItemStatus.PENDING).value,
            "deadline_at": deadline,
            "dispatch_key": key,
            "route": route.value,
            "prefix_key": prefixes.key(d.model, d.body, d.endpoint),
        }


# --- admission verdicts on counts the store read ---------------------------------------


def backlog_bound_tokens(spec: ModelSpec, settings: Settings) -> int:
    return spec.max_backlog_tokens or int(spec.tokens_per_min * settings.submit.max_backlog_min)


def drain_time_s(excess_tokens: int, tokens_per_min: int) -> float:
    """How long a model needs to work off ``excess_tokens`` at its rate."""
    return max(MIN_RETRY_AFTER_S, excess_tokens / (tokens_per_min / 60.0))


def seconds_until_utc_midnight(now: dt.datetime) -> float:
    tomorrow = (now.astimezone(dt.UTC) + dt.timedelta(days=1)).date()
    midnight = dt.datetime.combine(tomorrow, dt.time(), tzinfo=dt.UTC)
    return max(MIN_RETRY_AFTER_S, (midnight - now).total_seconds())


def backlog_models(online_tokens: dict[str, int], priority: Priority) -> list[str]:
    """The models whose backlog bound a submit is checked against, in a fixed order (no
    deadlock between submits): none for a call (its bound is the fail-fast rule), and
    no model whose items were all offloaded (not the online backlog)."""
    if priority is Priority.CALL:
        return []
    return [m for m in sorted(online_tokens) if online_tokens[m]]


def check_batch_size(model: str, new_tokens: int, bound: int) -> None:
    """413 for a batch that alone is over the model's backlog bound."""
    if new_tokens > bound:
        raise PayloadTooLarge(
            f"the batch's {new_tokens} tokens for {model} exceed the model's "
            f"backlog bound of {bound} tokens; split it"
        )


def check_backlog(
    model: str, new_tokens: int, backlog_tokens: int, bound: int, tokens_per_min: int
) -> None:
    """503 when the model's online backlog (``backlog_tokens``, this batch's
    ``new_tokens`` included) is over its bound."""
    if backlog_tokens > bound:
        raise Overloaded(
            f"model {model} is overloaded: {backlog_tokens - new_tokens} tokens "
            f"are waiting (bound {bound}); retry later",
            retry_after_s=drain_time_s(backlog_tokens - bound, tokens_per_min),
        )


def tenant_has_quotas(max_pending_items: int | None, daily_token_quota: int | None) -> bool:
    return max_pending_items is not None or daily_token_quota is not None


def check_pending_items(
    tenant_name: str,
    open_items: int,
    max_pending_items: int | None,
    registry: Registry,
    models: Iterable[str],
) -> None:
    """429 when the tenant's open items (this batch included) are over its bound; back
    when the fastest of the batch's ``models`` has worked off the excess."""
    if max_pending_items is None or open_items <= max_pending_items:
        return
    requests_per_min = max(registry[m].requests_per_min for m in models)
    excess = open_items - max_pending_items
    raise OverQuota(
        f"tenant {tenant_name} would have {open_items} open items; its limit is "
        f"{max_pending_items}",
        retry_after_s=max(MIN_RETRY_AFTER_S, math.ceil(excess * 60 / requests_per_min)),
    )


def check_daily_tokens(
    tenant_name: str, committed: int, daily_token_quota: int | None, now: dt.datetime
) -> None:
    """429 when the tenant's tokens of the UTC day (used and still open, this batch
    included) are over its daily quota; back at midnight."""
    if daily_token_quota is None or committed <= daily_token_quota:
        return
    raise OverQuota(
        f"tenant {tenant_name} would use {committed} tokens today; its daily quota is "
        f"{daily_token_quota}",
        retry_after_s=seconds_until_utc_midnight(now),
    )


def file_quota(
    max_files: int | None, max_file_bytes: int | None, settings: Settings
) -> tuple[int, int]:
    """The tenant's bounds on its uploads (its own, else the settings'): (files, bytes)."""
    return (
        max_files or settings.files.tenant_max_files,
        max_file_bytes or settings.files.tenant_max_file_bytes,
    )


def check_file_quota(
    tenant_name: str,
    new_bytes: int,
    kept: tuple[int, int],
    quota: tuple[int, int],
    first_expiry_s: float | None,
) -> None:
    """May a file of ``new_bytes`` join the ``kept`` (files, bytes) under ``quota``? A
    file that alone is over the bytes can never fit: 413. Otherwise over the quota:
    429, back when the first kept file expires (``first_expiry_s`` from now)."""
    (files, used), (max_files, max_bytes) = kept, quota
    if new_bytes > max_bytes:
        raise PayloadTooLarge(
            f"a file of {new_bytes} bytes is over tenant {tenant_name}'s file quota of "
            f"{max_bytes} bytes",
            field="file",
        )
    retry_after_s = max(MIN_RETRY_AFTER_S, first_expiry_s or MIN_RETRY_AFTER_S)
    if files + 1 > max_files:
        raise FileQuotaExceeded(
            f"tenant {tenant_name} keeps {files} files; its quota is {max_files} files: "
            "delete one (DELETE /v1/files/{file_id}) or wait until one expires",
            retry_after_s=retry_after_s,
        )
    if used + new_bytes > max_bytes:
        raise FileQuotaExceeded(
            f"tenant {tenant_name} keeps {used} bytes of files; {new_bytes} more is over its "
            f"quota of {max_bytes} bytes: delete a file or wait until one expires",
            retry_after_s=retry_after_s,
        )
