"""A submission's decisions (batchgen.domain.submission), without a database: its
options checked, each item's route per the model's spec, the prompt prefix rule, and
the admission verdicts on counts the store read (issue #38 item 3)."""

from __future__ import annotations

import datetime as dt

import pytest

from batchgen import errors
from batchgen.config import Settings
from batchgen.domain import submission
from batchgen.domain.lifecycle.status import ItemStatus, Priority
from batchgen.domain.scheduling.offload import OffloadMode
from batchgen.domain.scheduling.routes import ItemRoute, RouteMode
from batchgen.domain.submission import BatchFrame, SubmitOptions, Tally
from batchgen.registry import parse_registry
from tests.unit.test_routes import model as routes_model


def model(name: str, provider: str = "openai", extra: str = "") -> str:
    """test_routes' model table, at 100 tokens a second, with ``extra`` lines."""
    table = routes_model(name, provider).replace("tokens_per_min = 1000", "tokens_per_min = 6000")
    return f"{table}\n{extra}"


REGISTRY = parse_registry(
    model("plain")
    + model("offline", extra="offload = true")
    + model("nocache", "anthropic", "prompt_cache = false")
    + model("flexy", extra="max_backlog_tokens = 500")
    + '\n[models."flexy".flex]\nlatency_s = 30\nfallback_s = 120\n'
)
SETTINGS = Settings()
NOW = dt.datetime(2026, 1, 1, 12, tzinfo=dt.UTC)


def line(model_name: str, custom_id: str = "a", **extra: object) -> bytes:
    import json

    request = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model_name, "messages": [{"role": "user", "content": "hi"}]},
        **extra,
    }
    return json.dumps(request).encode() + b"\n"


def rows(
    lines: list[bytes], window_s: float = 3600.0, **options: object
) -> tuple[list[dict], Tally]:
    opts = SubmitOptions(completion_window=window_s, **options)  # type: ignore[arg-type]
    prep = submission.prepare(None, lines, opts, REGISTRY, SETTINGS)
    frame = BatchFrame(
        "batch_x",
        prep.route.value,
        prep.offload.value,
        prep.priority.value,
        NOW,
        NOW + dt.timedelta(seconds=prep.window_s),
    )
    tally = Tally()
    prefixes = submission.prefix_keys(REGISTRY)
    made = list(submission.item_rows(prep.drafts, frame, 7, tally, REGISTRY, {}, prefixes))
    return made, tally


# --- options ---------------------------------------------------------------------------


def test_options_give_the_window_and_refuse_what_cannot_be_stored():
    assert submission.check_options(SubmitOptions(), 86_400) == 86_400.0
    assert submission.check_options(SubmitOptions(completion_window="2h"), 86_400) == 7200.0
    too_long = "k" * (submission.MAX_IDEMPOTENCY_KEY_CHARS + 1)
    with pytest.raises(errors.ValidationFailed, match="longer than 200") as exc:
        submission.check_options(SubmitOptions(idempotency_key=too_long), 60)
    assert exc.value.field == "Idempotency-Key"
    with pytest.raises(errors.ValidationFailed, match="printable"):
        submission.check_options(SubmitOptions(idempotency_key="a\nb"), 60)
    with pytest.raises(errors.ValidationFailed) as exc:
        submission.check_options(SubmitOptions(endpoint="/v1/nope"), 60)
    assert exc.value.field == "endpoint"
    with pytest.raises(errors.ValidationFailed, match="metadata must be an object"):
        submission.check_options(SubmitOptions(metadata=["x"]), 60)  # type: ignore[arg-type]
    with pytest.raises(errors.ValidationFailed, match="metadata: "):
        submission.check_options(SubmitOptions(metadata={"a": "\x00"}), 60)


def test_the_limits_of_a_request_file_are_the_settings():
    limits = submission.submission_limits(SETTINGS)
    assert limits.max_lines == SETTINGS.submit.max_batch_lines
    assert limits.max_bytes == SETTINGS.submit.max_body_bytes
    assert submission.count_lines([line("plain", "a"), line("plain", "b")], REGISTRY, SETTINGS) == 2


# --- routes per spec -------------------------------------------------------------------


def test_routes_follow_the_models_spec():
    assert submission.routes_of(REGISTRY["plain"]).batch is None
    assert submission.routes_of(REGISTRY["plain"]).flex is None
    assert submission.routes_of(REGISTRY["offline"]).batch is not None
    flexy = submission.routes_of(REGISTRY["flexy"])
    assert flexy.flex is not None and flexy.flex.latency_s == 30 and flexy.flex_on_request
    assert not submission.routes_of(REGISTRY["nocache"]).flex_on_request


def test_a_route_the_model_lacks_is_refused_naming_the_line():
    routes = submission.routes_of(REGISTRY["plain"])
    with pytest.raises(errors.ValidationFailed, match="line 3: route 'batch'") as exc:
        submission.check_route(3, RouteMode.BATCH, OffloadMode.ALWAYS, REGISTRY["plain"], routes)
    assert exc.value.field == "route"
    with pytest.raises(errors.ValidationFailed, match="line 1: offload 'always'") as exc:
        submission.check_route(1, RouteMode.AUTO, OffloadMode.ALWAYS, REGISTRY["plain"], routes)
    assert exc.value.field == "offload"
    with pytest.raises(errors.ValidationFailed, match="has no flex route"):
        submission.check_route(2, RouteMode.FLEX, OffloadMode.AUTO, REGISTRY["plain"], routes)
    submission.check_route(2, RouteMode.AUTO, OffloadMode.AUTO, REGISTRY["plain"], routes)


def test_item_rows_carry_the_route_and_add_up_the_online_tokens():
    made, tally = rows([line("plain", "a"), line("offline", "b")], 86_400.0, priority=Priority.BULK)
    by_id = {r["custom_id"]: r for r in made}
    assert by_id["a"]["route"] == ItemRoute.STANDARD.value
    assert by_id["a"]["status"] == ItemStatus.PENDING.value
    assert by_id["b"]["route"] == ItemRoute.BATCH.value  # a day's deadline: offloaded
    assert by_id["b"]["status"] == ItemStatus.OFFLOADED.value
    assert tally.online_tokens["offline"] == 0 and tally.online_tokens["plain"] > 0
    assert tally.admitted["offline"][0] == 1 and tally.admitted["offline"][1] > 0
    assert [r["dispatch_key"] for r in made] == [1, 1]  # keyed per model
    assert all(r["batch_id"] == "batch_x" and r["tenant_id"] == 7 for r in made)


def test_a_route_flex_batch_on_a_model_without_flex_fails_at_its_line():
    with pytest.raises(errors.ValidationFailed, match="line 2: route 'flex'"):
        rows([line("flexy", "a"), line("plain", "b")], route=RouteMode.FLEX)
    made, _ = rows([line("flexy", "a")], route=RouteMode.FLEX)
    assert made[0]["route"] == ItemRoute.FLEX.value


def test_a_shorter_line_timeout_is_the_items_deadline():
    made, _ = rows([line("plain", "a", timeout=60)], 3600.0)
    assert made[0]["deadline_at"] == NOW + dt.timedelta(seconds=60)


# --- prompt prefix keys ------------------------------------------------------------------


def test_cache_min_tokens_per_model():
    of = submission.cache_min_tokens(REGISTRY)
    assert of("plain") == REGISTRY["plain"].prompt_cache_min_tokens
    assert of("nocache") is None


# --- replays and calls --------------------------------------------------------------------


def test_a_replay_is_of_the_same_request_only():
    opts = SubmitOptions(idempotency_key="k")
    prep = submission.prepare(None, [line("plain")], opts, REGISTRY, SETTINGS)
    submission.check_replay(None, "k", "batch_1", prep.drafts, prep.fingerprint)  # before
    prep = submission.prepare(None, [line("plain")], opts, REGISTRY, SETTINGS)
    with pytest.raises(errors.IdempotencyKeyReused, match="'k' was used for a different request"):
        submission.check_replay("0" * 64, "k", "batch_1", prep.drafts, prep.fingerprint)
    prep = submission.prepare(None, [line("plain")], opts, REGISTRY, SETTINGS)
    for _ in prep.drafts:
        pass
    same = prep.fingerprint.hexdigest()
    prep = submission.prepare(None, [line("plain")], opts, REGISTRY, SETTINGS)
    submission.check_replay(same, "k", "batch_1", prep.drafts, prep.fingerprint)


def test_a_call_needs_the_full_store_for_a_key_or_quotas():
    call = SubmitOptions(priority=Priority.CALL)
    assert not submission.call_needs_full_store(call, None, None)
    assert submission.call_needs_full_store(SubmitOptions(), None, None)
    keyed = SubmitOptions(priority=Priority.CALL, idempotency_key="k")
    assert submission.call_needs_full_store(keyed, None, None)
    assert submission.call_needs_full_store(call, 10, None)
    assert submission.call_needs_full_store(call, None, 10)


# --- quota verdicts ----------------------------------------------------------------------


def test_backlog_models_and_bounds():
    tokens = {"b": 5, "a": 3, "offline": 0}
    assert submission.backlog_models(tokens, Priority.BULK) == ["a", "b"]
    assert submission.backlog_models(tokens, Priority.CALL) == []
    assert submission.backlog_bound_tokens(REGISTRY["flexy"], SETTINGS) == 500
    assert submission.backlog_bound_tokens(REGISTRY["plain"], SETTINGS) == int(
        6000 * SETTINGS.submit.max_backlog_min
    )
    with pytest.raises(errors.PayloadTooLarge, match="exceed the model's backlog bound of 500"):
        submission.check_batch_size("flexy", 501, 500)
    submission.check_batch_size("flexy", 500, 500)


def test_an_overloaded_model_says_when_to_retry():
    submission.check_backlog("m", 100, 500, 500, 6000)
    with pytest.raises(errors.Overloaded, match="model m is overloaded: 1100 tokens") as exc:
        submission.check_backlog("m", 100, 1200, 500, 6000)
    assert exc.value.retry_after_s == pytest.approx(7.0)  # 700 tokens at 100/s
    assert submission.drain_time_s(1, 6000) == submission.MIN_RETRY_AFTER_S


def test_tenant_quota_verdicts():
    assert not submission.tenant_has_quotas(None, None)
    assert submission.tenant_has_quotas(1, None) and submission.tenant_has_quotas(None, 1)
    submission.check_pending_items("t", 10, 10, REGISTRY, ["plain"])
    submission.check_pending_items("t", 10**6, None, REGISTRY, ["plain"])
    with pytest.raises(
        errors.OverQuota, match="tenant t would have 12 open items; its limit is 10"
    ) as e:
        submission.check_pending_items("t", 12, 10, REGISTRY, ["plain"])
    assert e.value.retry_after_s == 12  # 2 items at 10 requests/min
    submission.check_daily_tokens("t", 100, 100, NOW)
    with pytest.raises(errors.OverQuota, match="would use 101 tokens today") as e:
        submission.check_daily_tokens("t", 101, 100, NOW)
    assert e.value.retry_after_s == 12 * 3600  # noon to midnight
    assert submission.seconds_until_utc_midnight(NOW) == 12 * 3600


def test_file_quota_is_the_tenants_else_the_settings():
    assert submission.file_quota(None, None, SETTINGS) == (
        SETTINGS.files.tenant_max_files,
        SETTINGS.files.tenant_max_file_bytes,
    )
    assert submission.file_quota(3, 100, SETTINGS) == (3, 100)
    with pytest.raises(errors.FileQuotaExceeded):
        submission.check_file_quota("t", 1, (3, 10), (3, 1000), None)
