"""A pack's scripts in one call (``backend.scripts_at_once``): each entry reads its keys
and arguments as when called alone, so the replies and the budgets it leaves are those
of one call each; an entry's error is raised after the others have run."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from redis._parsers.encoders import Encoder

from batchgen.config import Settings
from batchgen.domain.scheduling.rate_limits import RateLimitState
from batchgen.limits.backend import each_payload, get_redis, scripts_at_once
from batchgen.limits.budget import Budget, SettleOps
from tests.registries import model_spec

pytestmark = pytest.mark.integration

NOW_S = 1_000_000.0


def _entries(tag: str, tenant_id: int) -> list[dict[str, Any]]:
    """Granted, granted on a tenant's budget, denied for tokens, denied for the tenant,
    never (above the limit), and an id granted before (adopted)."""
    return [
        {"reservation_id": f"{tag}:1", "prompt_tokens": 200, "rest_tokens": 100},
        {
            "reservation_id": f"{tag}:2",
            "prompt_tokens": 150,
            "rest_tokens": 150,
            "tenant_id": tenant_id,
            "tenant_tokens_per_min": 500,
        },
        {"reservation_id": f"{tag}:3", "prompt_tokens": 300, "rest_tokens": 200},
        {
            "reservation_id": f"{tag}:4",
            "prompt_tokens": 200,
            "rest_tokens": 100,
            "tenant_id": tenant_id,
            "tenant_tokens_per_min": 500,
        },
        {"reservation_id": f"{tag}:5", "prompt_tokens": 2000, "rest_tokens": 1},
        {"reservation_id": f"{tag}:1", "prompt_tokens": 200, "rest_tokens": 100},
        {"reservation_id": f"{tag}:6", "prompt_tokens": 10, "rest_tokens": 0.0},
    ]


def test_a_packs_entries_and_settlements_in_one_call_match_one_call_each(clean_db):
    client = get_redis()
    budget = Budget(client, Settings(budget_window_s=60.0, budget_guard_s=1.0))
    alone, together = model_spec(key="alone"), model_spec(key="together")
    entered_alone = [budget.enter(alone, **{**e, "now_s": NOW_S}) for e in _entries("a", 7)]
    entered_together = budget.enter_many(
        together, [{**e, "now_s": NOW_S} for e in _entries("t", 8)]
    )
    assert entered_together == entered_alone
    assert [g.granted for g in entered_alone] == [True, True, False, False, False, True, True]
    assert entered_alone[3].reason == "tenant" and entered_alone[4].never
    used = budget.used(alone, now_s=NOW_S)
    assert budget.used(together, now_s=NOW_S) == used and used[1] == 3

    headers = RateLimitState(remaining_tokens=100, remaining_requests=5, received_s=NOW_S)

    def ops(tenant_id: int) -> list[SettleOps]:
        return [
            SettleOps(
                action="reconcile",
                charged_tokens=120,
                usage_prompt_tokens=190,
                prompt_tokens_est=200,
                rate_limits=headers,
            ),
            SettleOps(action="release", tenant_id=tenant_id),
            SettleOps(action="reconcile", charged_tokens=5, cooldown_s=2.0),
        ]

    settled_alone = [
        budget.settle(alone, f"a:{n}", o, now_s=NOW_S + 1, age_s=0.0)
        for n, o in zip((1, 2, 6), ops(7), strict=True)
    ]
    settled_together = [
        budget._settled_of(reply)
        for reply in scripts_at_once(
            client,
            "budget_settle",
            [
                budget._settle_call(together, f"t:{n}", o, now_s=NOW_S + 1, age_s=0.0)
                for n, o in zip((1, 2, 6), ops(8), strict=True)
            ],
        )
    ]
    assert settled_together == settled_alone
    assert settled_alone[0].delta != 0 and settled_alone[1].delta < 0
    assert budget.used(together, now_s=NOW_S + 1) == budget.used(alone, now_s=NOW_S + 1)


def test_an_entrys_error_is_raised_after_the_others_have_run(clean_db):
    client = get_redis()
    first, last = "bg:test-at-once:first", "bg:test-at-once:last"
    client.set(first, "token")
    client.set(last, "token")
    calls = [([first], ["token"]), ([], ["no key: GET nil fails"]), ([last], ["token"])]
    with pytest.raises(redis.ResponseError):
        scripts_at_once(client, "beat_unlock", calls)
    assert not client.exists(first) and not client.exists(last)
    assert scripts_at_once(client, "beat_unlock", [([first], ["token"])]) == [0]
    assert scripts_at_once(client, "beat_unlock", []) == []


def test_the_payload_names_each_key_once_and_each_argument_as_redis_py_sends_it():
    encoder = Encoder("utf-8", "strict", False)
    args = ["é", 3, -7, 0.1, 2.5e-7, 1e22, 123456789.123456789, b"raw"]
    keys_, payload = each_payload([(["a", "b"], args), (["b", "c", "a"], [])])
    assert keys_ == ["a", "b", "c"]
    import json

    entries = json.loads(payload)
    assert entries[0][0] == [1, 2] and entries[1] == [[2, 3, 1], []]
    assert [a.encode() for a in entries[0][1]] == [encoder.encode(a) for a in args]
    for bad in (True, None, object()):
        with pytest.raises(redis.DataError):
            each_payload([([], [bad])])
