"""Every environment variable the flat settings read (before they were nested by
concern, #38) is still read, into its concern's field.

The table was generated from the flat ``Settings`` as it was: each field's
``BATCHGEN_<NAME>`` and its aliases, a value unlike the default, the value expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batchgen.config import FLAT_NAMES, Settings, env_variables

# (variable, "<concern>.<field>", what the environment holds, the value read)
VARIABLES: list[tuple[str, str, str, Any]] = [
    (
        "BATCHGEN_DATABASE_URL",
        "database.url",
        "postgresql://u@h-database_url/d",
        "postgresql://u@h-database_url/d",
    ),
    (
        "DATABASE_URL",
        "database.url",
        "postgresql://u@h-database_url/d",
        "postgresql://u@h-database_url/d",
    ),
    ("BATCHGEN_REDIS_URL", "redis.url", "redis://h-redis_url:6379/0", "redis://h-redis_url:6379/0"),
    ("REDIS_URL", "redis.url", "redis://h-redis_url:6379/0", "redis://h-redis_url:6379/0"),
    (
        "BATCHGEN_CELERY_BROKER_URL",
        "broker.celery_url",
        "redis://h-celery_broker_url:6379/0",
        "redis://h-celery_broker_url:6379/0",
    ),
    (
        "CELERY_BROKER_URL",
        "broker.celery_url",
        "redis://h-celery_broker_url:6379/0",
        "redis://h-celery_broker_url:6379/0",
    ),
    (
        "BATCHGEN_DATABASE_DIRECT_URL",
        "database.direct_url",
        "postgresql://u@h-database_direct_url/d",
        "postgresql://u@h-database_direct_url/d",
    ),
    (
        "BATCHGEN_DATABASE_PASSWORD_FILE",
        "database.password_file",
        "/tmp/some/database_password_file",
        "/tmp/some/database_password_file",
    ),
    ("BATCHGEN_DB_POOL_SIZE", "database.pool_size", "7", 7),
    ("BATCHGEN_DB_MAX_OVERFLOW", "database.max_overflow", "7", 7),
    ("BATCHGEN_DB_POOL_TIMEOUT_S", "database.pool_timeout_s", "0.75", 0.75),
    ("BATCHGEN_DB_PREPARED_STATEMENTS", "database.prepared_statements", "true", True),
    ("BATCHGEN_DATA_DIR", "paths.data_dir", "/tmp/some/data_dir", "/tmp/some/data_dir"),
    ("BATCHGEN_MODELS_FILE", "paths.models_file", "/tmp/some/models_file", "/tmp/some/models_file"),
    ("BATCHGEN_LOG_JSON", "log.json_lines", "true", True),
    ("BATCHGEN_LOG_LEVEL", "log.level", "DEBUG", "DEBUG"),
    ("BATCHGEN_MAX_BATCH_LINES", "submit.max_batch_lines", "7", 7),
    ("BATCHGEN_MAX_BODY_BYTES", "submit.max_body_bytes", "7", 7),
    ("BATCHGEN_MAX_CALL_BODY_BYTES", "submit.max_call_body_bytes", "7", 7),
    ("BATCHGEN_FILE_RETENTION_S", "files.retention_s", "7", 7),
    ("BATCHGEN_TENANT_MAX_FILES", "files.tenant_max_files", "7", 7),
    ("BATCHGEN_TENANT_MAX_FILE_BYTES", "files.tenant_max_file_bytes", "7", 7),
    ("BATCHGEN_DEFAULT_COMPLETION_WINDOW_S", "submit.default_completion_window_s", "7", 7),
    ("BATCHGEN_MAX_BACKLOG_MIN", "submit.max_backlog_min", "0.75", 0.75),
    ("BATCHGEN_MAX_TOKENIZE_BYTES", "submit.max_tokenize_bytes", "7", 7),
    ("BATCHGEN_UNAVAILABLE_RETRY_AFTER_S", "api.unavailable_retry_after_s", "0.75", 0.75),
    ("BATCHGEN_REDIS_SOCKET_TIMEOUT_S", "redis.socket_timeout_s", "0.75", 0.75),
    ("BATCHGEN_CALL_DEFAULT_TIMEOUT_S", "calls.default_timeout_s", "0.75", 0.75),
    ("BATCHGEN_CALL_MAX_TIMEOUT_S", "calls.max_timeout_s", "0.75", 0.75),
    ("BATCHGEN_CALL_POLL_S", "calls.poll_s", "0.75", 0.75),
    ("BATCHGEN_DRY_RUN", "submit.dry_run", "true", True),
    ("BATCHGEN_DISPATCH_INTERVAL_S", "worker.dispatch_interval_s", "0.75", 0.75),
    ("BATCHGEN_SWEEP_INTERVAL_S", "worker.sweep_interval_s", "0.75", 0.75),
    ("BATCHGEN_GATE_STATE_CHECK_S", "worker.gate_state_check_s", "0.75", 0.75),
    ("BATCHGEN_OFFLOAD_INTERVAL_S", "offload.interval_s", "0.75", 0.75),
    ("BATCHGEN_OFFLOAD_POLL_FIRST_S", "offload.poll_first_s", "0.75", 0.75),
    ("BATCHGEN_OFFLOAD_POLL_MAX_S", "offload.poll_max_s", "0.75", 0.75),
    ("BATCHGEN_OFFLOAD_PLAN_LIMIT", "offload.plan_limit", "7", 7),
    ("BATCHGEN_NOTIFY_INTERVAL_S", "webhooks.notify_interval_s", "0.75", 0.75),
    ("BATCHGEN_WEBHOOK_TIMEOUT_S", "webhooks.timeout_s", "0.75", 0.75),
    ("BATCHGEN_WEBHOOK_ALLOW_NETS", "webhooks.allow_nets", '["10.20.0.0/16"]', ["10.20.0.0/16"]),
    (
        "BATCHGEN_CALLBACK_BROKER_URL",
        "webhooks.callback_broker_url",
        "redis://h-callback_broker_url:6379/0",
        "redis://h-callback_broker_url:6379/0",
    ),
    ("BATCHGEN_CALLBACK_TASKS", "webhooks.callback_tasks", '["x.y", "z"]', ["x.y", "z"]),
    ("BATCHGEN_CALLBACK_QUEUES", "webhooks.callback_queues", '["x.y", "z"]', ["x.y", "z"]),
    ("BATCHGEN_NOTIFY_RETRY_FIRST_S", "webhooks.notify_retry_first_s", "0.75", 0.75),
    ("BATCHGEN_NOTIFICATION_RETENTION_S", "webhooks.notification_retention_s", "0.75", 0.75),
    ("BATCHGEN_RETENTION_DAYS", "retention.days", "0.75", 0.75),
    ("BATCHGEN_RETENTION_INTERVAL_S", "retention.interval_s", "0.75", 0.75),
    ("BATCHGEN_RETENTION_BUDGET_S", "retention.budget_s", "0.75", 0.75),
    ("BATCHGEN_RETENTION_CHUNK_BATCHES", "retention.chunk_batches", "7", 7),
    ("BATCHGEN_BEAT_LOCK_LEASE_S", "worker.beat_lock_lease_s", "0.75", 0.75),
    ("BATCHGEN_DISPATCH_AHEAD_FACTOR", "worker.dispatch_ahead_factor", "0.75", 0.75),
    ("BATCHGEN_QUEUED_LEASE_S", "worker.queued_lease_s", "0.75", 0.75),
    ("BATCHGEN_RUNNING_LEASE_MARGIN_S", "worker.running_lease_margin_s", "0.75", 0.75),
    ("BATCHGEN_HEARTBEAT_INTERVAL_S", "worker.heartbeat_interval_s", "0.75", 0.75),
    ("BATCHGEN_CALLER_LEASE_S", "calls.caller_lease_s", "0.75", 0.75),
    ("BATCHGEN_MAX_ATTEMPTS", "worker.max_attempts", "7", 7),
    ("BATCHGEN_MAX_RATE_LIMITED", "worker.max_rate_limited", "7", 7),
    ("BATCHGEN_REFILL_COALESCE_S", "worker.refill_coalesce_s", "0.75", 0.75),
    ("BATCHGEN_PACK_MAX_ITEMS", "packs.max_items", "3", 3),
    ("BATCHGEN_PACK_TARGET_S", "packs.target_s", "0.75", 0.75),
    ("BATCHGEN_PACK_MAX_S", "packs.max_s", "0.75", 0.75),
    ("BATCHGEN_PACK_CALLS_TOGETHER", "packs.calls_together", "false", False),
    ("BATCHGEN_PACK_SHORT_ITEMS", "packs.short_items", "7", 7),
    ("BATCHGEN_PACK_BUSY_HOST_KEEPS_REST", "packs.busy_host_keeps_rest", "false", False),
    ("BATCHGEN_STREAM_CALLS", "providers.stream_calls", "false", False),
    ("BATCHGEN_LEAN_HTTP", "providers.lean_http", "false", False),
    ("BATCHGEN_WARM_UP", "providers.warm_up", "false", False),
    ("BATCHGEN_CALL_TIMEOUT_S", "providers.call_timeout_s", "0.75", 0.75),
    ("BATCHGEN_RETRY_BASE_S", "providers.retry_base_s", "0.75", 0.75),
    ("BATCHGEN_RETRY_MAX_S", "providers.retry_max_s", "0.75", 0.75),
    ("BATCHGEN_BUDGET_ENABLED", "budget.enabled", "false", False),
    ("BATCHGEN_BUDGET_WINDOW_S", "budget.window_s", "0.75", 0.75),
    ("BATCHGEN_BUDGET_GUARD_S", "budget.guard_s", "0.75", 0.75),
    ("BATCHGEN_MAX_COUNTDOWN_S", "worker.max_countdown_s", "0.75", 0.75),
    ("BATCHGEN_SLOT_WAIT_S", "worker.slot_wait_s", "0.75", 0.75),
    ("BATCHGEN_CALL_RESERVED_SLOTS", "calls.reserved_slots", "7", 7),
    ("BATCHGEN_MONEY_HOLD_S", "money.hold_s", "0.75", 0.75),
    ("BATCHGEN_MONEY_SYNC_GRACE_S", "money.sync_grace_s", "0.75", 0.75),
    ("BATCHGEN_MONEY_PROMPT_MARGIN", "money.prompt_margin", "1.5", 1.5),
    (
        "BATCHGEN_MONEY_WEBHOOK_URL",
        "money.webhook_url",
        "https://h-money_webhook_url/hook",
        "https://h-money_webhook_url/hook",
    ),
    (
        "BATCHGEN_MONEY_WEBHOOK_SECRET",
        "money.webhook_secret",
        "v-money_webhook_secret",
        "v-money_webhook_secret",
    ),
    ("BATCHGEN_CALL_RESERVE_RECENT_S", "calls.reserve_recent_s", "0.75", 0.75),
    ("BATCHGEN_MAX_COOLDOWN_S", "budget.max_cooldown_s", "0.75", 0.75),
    ("BATCHGEN_BUDGET_HELD_CLAIMS", "budget.held_claims", "7", 7),
    ("BATCHGEN_BUDGET_CLAIM_TTL_S", "budget.claim_ttl_s", "0.75", 0.75),
    ("BATCHGEN_BUDGET_RATIO_WEIGHT", "budget.ratio_weight", "0.25", 0.25),
    ("BATCHGEN_BUDGET_RATIO_MIN", "budget.ratio_min", "0.75", 0.75),
    ("BATCHGEN_BUDGET_RATIO_MAX", "budget.ratio_max", "0.75", 0.75),
    ("BATCHGEN_BUDGET_RATIO_MIN_CALLS", "budget.ratio_min_calls", "7", 7),
    ("BATCHGEN_BUDGET_RATIO_START", "budget.ratio_start", "0.75", 0.75),
    ("BATCHGEN_BUDGET_SEND_SPREAD_S", "budget.send_spread_s", "0.75", 0.75),
    ("BATCHGEN_BUDGET_SHAPE_SAMPLES", "budget.shape_samples", "7", 7),
    ("BATCHGEN_MAX_FAILOVERS", "providers.max_failovers", "7", 7),
    ("BATCHGEN_BREAKER_FAILURES", "providers.breaker_failures", "7", 7),
    ("BATCHGEN_BREAKER_WINDOW_S", "providers.breaker_window_s", "0.75", 0.75),
    ("BATCHGEN_BREAKER_COOLDOWN_S", "providers.breaker_cooldown_s", "0.75", 0.75),
    ("BATCHGEN_VISIBILITY_TIMEOUT_S", "broker.visibility_timeout_s", "7", 7),
    ("BATCHGEN_WORKER_CONCURRENCY", "worker.concurrency", "7", 7),
    ("BATCHGEN_DASHBOARD_SESSION_S", "dashboard.session_s", "0.75", 0.75),
    ("BATCHGEN_DASHBOARD_SIGNIN_ATTEMPTS", "dashboard.signin_attempts", "7", 7),
    ("BATCHGEN_DASHBOARD_SIGNIN_WINDOW_S", "dashboard.signin_window_s", "0.75", 0.75),
    ("BATCHGEN_TRUSTED_PROXY", "api.trusted_proxy", "true", True),
    ("BATCHGEN_API_HOST", "api.host", "v-api_host", "v-api_host"),
    ("BATCHGEN_API_PORT", "api.port", "7", 7),
    ("BATCHGEN_API_WORKERS", "api.workers", "7", 7),
    ("BATCHGEN_API_THREADS", "api.threads", "7", 7),
    ("BATCHGEN_METRICS_TOKEN", "api.metrics_token", "v-metrics_token", "v-metrics_token"),
    (
        "BATCHGEN_ADMIN_KEYS",
        "api.admin_keys",
        '["ops:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]',
        ["ops:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"],
    ),
    (
        "BATCHGEN_NIGHTLY_JOBS_FILE",
        "nightly.jobs_file",
        "/tmp/some/nightly_jobs_file",
        "/tmp/some/nightly_jobs_file",
    ),
    ("BATCHGEN_NIGHTLY_CRON", "nightly.cron", "5 3 * * *", "5 3 * * *"),
    ("BATCHGEN_NIGHTLY_POLL_S", "nightly.poll_s", "0.75", 0.75),
    ("BATCHGEN_FLOWER_USER", "flower.user", "v-flower_user", "v-flower_user"),
    ("BATCHGEN_FLOWER_PASSWORD", "flower.password", "v-flower_password", "v-flower_password"),
]


def _read(settings: Settings, path: str) -> Any:
    concern, field = path.split(".")
    value = getattr(getattr(settings, concern), field)
    return str(value) if isinstance(value, Path) else value


def _unset_field(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Unset every variable of the field at ``path`` (an alias may outrank another)."""
    for name, (concern, field) in env_variables().items():
        if f"{concern}.{field}" == path:
            monkeypatch.delenv(name, raising=False)


def test_no_variable_is_lost_or_added() -> None:
    assert set(env_variables()) == {name for name, *_ in VARIABLES}
    assert len(VARIABLES) == 114


@pytest.mark.parametrize(
    ("name", "path", "raw", "expected"), VARIABLES, ids=[v[0] for v in VARIABLES]
)
def test_each_variable_lands_in_its_field(monkeypatch, name, path, raw, expected) -> None:
    _unset_field(monkeypatch, path)
    assert _read(Settings(), path) != expected  # not the default by chance
    monkeypatch.setenv(name, raw)
    assert _read(Settings(), path) == expected


@pytest.mark.parametrize(
    ("name", "path", "expected"),
    [(n, p, e) for n, p, _, e in VARIABLES if n.startswith("BATCHGEN_")],
    ids=[v[0] for v in VARIABLES if v[0].startswith("BATCHGEN_")],
)
def test_each_flat_keyword_lands_in_its_field(monkeypatch, name, path, expected) -> None:
    """``Settings(budget_window_s=...)``: the variable's name without BATCHGEN_, as the
    tests and a Flask app's BATCHGEN_* config give them."""
    flat = name.removeprefix("BATCHGEN_").lower()
    assert FLAT_NAMES[flat] == tuple(path.split("."))
    value = str(expected) if isinstance(expected, list) else expected
    got = _read(Settings(**{flat: expected if isinstance(expected, list) else value}), path)
    assert got == expected


def test_keywords_win_over_the_environment_and_the_rest_is_read(monkeypatch) -> None:
    monkeypatch.setenv("BATCHGEN_BUDGET_WINDOW_S", "9")
    monkeypatch.setenv("BATCHGEN_BUDGET_GUARD_S", "3")
    settings = Settings(budget_window_s=5)
    assert (settings.budget.window_s, settings.budget.guard_s) == (5.0, 3.0)


def test_unknown_keywords_are_ignored_as_before() -> None:
    assert Settings(bogus=1, BATCHGEN_MAX_ATTEMPTS=3) == Settings()


def test_model_copy_takes_flat_names() -> None:
    settings = Settings(budget_window_s=5)
    copy = settings.model_copy(update={"lean_http": False, "budget_guard_s": 2})
    assert (copy.providers.lean_http, copy.budget.guard_s, copy.budget.window_s) == (False, 2, 5)
    assert settings.providers.lean_http is True and settings.budget.guard_s != 2
    with pytest.raises(ValueError, match="no setting named 'lean_htp'"):
        settings.model_copy(update={"lean_htp": False})


def test_secrets_stay_out_of_repr() -> None:
    settings = Settings(
        metrics_token="t0ken",
        money_webhook_secret="s3cret",
        flower_password="pa55",
        database_url="postgresql://u:pw@h/d",
        admin_keys=["ops:" + "a" * 64],
    )
    shown = repr(settings)
    for secret in ("t0ken", "s3cret", "pa55", ":pw@", "a" * 64):
        assert secret not in shown
    assert "postgresql://u:***@h/d" in shown
