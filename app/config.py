"""The one settings object, read by batchgen.celeryconfig, the API, the CLI and the tasks.

Service URLs use their conventional names (``DATABASE_URL``, ``REDIS_URL``,
``CELERY_BROKER_URL``); everything else is ``BATCHGEN_*``. When
``DATABASE_URL`` / ``REDIS_URL`` are unset, :mod:`batchgen.embedded` starts real
PostgreSQL and Redis servers from PyPI packages and fills them in.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODELS_FILE = Path(__file__).with_name("models.toml")
# Settings whose whole value is a secret, and settings that are URLs with a password.
SECRET_SUFFIXES = ("_password", "_token", "_secret", "_api_key")
REDACTED = "***"
_SECRET_PARAMS = ("password", "secret", "token", "key")


def redact_url(url: str) -> str:
    """``url`` with its password (user info or query) masked: ``postgresql://u:***@h/db``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED
    netloc, query = parts.netloc, parts.query
    if parts.password is not None:
        netloc = f"{parts.username or ''}:{REDACTED}@{netloc.rpartition('@')[2]}"
    if query:  # e.g. redis://h/0?password=…
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, REDACTED if k.lower().endswith(_SECRET_PARAMS) else v) for k, v in pairs],
            safe="*",
        )
    return urlunsplit(parts._replace(netloc=netloc, query=query))


# psycopg's default: a statement run this many times on a connection is prepared there.
PREPARE_AFTER_RUNS = 5


class Settings(BaseSettings):
    """Typed settings from the environment (prefix ``BATCHGEN_``)."""

    model_config = SettingsConfigDict(env_prefix="BATCHGEN_", extra="ignore")

    database_url: str | None = Field(
        default=None, validation_alias=AliasChoices("BATCHGEN_DATABASE_URL", "DATABASE_URL")
    )
    redis_url: str | None = Field(
        default=None, validation_alias=AliasChoices("BATCHGEN_REDIS_URL", "REDIS_URL")
    )
    celery_broker_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("BATCHGEN_CELERY_BROKER_URL", "CELERY_BROKER_URL"),
    )

    # PostgreSQL connections (docs/operations.md, "Connections"). DATABASE_URL may be a
    # transaction pooler (PgBouncer, pool_mode = transaction); what needs one server
    # session for longer than a transaction goes to database_direct_url instead: the
    # LISTEN of synchronous calls, the offload tick's session advisory lock, and
    # migrations. Unset: DATABASE_URL.
    database_direct_url: str | None = Field(
        default=None, validation_alias=AliasChoices("BATCHGEN_DATABASE_DIRECT_URL")
    )
    # A file holding the database password (a Compose or Kubernetes secret, e.g.
    # /run/secrets/postgres_password): its first line is the password of DATABASE_URL
    # and BATCHGEN_DATABASE_DIRECT_URL, which then carry none.
    database_password_file: Path | None = None
    # Each process keeps one pool to DATABASE_URL: at most db_pool_size connections
    # kept open plus db_max_overflow more opened under load (closed when returned).
    # A thread holds one only for a statement or a transaction, never during a
    # provider call, so a pool smaller than the thread count serves them all; a
    # thread that finds every connection busy waits up to db_pool_timeout_s (then
    # the attempt counts as a database outage and is retried). Unset db_pool_size:
    # worker_concurrency / 4, rounded up, at least 2 (see db_pool_bound).
    db_pool_size: int | None = Field(default=None, ge=1)
    db_max_overflow: int = Field(default=0, ge=0)
    db_pool_timeout_s: float = Field(default=30.0, gt=0)
    # psycopg's server-side prepared statements (a statement run PREPARE_AFTER_RUNS
    # times is prepared on its connection: the hot path's statements are then parsed
    # and planned once). None, the default: on when DATABASE_URL is PostgreSQL itself,
    # off when BATCHGEN_DATABASE_DIRECT_URL is set, since DATABASE_URL is then a
    # transaction pooler (PgBouncer before 1.21 has no max_prepared_statements;
    # Debian 12 ships 1.18). True or False decides it either way.
    db_prepared_statements: bool | None = None

    data_dir: Path = Path(".batchgen")
    models_file: Path = DEFAULT_MODELS_FILE
    log_json: bool = False
    log_level: str = "INFO"

    # Submission bounds.
    max_batch_lines: int = 50_000
    # A request body (JSONL, an upload, a Message Batch) is read under this bound,
    # counted while it streams (app/bodies.py): past it, a 413 at once.
    max_body_bytes: int = 200 * 1024 * 1024
    # The bound of a synchronous call's body (POST /v1/chat/completions, /v1/messages),
    # parsed whole as JSON: a prompt that fits a context window is far smaller.
    max_call_body_bytes: int = 32 * 1024 * 1024
    # How long an uploaded file (POST /v1/files) is kept unless its upload asks for
    # less (expires_after); the sweep deletes it then. Output files of a batch are its
    # results, read on demand: they go with the batch.
    file_retention_s: int = 30 * 86400
    # What one tenant may keep uploaded at once (files not yet deleted or expired):
    # how many, and their bytes in all; over it, a 429 until a file goes. A tenant's
    # own max_files / max_file_bytes (batchgen tenants create) overrides these.
    tenant_max_files: int = Field(default=1000, ge=1)
    tenant_max_file_bytes: int = Field(default=2 * 1024 * 1024 * 1024, ge=1)
    default_completion_window_s: int = 24 * 3600
    # Backlog bound per model, in minutes of its tokens_per_min (see app/store/quotas.py).
    max_backlog_min: float = 60.0
    # Text a submit may hand the tokenizer in all (bytes of prompt text, all lines);
    # more → 413. Bounds the CPU one request can cost (see app/domain/admission.py).
    max_tokenize_bytes: int = 64 * 1024 * 1024
    # Retry-After of a 503 when PostgreSQL or Redis is unreachable.
    unavailable_retry_after_s: float = 5.0
    # How long a Redis command (and a connect) may take before the caller gets a 503:
    # a Redis that is down or silent never holds a request longer than this per call.
    redis_socket_timeout_s: float = Field(default=5.0, gt=0)

    # Synchronous calls (POST /v1/chat/completions, /v1/messages): how long a caller
    # waits, queueing included, when it names no timeout (X-Request-Timeout, the body's
    # timeout, or the SDKs' own x-stainless-read-timeout), and at most.
    call_default_timeout_s: float = 600.0
    call_max_timeout_s: float = 600.0
    # A waiting call reads its item this often besides being woken at its end (NOTIFY),
    # and checks that its caller is still connected.
    call_poll_s: float = 0.5

    # Test mode for a host project's tests (a Django TestCase): a submit validates and
    # describes the batch as usual, then keeps nothing: nothing runs, nothing is billed.
    dry_run: bool = False

    # Dispatch and leases.
    dispatch_interval_s: float = 1.0
    sweep_interval_s: float = 5.0
    # How often a process using the gate checks its state marker in Redis (a Redis that
    # lost the gate's state is rebuilt from the database: app/worker/gate_state.py);
    # the sweep checks it on every tick too.
    gate_state_check_s: float = 1.0
    # Offload to the providers' Batch APIs (app/worker/offload.py): the tick's
    # interval, a job's first poll after its creation and the most between polls
    # (doubling), and how many waiting items one tick plans per model.
    offload_interval_s: float = 5.0
    offload_poll_first_s: float = 30.0
    offload_poll_max_s: float = 300.0
    offload_plan_limit: int = 100_000
    # Batch-finished notifications (app/worker/notify.py): the delivery tick, a
    # webhook's time-out, and how long notifications are kept.
    notify_interval_s: float = 2.0
    # One deadline for a whole webhook delivery: resolve, connect, send, read the answer.
    webhook_timeout_s: float = Field(default=10.0, gt=0)
    # CIDRs webhooks may reach although private, loopback or link-local (an in-house
    # receiver); JSON list, e.g. ["10.20.0.0/16"]. Empty: public addresses only.
    webhook_allow_nets: list[str] = Field(default_factory=list)
    # on_finished callbacks (a host's Celery task): the broker they are sent to (None:
    # batchgen's own), and the task names and queues a submit may name (JSON lists;
    # no task names: on_finished is refused).
    callback_broker_url: str | None = None
    callback_tasks: list[str] = Field(default_factory=list)
    callback_queues: list[str] = Field(default_factory=lambda: ["celery"])
    # The first retry of a failed delivery (doubling, at most an hour, for a day).
    notify_retry_first_s: float = 10.0
    notification_retention_s: float = 7 * 86400.0
    # Retention (app/worker/retention.py): finished batches older than this many days
    # are removed with their items, results and ledger rows; the daily usage totals
    # stay. None (the default): everything is kept.
    retention_days: float | None = Field(default=None, gt=0)
    # A tick every retention_interval_s removes expired batches, retention_chunk_batches
    # at a time, until none is left or it has run retention_budget_s: a chunk started is
    # finished, so a budget of 0 removes one chunk. Half of every interval is enough to
    # keep up with a history growing far faster than anything else writes it.
    retention_interval_s: float = Field(default=600.0, gt=0)
    retention_budget_s: float = Field(default=300.0, ge=0)
    retention_chunk_batches: int = Field(default=100, ge=1)
    # One Celery beat sends the ticks: it holds a Redis lock with this lease (app/worker/beat.py).
    beat_lock_lease_s: float = 10.0
    # How far ahead of a model's concurrency cap the dispatcher releases work.
    dispatch_ahead_factor: float = 2.0
    queued_lease_s: float = 120.0
    running_lease_margin_s: float = 30.0
    # A worker renews the leases of the items whose calls it has in flight this often
    # (at most a third of a running lease): in PostgreSQL, and in Redis, where the
    # sweep sees that their owner is alive while PostgreSQL was away (app/worker/heartbeat.py).
    heartbeat_interval_s: float = Field(default=5.0, gt=0)
    # A synchronous call's caller counts as there for this long after its API process
    # last renewed it (every few polls while it waits): the sweep cancels, rather than
    # hands to a worker, a call whose lease ran out and whose caller is gone.
    caller_lease_s: float = Field(default=10.0, gt=0)
    max_attempts: int = 5
    # A provider 429 is a budget signal, not a failure: it uses no attempt. This many
    # 429s for one item end it (failed, rate_limited), so a limit configured far
    # above the provider's still ends.
    max_rate_limited: int = 30
    # After an item frees a place in its model's window, refills of the same
    # process are gathered for this long into one release.
    refill_coalesce_s: float = 0.2
    # Packs (app/worker/packs.py): when a model's calls are short, one message carries
    # several of its items, run one after another by one worker thread, so that
    # Celery's cost per message (reading it, its events, its ack) is shared. A refill
    # packs as many items as the process's recent calls of the model take
    # pack_target_s together, at most pack_max_items (1: one item per message); a
    # message that has run pack_max_s hands its untried items back, one per message.
    pack_max_items: int = Field(default=8, ge=1, le=64)
    pack_target_s: float = Field(default=0.05, gt=0)
    pack_max_s: float = Field(default=1.0, gt=0)
    # A pack runs as a group (app/worker/pack_calls.py): one gate pipeline, one claim
    # statement, one record statement and one settle pipeline for its items, whose calls
    # overlap when they are slow (then a message carries up to pack_max_items items,
    # at most a quarter of the model's max_concurrency, however slow its calls).
    # False: a pack's items run one after another, each as a message of its own would.
    pack_calls_together: bool = True
    # Run as a group, a pack of short calls (two fit in pack_target_s) is sized by
    # count: as many as take half of pack_max_s one after another, at most this many
    # (pack_max_items=1 still turns packs off). Its calls go in rounds of
    # pack_max_items within pack_target_s (one gate pipeline, claim, record and settle
    # pipeline a round); after pack_max_s the rounds not begun are handed back.
    pack_short_items: int = Field(default=64, ge=1, le=256)

    # Provider calls. Streaming lets a cancel stop a call mid-answer.
    stream_calls: bool = True
    # Streamed OpenAI-compatible calls on urllib3 rather than through the SDK's httpx
    # stack (providers/lean_http.py): the same request and errors, under half the CPU.
    lean_http: bool = True
    call_timeout_s: float = 120.0
    retry_base_s: float = 0.5
    retry_max_s: float = 30.0

    # Token budget (app/limits/budget.py). The registry's tokens_per_min and
    # requests_per_min apply to every window of budget_window_s seconds (60 in
    # production; tests shorten it together with the simulator's window). A
    # reservation counts budget_guard_s longer, covering the time from grant
    # to the request reaching the provider.
    budget_enabled: bool = True
    budget_window_s: float = 60.0
    budget_guard_s: float = 1.0
    # Waits up to this go back to the broker as retry(countdown); longer ones
    # return the item to PostgreSQL for the dispatcher.
    max_countdown_s: float = 60.0
    # How long a worker polls for a concurrency slot before handing the item back.
    slot_wait_s: float = 2.0
    # The calls' reserve (app/domain/call_reserve.py): while a synchronous call entered
    # a model's gate within call_reserve_recent_s, other work leaves this many of the
    # model's slots (less those calls hold; at most max_concurrency - 1) free for the
    # next call, so that it starts at once behind a backlog. Without recent calls the
    # reserve is lent to batch work. 0: no reserve.
    call_reserved_slots: int = Field(default=1, ge=0)
    # Dollar budgets (batchgen.worker.money, docs/money.md): a tenant whose budget
    # cannot cover its next item is passed over by dispatch rounds for this long (then
    # tried again: the period may have rolled, the limit been raised, calls settled).
    money_hold_s: float = Field(default=5.0, gt=0)
    # A budget's rebuild from the ledger keeps reservations younger than this that it
    # cannot see in flight or ledgered (their transaction may not have committed yet).
    money_sync_grace_s: float = Field(default=10.0, ge=0)
    # A call's prompt estimate is reserved at this many times its input price: above 1
    # for a provider that counts more tokens than our tokenizer, or writes prompt
    # caches (Anthropic bills a cache write at 1.25x input).
    money_prompt_margin: float = Field(default=1.0, ge=1.0)
    # The operator's webhook for budget alerts (Standard Webhooks, signed with
    # money_webhook_secret), besides the tenant's own; None: none.
    money_webhook_url: str | None = None
    money_webhook_secret: str = ""
    call_reserve_recent_s: float = Field(default=30.0, ge=0)
    # A 429's retry-after closes the whole budget key for at most this long (then
    # the next call probes the provider again); an item waiting on a cooldown is
    # never expired before its own deadline.
    max_cooldown_s: float = 60.0
    # Fairness for large requests: callers denied by a model's budget line up by
    # first denial; the first budget_held_claims of them (at most one limit of
    # tokens together) hold a claim on the tokens they asked for, and any other
    # request is granted only if room for the claims ahead of it remains (0: no
    # claims, the first to find room wins). A claim lapses budget_claim_ttl_s
    # after its caller's last try (a vanished caller frees it by itself).
    budget_held_claims: int = 32
    budget_claim_ttl_s: float = 150.0
    # The learned ratio per model between the provider's count of a prompt and ours
    # (app/domain/rate_limits.py): each sample moves it by budget_ratio_weight of the
    # difference (0: never learn, reservations use our own count), within
    # [budget_ratio_min, budget_ratio_max]. A sample from the headers of a bucket
    # needs budget_ratio_min_calls calls granted between two headers.
    budget_ratio_weight: float = Field(default=0.3, ge=0.0, le=1.0)
    budget_ratio_min: float = Field(default=0.5, gt=0.0)
    budget_ratio_max: float = Field(default=3.0, gt=0.0)
    budget_ratio_min_calls: int = Field(default=4, ge=1)
    # Until a model's provider has reported its own count (no sample yet, e.g. a fresh
    # Redis), its prompts are reserved at budget_ratio_start times ours: the providers'
    # counts of English prose run up to about 30 % above tiktoken's, and a first burst
    # reserved at our own count overshoots a limit configured exactly. The first sample
    # then replaces it whole; later ones move the mean.
    budget_ratio_start: float = Field(default=1.3, gt=0.0)
    # A bucket's header says what the provider had left once it counted that call;
    # calls granted up to budget_send_spread_s before it may reach the provider after
    # it (threads take their turns between grant and send), so the level set from the
    # header leaves them out as if not yet counted (0: only calls granted after it).
    budget_send_spread_s: float = Field(default=0.05, ge=0.0)
    # A model whose registry entry sets no limit_shape starts as a bucket and learns
    # its provider's shape from the reset headers (app/domain/rate_limits.py
    # shape_evidence): this many headers in a row that show the other shape switch it.
    budget_shape_samples: int = Field(default=3, ge=1)

    # Deployment pools (app/domain/pools.py): a call that fails on one deployment of a
    # model with several (429, 5xx, time-out, refused connection) goes to another at
    # once, using none of the item's failure attempts, at most max_failovers times an
    # item (then failures count as attempts again). A deployment with
    # breaker_failures such failures within breaker_window_s cools down (skipped by
    # every worker) for breaker_cooldown_s, doubled at each trip that follows without a
    # success between, at most max_cooldown_s; after it, one failure trips it again.
    max_failovers: int = Field(default=20, ge=0)
    breaker_failures: int = Field(default=3, ge=1)
    breaker_window_s: float = Field(default=10.0, gt=0)
    breaker_cooldown_s: float = Field(default=5.0, gt=0)

    # Broker: unacked messages come back after this; longer than any countdown we use.
    visibility_timeout_s: int = 3600
    worker_concurrency: int = 16

    # Dashboard sign-in (app/dashboard_auth.py): a session lasts dashboard_session_s
    # (a server-side record in Redis, deleted at sign-out); at most
    # dashboard_signin_attempts sign-ins per client address and per key in any
    # dashboard_signin_window_s (then 429 with Retry-After).
    dashboard_session_s: float = Field(default=8 * 3600.0, gt=0)
    dashboard_signin_attempts: int = Field(default=10, ge=1)
    dashboard_signin_window_s: float = Field(default=300.0, gt=0)
    # Behind a reverse proxy that sets X-Forwarded-Proto and X-Forwarded-For (and
    # strips what clients send): trust them for the dashboard's cookie (Secure when the
    # client's side is https) and for the sign-in limit's client address. Off: the
    # connection's own scheme and address.
    trusted_proxy: bool = False

    api_host: str = "127.0.0.1"
    api_port: int = 8000
    # `batchgen api` (app/serving.py): gunicorn worker processes, and threads in each
    # (a synchronous call holds one for as long as its caller waits).
    api_workers: int = Field(default=2, ge=1)
    api_threads: int = Field(default=64, ge=1)
    # GET /metrics wants "Authorization: Bearer <token>" (or an admin API key).
    metrics_token: str | None = Field(default=None, repr=False)
    # Operator keys of the admin API (/admin/v1, app/admin_api.py): JSON list of
    # "<name>:<sha256 of the key>" (`batchgen admin operator-key NAME` makes one). Only
    # hashes are configured; the name is who the audit log says made a change. Empty:
    # the admin API answers 401 (in Django, staff users may still use it).
    admin_keys: list[str] = Field(default_factory=list, repr=False)

    # Nightly description jobs (app/nightly/, tasks/nightly.py) -----------------
    # The TOML file listing the jobs; unset: the nightly task has nothing to do.
    nightly_jobs_file: Path | None = None
    # When Celery beat starts them: a five-field cron expression (Celery's timezone, UTC).
    nightly_cron: str = "0 2 * * *"
    # How often a submitted nightly run checks whether its batches have ended.
    nightly_poll_s: float = 60.0
    # Basic auth that `batchgen flower` requires (it refuses to start without it).
    flower_user: str | None = None
    flower_password: str | None = Field(default=None, repr=False)
    # ------------------------------------------------ end of nightly description jobs

    @field_validator("webhook_allow_nets")
    @classmethod
    def _cidrs(cls, values: list[str]) -> list[str]:
        import ipaddress

        for value in values:
            try:
                ipaddress.ip_network(value, strict=False)
            except ValueError as exc:
                raise ValueError(f"not a CIDR network: {value!r}") from exc
        return values

    @field_validator("admin_keys")
    @classmethod
    def _operator_hashes(cls, values: list[str]) -> list[str]:
        import re

        for value in values:
            name, _, digest = value.rpartition(":")
            if not name or not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ValueError(
                    "BATCHGEN_ADMIN_KEYS entries are '<name>:<64 hex digits of SHA-256>'"
                )
        return values

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        """What repr() and str() show: secrets masked, passwords cut out of URLs."""
        for name, value in super().__repr_args__():
            if isinstance(value, str) and name and name.endswith(SECRET_SUFFIXES):
                value = REDACTED
            elif isinstance(value, str) and "://" in value:
                value = redact_url(value)
            yield name, value

    @property
    def broker_url(self) -> str:
        """The Celery broker: ``CELERY_BROKER_URL``, else the Redis server."""
        url = self.celery_broker_url or self.redis_url
        if not url:
            raise RuntimeError("no broker: set CELERY_BROKER_URL or REDIS_URL")
        if url.startswith(("redis+sentinel://", "redis+cluster://")):
            # Celery's Redis transport takes neither form (docs/operations.md).
            raise RuntimeError(
                "REDIS_URL names Sentinels or a Redis Cluster: set CELERY_BROKER_URL "
                "to the broker (redis://, or amqp://)"
            )
        return url

    @property
    def sqlalchemy_url(self) -> str:
        """``DATABASE_URL`` with the psycopg 3 driver named, as SQLAlchemy wants it."""
        if not self.database_url:
            raise RuntimeError("DATABASE_URL is not set")
        return _psycopg_url(self._with_password(self.database_url))

    @property
    def direct_sqlalchemy_url(self) -> str:
        """``BATCHGEN_DATABASE_DIRECT_URL`` (else ``DATABASE_URL``), in SQLAlchemy's form:
        a connection to PostgreSQL itself, never through a transaction pooler."""
        if self.database_direct_url:
            return _psycopg_url(self._with_password(self.database_direct_url))
        return self.sqlalchemy_url

    def _with_password(self, url: str) -> str:
        """``url`` with the password of ``database_password_file``, if one is set."""
        if self.database_password_file is None:
            return url
        lines = self.database_password_file.read_text(encoding="utf-8").splitlines()
        password = lines[0] if lines else ""
        parts = urlsplit(url)
        user = quote(parts.username or "", safe="")
        host = parts.netloc.rpartition("@")[2]
        return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))

    @property
    def db_pool_size_or_default(self) -> int:
        """``db_pool_size``, or its default: a quarter of ``worker_concurrency``, at least 2."""
        if self.db_pool_size is not None:
            return self.db_pool_size
        return max(2, -(-self.worker_concurrency // 4))

    @property
    def db_prepare_threshold(self) -> int | None:
        """psycopg's ``prepare_threshold`` for the pool to ``DATABASE_URL``: None never
        prepares (see ``db_prepared_statements``)."""
        on = self.db_prepared_statements
        if on is None:
            on = self.database_direct_url is None
        return PREPARE_AFTER_RUNS if on else None

    @property
    def db_pool_bound(self) -> int:
        """The most connections a process's pool to ``DATABASE_URL`` opens at once."""
        return self.db_pool_size_or_default + self.db_max_overflow


def _psycopg_url(url: str) -> str:
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


@functools.cache
def _process_settings() -> Settings:
    return Settings()


T = TypeVar("T")


class SettingsScope:
    """The settings of one host app (a Flask app's ``BATCHGEN_*`` config over the
    environment) and the clients built from them: engines and Redis clients, made on
    first use inside the scope and closed with it. While a scope is active in a
    context (:meth:`active`), :func:`get_settings` returns its settings, and the store
    and the limits open their connections through it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._resources: dict[Hashable, Any] = {}
        self._closers: list[Callable[[], None]] = []
        self._lock = threading.RLock()  # a resource may be made of another (sessions of an engine)

    def resource(self, key: Hashable, make: Callable[[], T], close: Callable[[T], None]) -> T:
        """The scope's one ``key`` resource, made by ``make`` on first use; ``close`` runs
        on it when the scope closes."""
        with self._lock:
            if key not in self._resources:
                value = make()
                self._resources[key] = value
                self._closers.append(lambda: close(value))
            return self._resources[key]  # type: ignore[no-any-return]

    def close(self) -> None:
        """Close every client the scope made (engines disposed, Redis pools closed)."""
        with self._lock:
            closers, self._closers, self._resources = self._closers, [], {}
        for closer in reversed(closers):
            # Closing at exit: a server already gone is no error.
            with contextlib.suppress(Exception):
                closer()

    @contextmanager
    def active(self) -> Iterator[SettingsScope]:
        """Make this scope the current one in this context (a thread, a request)."""
        token = _current_scope.set(self)
        try:
            yield self
        finally:
            _current_scope.reset(token)


_current_scope: contextvars.ContextVar[SettingsScope | None] = contextvars.ContextVar(
    "batchgen_settings_scope", default=None
)


def current_scope() -> SettingsScope | None:
    """The active :class:`SettingsScope` (a host app's), or None: the process's own."""
    return _current_scope.get()


def activate_scope(scope: SettingsScope) -> contextvars.Token[SettingsScope | None]:
    """Make ``scope`` current until :func:`deactivate_scope` with the returned token
    (for frameworks that enter and leave in two callbacks, like Flask's app context)."""
    return _current_scope.set(scope)


def deactivate_scope(token: contextvars.Token[SettingsScope | None]) -> None:
    """Undo :func:`activate_scope`."""
    _current_scope.reset(token)


class _SettingsGetter:
    def __call__(self) -> Settings:
        """The settings in force: the active host app's (:class:`SettingsScope`), else
        the process's own, read once from the environment."""
        scope = _current_scope.get()
        return scope.settings if scope is not None else _process_settings()

    def cache_clear(self) -> None:
        """Read the process's settings from the environment again at the next call."""
        _process_settings.cache_clear()


get_settings = _SettingsGetter()
