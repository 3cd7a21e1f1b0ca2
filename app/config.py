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
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self, TypeVar
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
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


def _env(*names: str) -> AliasChoices:
    """The environment variables a field reads (its ``BATCHGEN_*`` name first)."""
    return AliasChoices(*names)


class _Concern(BaseSettings):
    """One concern's settings, read from the environment under their flat names
    (``BATCHGEN_<PREFIX><FIELD>`` or the field's aliases)."""

    model_config = SettingsConfigDict(env_prefix="BATCHGEN_", extra="ignore", populate_by_name=True)

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        """What repr() and str() show: secrets masked, passwords cut out of URLs."""
        for name, value in super().__repr_args__():
            if isinstance(value, str) and name and f"_{name}".endswith(SECRET_SUFFIXES):
                value = REDACTED
            elif isinstance(value, str) and "://" in value:
                value = redact_url(value)
            yield name, value

    @classmethod
    def env_names(cls) -> dict[str, tuple[str, ...]]:
        """Each field's environment variables, the ``BATCHGEN_*`` one first."""
        prefix = str(cls.model_config.get("env_prefix", ""))
        names: dict[str, tuple[str, ...]] = {}
        for name, field in cls.model_fields.items():
            alias = field.validation_alias
            if isinstance(alias, AliasChoices):
                names[name] = tuple(str(choice) for choice in alias.choices)
            else:
                names[name] = (f"{prefix}{name}".upper(),)
        return names


class DatabaseSettings(_Concern):
    """PostgreSQL (docs/operations.md, "Connections")."""

    model_config = SettingsConfigDict(env_prefix="BATCHGEN_DB_")

    url: str | None = Field(
        default=None, validation_alias=_env("BATCHGEN_DATABASE_URL", "DATABASE_URL")
    )
    # DATABASE_URL may be a transaction pooler (PgBouncer, pool_mode = transaction);
    # what needs one server session for longer than a transaction goes to direct_url
    # instead: the LISTEN of synchronous calls, the offload tick's session advisory
    # lock, and migrations. Unset: DATABASE_URL.
    direct_url: str | None = Field(
        default=None, validation_alias=_env("BATCHGEN_DATABASE_DIRECT_URL")
    )
    # A file holding the database password (a Compose or Kubernetes secret, e.g.
    # /run/secrets/postgres_password): its first line is the password of DATABASE_URL
    # and BATCHGEN_DATABASE_DIRECT_URL, which then carry none.
    password_file: Path | None = Field(
        default=None, validation_alias=_env("BATCHGEN_DATABASE_PASSWORD_FILE")
    )
    # Each process keeps one pool to DATABASE_URL: at most pool_size connections
    # kept open plus max_overflow more opened under load (closed when returned).
    # A thread holds one only for a statement or a transaction, never during a
    # provider call, so a pool smaller than the thread count serves them all; a
    # thread that finds every connection busy waits up to pool_timeout_s (then
    # the attempt counts as a database outage and is retried). Unset pool_size:
    # worker.concurrency / 4, rounded up, at least 2 (see Settings.db_pool_bound).
    pool_size: int | None = Field(default=None, ge=1)
    max_overflow: int = Field(default=0, ge=0)
    pool_timeout_s: float = Field(default=30.0, gt=0)
    # psycopg's server-side prepared statements (a statement run PREPARE_AFTER_RUNS
    # times is prepared on its connection: the hot path's statements are then parsed
    # and planned once). None, the default: on when DATABASE_URL is PostgreSQL itself,
    # off when BATCHGEN_DATABASE_DIRECT_URL is set, since DATABASE_URL is then a
    # transaction pooler (PgBouncer before 1.21 has no max_prepared_statements;
    # Debian 12 ships 1.18). True or False decides it either way.
    prepared_statements: bool | None = None

    @property
    def sqlalchemy_url(self) -> str:
        """``DATABASE_URL`` with the psycopg 3 driver named, as SQLAlchemy wants it."""
        if not self.url:
            raise RuntimeError("DATABASE_URL is not set")
        return _psycopg_url(self._with_password(self.url))

    @property
    def direct_sqlalchemy_url(self) -> str:
        """``BATCHGEN_DATABASE_DIRECT_URL`` (else ``DATABASE_URL``), in SQLAlchemy's form:
        a connection to PostgreSQL itself, never through a transaction pooler."""
        if self.direct_url:
            return _psycopg_url(self._with_password(self.direct_url))
        return self.sqlalchemy_url

    def _with_password(self, url: str) -> str:
        """``url`` with the password of ``password_file``, if one is set."""
        if self.password_file is None:
            return url
        lines = self.password_file.read_text(encoding="utf-8").splitlines()
        password = lines[0] if lines else ""
        parts = urlsplit(url)
        user = quote(parts.username or "", safe="")
        host = parts.netloc.rpartition("@")[2]
        return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))

    @property
    def prepare_threshold(self) -> int | None:
        """psycopg's ``prepare_threshold`` for the pool to ``DATABASE_URL``: None never
        prepares (see ``prepared_statements``)."""
        on = self.prepared_statements
        if on is None:
            on = self.direct_url is None
        return PREPARE_AFTER_RUNS if on else None


class RedisSettings(_Concern):
    model_config = SettingsConfigDict(env_prefix="BATCHGEN_REDIS_")

    url: str | None = Field(default=None, validation_alias=_env("BATCHGEN_REDIS_URL", "REDIS_URL"))
    # How long a Redis command (and a connect) may take before the caller gets a 503:
    # a Redis that is down or silent never holds a request longer than this per call.
    socket_timeout_s: float = Field(default=5.0, gt=0)


class BrokerSettings(_Concern):
    """Celery's broker."""

    celery_url: str | None = Field(
        default=None, validation_alias=_env("BATCHGEN_CELERY_BROKER_URL", "CELERY_BROKER_URL")
    )
    # Unacked messages come back after this; longer than any countdown we use.
    visibility_timeout_s: int = 3600


class PathSettings(_Concern):
    data_dir: Path = Path(".batchgen")
    models_file: Path = DEFAULT_MODELS_FILE


class LogSettings(_Concern):
    model_config = SettingsConfigDict(env_prefix="BATCHGEN_LOG_")

    json_lines: bool = Field(default=False, validation_alias=_env("BATCHGEN_LOG_JSON"))
    level: str = "INFO"


class SubmitSettings(_Concern):
    """Submission bounds."""

    max_batch_lines: int = 50_000
    # A request body (JSONL, an upload, a Message Batch) is read under this bound,
    # counted while it streams (app/bodies.py): past it, a 413 at once.
    max_body_bytes: int = 200 * 1024 * 1024
    # The bound of a synchronous call's body (POST /v1/chat/completions, /v1/messages),
    # parsed whole as JSON: a prompt that fits a context window is far smaller.
    max_call_body_bytes: int = 32 * 1024 * 1024
    default_completion_window_s: int = 24 * 3600
    # Backlog bound per model, in minutes of its tokens_per_min (see app/store/quotas.py).
    max_backlog_min: float = 60.0
    # Text a submit may hand the tokenizer in all (bytes of prompt text, all lines);
    # more → 413. Bounds the CPU one request can cost (see app/domain/formats/admission.py).
    max_tokenize_bytes: int = 64 * 1024 * 1024
    # Test mode for a host project's tests (a Django TestCase): a submit validates and
    # describes the batch as usual, then keeps nothing: nothing runs, nothing is billed.
    dry_run: bool = False


class FileSettings(_Concern):
    """Uploaded files (POST /v1/files)."""

    # How long an uploaded file is kept unless its upload asks for less
    # (expires_after); the sweep deletes it then. Output files of a batch are its
    # results, read on demand: they go with the batch.
    retention_s: int = Field(default=30 * 86400, validation_alias=_env("BATCHGEN_FILE_RETENTION_S"))
    # What one tenant may keep uploaded at once (files not yet deleted or expired):
    # how many, and their bytes in all; over it, a 429 until a file goes. A tenant's
    # own max_files / max_file_bytes (batchgen tenants create) overrides these.
    tenant_max_files: int = Field(default=1000, ge=1)
    tenant_max_file_bytes: int = Field(default=2 * 1024 * 1024 * 1024, ge=1)


class CallSettings(_Concern):
    """Synchronous calls (POST /v1/chat/completions, /v1/messages)."""

    model_config = SettingsConfigDict(env_prefix="BATCHGEN_CALL_")

    # How long a caller waits, queueing included, when it names no timeout
    # (X-Request-Timeout, the body's timeout, or the SDKs' own
    # x-stainless-read-timeout), and at most.
    default_timeout_s: float = 600.0
    max_timeout_s: float = 600.0
    # A waiting call reads its item this often besides being woken at its end (NOTIFY),
    # and checks that its caller is still connected.
    poll_s: float = 0.5
    # A synchronous call's caller counts as there for this long after its API process
    # last renewed it (every few polls while it waits): the sweep cancels, rather than
    # hands to a worker, a call whose lease ran out and whose caller is gone.
    caller_lease_s: float = Field(
        default=10.0, gt=0, validation_alias=_env("BATCHGEN_CALLER_LEASE_S")
    )
    # The calls' reserve (app/domain/scheduling/call_reserve.py): while a synchronous call entered
    # a model's gate within reserve_recent_s, other work leaves this many of the
    # model's slots (less those calls hold; at most max_concurrency - 1) free for the
    # next call, so that it starts at once behind a backlog. Without recent calls the
    # reserve is lent to batch work. 0: no reserve.
    reserved_slots: int = Field(default=1, ge=0)
    reserve_recent_s: float = Field(default=30.0, ge=0)


class WorkerSettings(_Concern):
    """Dispatch, leases and the worker processes."""

    concurrency: int = Field(default=16, validation_alias=_env("BATCHGEN_WORKER_CONCURRENCY"))
    dispatch_interval_s: float = 1.0
    sweep_interval_s: float = 5.0
    # How often a process using the gate checks its state marker in Redis (a Redis that
    # lost the gate's state is rebuilt from the database: app/worker/gate_recovery.py);
    # the sweep checks it on every tick too.
    gate_state_check_s: float = 1.0
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
    max_attempts: int = 5
    # A provider 429 is a budget signal, not a failure: it uses no attempt. This many
    # 429s for one item end it (failed, rate_limited), so a limit configured far
    # above the provider's still ends.
    max_rate_limited: int = 30
    # After an item frees a place in its model's window, refills of the same
    # process are gathered for this long into one release.
    refill_coalesce_s: float = 0.2
    # Waits up to this go back to the broker as retry(countdown); longer ones
    # return the item to PostgreSQL for the dispatcher.
    max_countdown_s: float = 60.0
    # How long a worker polls for a concurrency slot before handing the item back.
    slot_wait_s: float = 2.0


class PackSettings(_Concern):
    """Packs (app/worker/packs.py): when a model's calls are short, one message carries
    several of its items, run one after another by one worker thread, so that
    Celery's cost per message (reading it, its events, its ack) is shared."""

    model_config = SettingsConfigDict(env_prefix="BATCHGEN_PACK_")

    # A refill packs as many items as the process's recent calls of the model take
    # target_s together, at most max_items (1: one item per message); a message that
    # has run max_s hands its untried items back, one per message.
    max_items: int = Field(default=8, ge=1, le=64)
    target_s: float = Field(default=0.05, gt=0)
    max_s: float = Field(default=1.0, gt=0)
    # A pack runs as a group (app/worker/pack_calls.py): one gate call, one claim
    # statement, one record statement and one settle call for its items, whose calls
    # overlap when they are slow (then a message carries up to max_items items,
    # at most a quarter of the model's max_concurrency, however slow its calls).
    # False: a pack's items run one after another, each as a message of its own would.
    calls_together: bool = True
    # Run as a group, a pack of short calls (two fit in target_s) is sized by
    # count: as many as take half of max_s one after another, at most this many
    # (max_items=1 still turns packs off). Its calls go in rounds of as many as
    # take a quarter of max_s, at most half of this (one gate call, claim, record
    # and settle call a round); after max_s the rounds not begun are handed back.
    short_items: int = Field(default=64, ge=1, le=256)
    # Such a pack out of time with calls no longer short keeps its rest (runs its
    # rounds on) while the host's CPUs were all busy as it ran: its calls were slow
    # for want of a CPU, and a hand-back's messages would cost more of it. False:
    # decided by the model's free slots alone (app/domain/lifecycle/decisions.py).
    busy_host_keeps_rest: bool = True


class ProviderSettings(_Concern):
    """Provider calls, and deployment pools (app/domain/scheduling/pools.py)."""

    # Streaming lets a cancel stop a call mid-answer.
    stream_calls: bool = True
    # Streamed OpenAI-compatible and Anthropic calls on the lean path rather than
    # through the SDKs' httpx stack (providers/lean_http.py: kept-alive sockets, the
    # answer read by httptools): the same request and errors, a fifth of the CPU.
    lean_http: bool = True
    # Import the provider SDKs and build the clients at start (a worker: of the models
    # its queues serve; the API: of every model), so that no first call waits for
    # them; false: at each model's first call in the process (a faster, lighter start).
    warm_up: bool = True
    call_timeout_s: float = 120.0
    retry_base_s: float = 0.5
    retry_max_s: float = 30.0
    # A call that fails on one deployment of a model with several (429, 5xx, time-out,
    # refused connection) goes to another at once, using none of the item's failure
    # attempts, at most max_failovers times an item (then failures count as attempts
    # again). A deployment with breaker_failures such failures within
    # breaker_window_s cools down (skipped by every worker) for breaker_cooldown_s,
    # doubled at each trip that follows without a success between, at most
    # budget.max_cooldown_s; after it, one failure trips it again.
    max_failovers: int = Field(default=20, ge=0)
    breaker_failures: int = Field(default=3, ge=1)
    breaker_window_s: float = Field(default=10.0, gt=0)
    breaker_cooldown_s: float = Field(default=5.0, gt=0)


class BudgetSettings(_Concern):
    """Token budget (app/limits/budget.py)."""

    model_config = SettingsConfigDict(env_prefix="BATCHGEN_BUDGET_")

    # The registry's tokens_per_min and requests_per_min apply to every window of
    # window_s seconds (60 in production; tests shorten it together with the
    # simulator's window). A reservation counts guard_s longer, covering the time
    # from grant to the request reaching the provider.
    enabled: bool = True
    window_s: float = 60.0
    guard_s: float = 1.0
    # A 429's retry-after closes the whole budget key for at most this long (then
    # the next call probes the provider again); an item waiting on a cooldown is
    # never expired before its own deadline.
    max_cooldown_s: float = Field(default=60.0, validation_alias=_env("BATCHGEN_MAX_COOLDOWN_S"))
    # Fairness for large requests: callers denied by a model's budget line up by
    # first denial; the first held_claims of them (at most one limit of tokens
    # together) hold a claim on the tokens they asked for, and any other request is
    # granted only if room for the claims ahead of it remains (0: no claims, the
    # first to find room wins). A claim lapses claim_ttl_s after its caller's last
    # try (a vanished caller frees it by itself).
    held_claims: int = 32
    claim_ttl_s: float = 150.0
    # The learned ratio per model between the provider's count of a prompt and ours
    # (app/domain/scheduling/rate_limits.py): each sample moves it by ratio_weight of the
    # difference (0: never learn, reservations use our own count), within
    # [ratio_min, ratio_max]. A sample from the headers of a bucket needs
    # ratio_min_calls calls granted between two headers.
    ratio_weight: float = Field(default=0.3, ge=0.0, le=1.0)
    ratio_min: float = Field(default=0.5, gt=0.0)
    ratio_max: float = Field(default=3.0, gt=0.0)
    ratio_min_calls: int = Field(default=4, ge=1)
    # Until a model's provider has reported its own count (no sample yet, e.g. a fresh
    # Redis), its prompts are reserved at ratio_start times ours: the providers'
    # counts of English prose run up to about 30 % above tiktoken's, and a first burst
    # reserved at our own count overshoots a limit configured exactly. The first sample
    # then replaces it whole; later ones move the mean.
    ratio_start: float = Field(default=1.3, gt=0.0)
    # A bucket's header says what the provider had left once it counted that call;
    # calls granted up to send_spread_s before it may reach the provider after it
    # (threads take their turns between grant and send), so the level set from the
    # header leaves them out as if not yet counted (0: only calls granted after it).
    send_spread_s: float = Field(default=0.05, ge=0.0)
    # A model whose registry entry sets no limit_shape starts as a bucket and learns
    # its provider's shape from the reset headers (app/domain/scheduling/rate_limits.py
    # shape_evidence): this many headers in a row that show the other shape switch it.
    shape_samples: int = Field(default=3, ge=1)


class MoneySettings(_Concern):
    """Dollar budgets (batchgen.worker.money_holds, docs/money.md)."""

    model_config = SettingsConfigDict(env_prefix="BATCHGEN_MONEY_")

    # A tenant whose budget cannot cover its next item is passed over by dispatch
    # rounds for this long (then tried again: the period may have rolled, the limit
    # been raised, calls settled).
    hold_s: float = Field(default=5.0, gt=0)
    # A budget's rebuild from the ledger keeps reservations younger than this that it
    # cannot see in flight or ledgered (their transaction may not have committed yet).
    sync_grace_s: float = Field(default=10.0, ge=0)
    # A call's prompt estimate is reserved at this many times its input price: above 1
    # for a provider that counts more tokens than our tokenizer, or writes prompt
    # caches (Anthropic bills a cache write at 1.25x input).
    prompt_margin: float = Field(default=1.0, ge=1.0)
    # The operator's webhook for budget alerts (Standard Webhooks, signed with
    # webhook_secret), besides the tenant's own; None: none.
    webhook_url: str | None = None
    webhook_secret: str = ""


class OffloadSettings(_Concern):
    """Offload to the providers' Batch APIs (app/worker/offload_jobs.py): the tick's
    interval, a job's first poll after its creation and the most between polls
    (doubling), and how many waiting items one tick plans per model."""

    model_config = SettingsConfigDict(env_prefix="BATCHGEN_OFFLOAD_")

    interval_s: float = 5.0
    poll_first_s: float = 30.0
    poll_max_s: float = 300.0
    plan_limit: int = 100_000


class WebhookSettings(_Concern):
    """Batch-finished notifications (app/worker/notify.py): the delivery tick, a
    webhook's time-out, and how long notifications are kept."""

    model_config = SettingsConfigDict(env_prefix="BATCHGEN_WEBHOOK_")

    notify_interval_s: float = Field(
        default=2.0, validation_alias=_env("BATCHGEN_NOTIFY_INTERVAL_S")
    )
    # One deadline for a whole webhook delivery: resolve, connect, send, read the answer.
    timeout_s: float = Field(default=10.0, gt=0)
    # CIDRs webhooks may reach although private, loopback or link-local (an in-house
    # receiver); JSON list, e.g. ["10.20.0.0/16"]. Empty: public addresses only.
    allow_nets: list[str] = Field(default_factory=list)
    # on_finished callbacks (a host's Celery task): the broker they are sent to (None:
    # batchgen's own), and the task names and queues a submit may name (JSON lists;
    # no task names: on_finished is refused).
    callback_broker_url: str | None = Field(
        default=None, validation_alias=_env("BATCHGEN_CALLBACK_BROKER_URL")
    )
    callback_tasks: list[str] = Field(
        default_factory=list, validation_alias=_env("BATCHGEN_CALLBACK_TASKS")
    )
    callback_queues: list[str] = Field(
        default_factory=lambda: ["celery"], validation_alias=_env("BATCHGEN_CALLBACK_QUEUES")
    )
    # The first retry of a failed delivery (doubling, at most an hour, for a day).
    notify_retry_first_s: float = Field(
        default=10.0, validation_alias=_env("BATCHGEN_NOTIFY_RETRY_FIRST_S")
    )
    notification_retention_s: float = Field(
        default=7 * 86400.0, validation_alias=_env("BATCHGEN_NOTIFICATION_RETENTION_S")
    )

    @field_validator("allow_nets")
    @classmethod
    def _cidrs(cls, values: list[str]) -> list[str]:
        import ipaddress

        for value in values:
            try:
                ipaddress.ip_network(value, strict=False)
            except ValueError as exc:
                raise ValueError(f"not a CIDR network: {value!r}") from exc
        return values


class RetentionSettings(_Concern):
    """Retention (app/worker/retention_tick.py)."""

    model_config = SettingsConfigDict(env_prefix="BATCHGEN_RETENTION_")

    # Finished batches older than this many days are removed with their items,
    # results and ledger rows; the daily usage totals stay. None (the default):
    # everything is kept.
    days: float | None = Field(default=None, gt=0)
    # A tick every interval_s removes expired batches, chunk_batches at a time, until
    # none is left or it has run budget_s: a chunk started is finished, so a budget of
    # 0 removes one chunk. Half of every interval is enough to keep up with a history
    # growing far faster than anything else writes it.
    interval_s: float = Field(default=600.0, gt=0)
    budget_s: float = Field(default=300.0, ge=0)
    chunk_batches: int = Field(default=100, ge=1)


class DashboardSettings(_Concern):
    """Dashboard sign-in (app/dashboard_auth.py): a session lasts session_s (a
    server-side record in Redis, deleted at sign-out); at most signin_attempts
    sign-ins per client address and per key in any signin_window_s (then 429 with
    Retry-After)."""

    model_config = SettingsConfigDict(env_prefix="BATCHGEN_DASHBOARD_")

    session_s: float = Field(default=8 * 3600.0, gt=0)
    signin_attempts: int = Field(default=10, ge=1)
    signin_window_s: float = Field(default=300.0, gt=0)


class ApiSettings(_Concern):
    model_config = SettingsConfigDict(env_prefix="BATCHGEN_API_")

    host: str = "127.0.0.1"
    port: int = 8000
    # `batchgen api` (app/serving.py): gunicorn worker processes, and threads in each
    # (a synchronous call holds one for as long as its caller waits).
    workers: int = Field(default=2, ge=1)
    threads: int = Field(default=64, ge=1)
    # Retry-After of a 503 when PostgreSQL or Redis is unreachable.
    unavailable_retry_after_s: float = Field(
        default=5.0, validation_alias=_env("BATCHGEN_UNAVAILABLE_RETRY_AFTER_S")
    )
    # Behind a reverse proxy that sets X-Forwarded-Proto and X-Forwarded-For (and
    # strips what clients send): trust them for the dashboard's cookie (Secure when the
    # client's side is https) and for the sign-in limit's client address. Off: the
    # connection's own scheme and address.
    trusted_proxy: bool = Field(default=False, validation_alias=_env("BATCHGEN_TRUSTED_PROXY"))
    # GET /metrics wants "Authorization: Bearer <token>" (or an admin API key).
    metrics_token: str | None = Field(
        default=None, repr=False, validation_alias=_env("BATCHGEN_METRICS_TOKEN")
    )
    # Operator keys of the admin API (/admin/v1, app/admin_api.py): JSON list of
    # "<name>:<sha256 of the key>" (`batchgen admin operator-key NAME` makes one). Only
    # hashes are configured; the name is who the audit log says made a change. Empty:
    # the admin API answers 401 (in Django, staff users may still use it).
    admin_keys: list[str] = Field(
        default_factory=list, repr=False, validation_alias=_env("BATCHGEN_ADMIN_KEYS")
    )

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


class NightlySettings(_Concern):
    """Nightly description jobs (app/nightly/, tasks/nightly.py)."""

    model_config = SettingsConfigDict(env_prefix="BATCHGEN_NIGHTLY_")

    # The TOML file listing the jobs; unset: the nightly task has nothing to do.
    jobs_file: Path | None = None
    # When Celery beat starts them: a five-field cron expression (Celery's timezone, UTC).
    cron: str = "0 2 * * *"
    # How often a submitted nightly run checks whether its batches have ended.
    poll_s: float = 60.0


class FlowerSettings(_Concern):
    """Basic auth that `batchgen flower` requires (it refuses to start without it)."""

    model_config = SettingsConfigDict(env_prefix="BATCHGEN_FLOWER_")

    user: str | None = None
    password: str | None = Field(default=None, repr=False)


# The concerns, by their attribute on Settings.
CONCERNS: dict[str, type[_Concern]] = {
    "database": DatabaseSettings,
    "redis": RedisSettings,
    "broker": BrokerSettings,
    "paths": PathSettings,
    "log": LogSettings,
    "submit": SubmitSettings,
    "files": FileSettings,
    "calls": CallSettings,
    "worker": WorkerSettings,
    "packs": PackSettings,
    "providers": ProviderSettings,
    "budget": BudgetSettings,
    "money": MoneySettings,
    "offload": OffloadSettings,
    "webhooks": WebhookSettings,
    "retention": RetentionSettings,
    "dashboard": DashboardSettings,
    "api": ApiSettings,
    "nightly": NightlySettings,
    "flower": FlowerSettings,
}


def _flat_name(env_name: str) -> str:
    return env_name.lower().removeprefix("batchgen_")


def env_variables() -> dict[str, tuple[str, str]]:
    """Every environment variable the settings read -> (concern, field)."""
    return {
        env: (concern, field)
        for concern, cls in CONCERNS.items()
        for field, names in cls.env_names().items()
        for env in names
    }


# The flat names (a variable's name without BATCHGEN_, e.g. ``budget_window_s``; and
# the conventional URLs' own names, e.g. ``DATABASE_URL``) that ``Settings(...)`` and
# ``Settings.model_copy(update=...)`` take, any case -> where the setting lives:
# (concern, field).
FLAT_NAMES: dict[str, tuple[str, str]] = {
    _flat_name(env): where for env, where in env_variables().items() if env.startswith("BATCHGEN_")
}
# The service URLs' keywords take their variables' names too (BATCHGEN_DATABASE_URL,
# DATABASE_URL), as their aliases always did.
FLAT_NAMES.update(
    {
        env.lower(): where
        for env, where in env_variables().items()
        if where[1].endswith("url") and where[0] in ("database", "redis", "broker")
    }
)


def _route(data: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat keyword settings sorted by concern; unknown names are ignored (as the
    environment's unknown BATCHGEN_* variables are)."""
    routed: dict[str, dict[str, Any]] = {concern: {} for concern in CONCERNS}
    for key, value in data.items():
        if key in CONCERNS and isinstance(value, Mapping):
            routed[key].update(value)
        elif (where := FLAT_NAMES.get(key.lower())) is not None:
            routed[where[0]][where[1]] = value
    return routed


def _concern(concern: str, values: dict[str, Any]) -> _Concern:
    """``concern``'s settings from ``values`` over the environment. A bad value raises a
    ValidationError that names its environment variable (``BATCHGEN_RETENTION_DAYS``),
    not the field of the concern it lands in."""
    cls = CONCERNS[concern]
    try:
        return cls(**values)
    except ValidationError as error:
        names = cls.env_names()
        details: list[Any] = []  # pydantic's InitErrorDetails: the same errors, renamed
        for line in error.errors():
            field = str(line["loc"][0]) if line["loc"] else ""
            details.append(
                {
                    "type": line["type"],
                    "loc": (names.get(field, (field,))[0], *line["loc"][1:]),
                    "input": line.get("input"),
                    "ctx": line.get("ctx", {}),
                }
            )
        raise ValidationError.from_exception_data("Settings", details) from None


class Settings(BaseModel):
    """Typed settings from the environment, by concern (``settings.budget.window_s``
    reads ``BATCHGEN_BUDGET_WINDOW_S``). ``Settings(budget_window_s=5)`` takes the flat
    names (a variable's name without ``BATCHGEN_``, any case) over the environment."""

    model_config = ConfigDict(extra="ignore")

    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    paths: PathSettings = Field(default_factory=PathSettings)
    log: LogSettings = Field(default_factory=LogSettings)
    submit: SubmitSettings = Field(default_factory=SubmitSettings)
    files: FileSettings = Field(default_factory=FileSettings)
    calls: CallSettings = Field(default_factory=CallSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    packs: PackSettings = Field(default_factory=PackSettings)
    providers: ProviderSettings = Field(default_factory=ProviderSettings)
    budget: BudgetSettings = Field(default_factory=BudgetSettings)
    money: MoneySettings = Field(default_factory=MoneySettings)
    offload: OffloadSettings = Field(default_factory=OffloadSettings)
    webhooks: WebhookSettings = Field(default_factory=WebhookSettings)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    dashboard: DashboardSettings = Field(default_factory=DashboardSettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    nightly: NightlySettings = Field(default_factory=NightlySettings)
    flower: FlowerSettings = Field(default_factory=FlowerSettings)

    @model_validator(mode="before")
    @classmethod
    def _by_concern(cls, data: Any) -> Any:
        """``Settings(...)`` and ``Settings.model_validate({...})`` alike: flat names
        sorted by concern, each concern read from the environment under what they leave
        unset (a concern given whole is kept as it is); a bad value raises a
        ValidationError naming its variable."""
        if not isinstance(data, Mapping):
            return data
        built: dict[str, Any] = {}
        for concern, values in _route(data).items():
            given = data.get(concern)
            if isinstance(given, _Concern) and not values:
                built[concern] = given
            else:
                base = given.model_dump() if isinstance(given, _Concern) else {}
                built[concern] = _concern(concern, {**base, **values})
        return built

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy with ``update``'s settings replaced; it takes the flat names too
        (``update={"lean_http": False}``), unvalidated, as pydantic's own does."""
        nested: dict[str, Any] = {}
        for key, value in (update or {}).items():
            if key in CONCERNS:
                nested[key] = value
                continue
            where = FLAT_NAMES.get(key.lower())
            if where is None:
                raise ValueError(f"no setting named {key!r}")
            concern, field = where
            current = nested.get(concern, getattr(self, concern))
            nested[concern] = current.model_copy(update={field: value})
        return super().model_copy(update=nested, deep=deep)

    @property
    def broker_url(self) -> str:
        """The Celery broker: ``CELERY_BROKER_URL``, else the Redis server."""
        url = self.broker.celery_url or self.redis.url
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
        return self.database.sqlalchemy_url

    @property
    def direct_sqlalchemy_url(self) -> str:
        """``BATCHGEN_DATABASE_DIRECT_URL`` (else ``DATABASE_URL``), in SQLAlchemy's form."""
        return self.database.direct_sqlalchemy_url

    @property
    def db_pool_size_or_default(self) -> int:
        """``database.pool_size``, or its default: a quarter of ``worker.concurrency``,
        at least 2."""
        if self.database.pool_size is not None:
            return self.database.pool_size
        return max(2, -(-self.worker.concurrency // 4))

    @property
    def db_prepare_threshold(self) -> int | None:
        """psycopg's ``prepare_threshold`` for the pool to ``DATABASE_URL``."""
        return self.database.prepare_threshold

    @property
    def db_pool_bound(self) -> int:
        """The most connections a process's pool to ``DATABASE_URL`` opens at once."""
        return self.db_pool_size_or_default + self.database.max_overflow


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
