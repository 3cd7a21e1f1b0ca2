"""A synchronous call's ``Idempotency-Key``, over HTTP against a live API process, a
worker and the provider simulator: the same request under a used key replays the
stored answer (no second provider call, no second ledger row), another request is
422, concurrent twins make one provider call, and keys are per tenant."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from batchgen.store import db
from batchgen.store.schema import Tenant, UsageLedger
from tests import http_client
from tests.helpers import make_tenant, sim_config
from tests.invariants import simulator_log

pytestmark = pytest.mark.integration

CHAT = {
    "model": "sim-small",
    "messages": [{"role": "user", "content": "Describe a red chair."}],
    "max_tokens": 30,
}
MESSAGE = {
    "model": "sim-claude",
    "max_tokens": 30,
    "messages": [{"role": "user", "content": "Describe a blue lamp."}],
}


@pytest.fixture(scope="module")
def stack(simulator, module_api_server, module_workers) -> str:
    """One API process and one worker for the module's tests; the API's URL."""
    worker = module_workers(concurrency=2, wait=False)
    base_url = module_api_server()
    worker.wait_ready()
    return base_url


@pytest.fixture
def api(clean_db, simulator, stack: str) -> httpx.Client:
    """A client of the API process; the simulator's log starts empty."""
    http_client.post(f"{simulator.base_url}/_sim/reset", timeout=10).raise_for_status()
    with httpx.Client(base_url=stack, timeout=120) as client:
        yield client


def _post(
    api: httpx.Client, key: str, path: str, body: dict[str, Any], idem: str
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": idem}
    return api.post(path, json=body, headers=headers)


def _provider_calls(simulator: Any) -> int:
    return len(simulator_log(simulator.base_url))


def _ledger_rows(tenant: str) -> int:
    with db.session_scope() as s:
        query = (
            select(func.count())
            .select_from(UsageLedger)
            .join(Tenant, Tenant.id == UsageLedger.tenant_id)
            .where(Tenant.name == tenant)
        )
        return int(s.scalar(query) or 0)


def test_a_chat_call_replays_under_its_key(api: httpx.Client, simulator):
    """The same key and body: the stored answer again, marked replayed, with no second
    provider call or ledger row; the same key with another body: 422 naming it."""
    key = make_tenant("idem-chat")
    first = _post(api, key, "/v1/chat/completions", CHAT, "order-1")
    assert first.status_code == 200, first.text
    assert "Idempotent-Replayed" not in first.headers
    again = _post(api, key, "/v1/chat/completions", CHAT, "order-1")
    assert again.status_code == 200 and again.json() == first.json()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert (_provider_calls(simulator), _ledger_rows("idem-chat")) == (1, 1)

    other = _post(api, key, "/v1/chat/completions", {**CHAT, "max_tokens": 31}, "order-1")
    assert other.status_code == 422, other.text
    error = other.json()["error"]
    assert error["code"] == "idempotency_key_reused" and "order-1" in error["message"]
    assert (_provider_calls(simulator), _ledger_rows("idem-chat")) == (1, 1)

    # The key is the tenant's: another tenant's same key is a call of its own.
    stranger = make_tenant("idem-other")
    theirs = _post(api, stranger, "/v1/chat/completions", CHAT, "order-1")
    assert theirs.status_code == 200 and "Idempotent-Replayed" not in theirs.headers
    assert theirs.json()["id"] != first.json()["id"]
    assert (_provider_calls(simulator), _ledger_rows("idem-other")) == (2, 1)


def _sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    return [
        json.loads(line[len("data: ") :])
        for line in response.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_a_message_call_replays_plain_and_as_a_stream(api: httpx.Client, simulator):
    """``/v1/messages`` replays the same way; a streamed request under the key gets the
    stored whole answer as the SDK's events (its text and stop reason), not a new call."""
    key = make_tenant("idem-messages")
    first = _post(api, key, "/v1/messages", MESSAGE, "msg-1")
    assert first.status_code == 200, first.text
    again = _post(api, key, "/v1/messages", MESSAGE, "msg-1")
    assert again.status_code == 200 and again.json() == first.json()
    assert again.headers["Idempotent-Replayed"] == "true"

    streamed = _post(api, key, "/v1/messages", {**MESSAGE, "stream": True}, "msg-1")
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers["Idempotent-Replayed"] == "true"
    events = _sse_events(streamed)
    text = "".join(
        e["delta"].get("text", "") for e in events if e.get("type") == "content_block_delta"
    )
    assert text == first.json()["content"][0]["text"]
    assert (_provider_calls(simulator), _ledger_rows("idem-messages")) == (1, 1)


def test_concurrent_calls_with_one_key_make_one_provider_call(api: httpx.Client, simulator):
    """Calls racing with one key: one provider call, one ledger row, one answer for all."""
    key = make_tenant("idem-race")
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda _: _post(api, key, "/v1/chat/completions", CHAT, "race-1"), range(4))
        )
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert len({json.dumps(a.json(), sort_keys=True) for a in answers}) == 1
    assert sum(a.headers.get("Idempotent-Replayed") == "true" for a in answers) == 3
    assert (_provider_calls(simulator), _ledger_rows("idem-race")) == (1, 1)


def test_embeddings_and_responses_replay_too(api: httpx.Client, simulator):
    key = make_tenant("idem-more")
    embed = {"model": "text-embedding-3-small", "input": ["a chair"]}
    asked = {"model": "sim-small", "input": "Describe a chair.", "max_output_tokens": 30}
    for path, body in (("/v1/embeddings", embed), ("/v1/responses", asked)):
        first = _post(api, key, path, body, f"k{path}")
        assert first.status_code == 200, first.text
        again = _post(api, key, path, body, f"k{path}")
        assert again.json() == first.json() and again.headers["Idempotent-Replayed"] == "true"
    assert (_provider_calls(simulator), _ledger_rows("idem-more")) == (2, 2)


def test_a_replay_is_answered_while_new_calls_are_refused(api: httpx.Client, simulator):
    """The fail-fast rule refuses a call that cannot start in time; a replay starts
    nothing, so it gets its stored answer even then (an SDK retrying after a 503 with
    its key is answered)."""
    from batchgen.limits import redis_keys as keys
    from batchgen.limits.backend import get_redis
    from batchgen.registry import get_registry

    key = make_tenant("idem-busy")
    first = _post(api, key, "/v1/chat/completions", CHAT, "busy-1")
    assert first.status_code == 200, first.text
    cooldowns = [keys.cooldown(d.budget_key) for d in get_registry()["sim-small"].deployments]
    try:
        for name in cooldowns:  # the provider asked for a pause longer than any deadline
            get_redis().set(name, "1", px=3_600_000)
        refused = _post(api, key, "/v1/chat/completions", CHAT, "busy-2")
        assert refused.status_code == 503, refused.text
        again = _post(api, key, "/v1/chat/completions", CHAT, "busy-1")
        assert again.status_code == 200 and again.json() == first.json()
        assert again.headers["Idempotent-Replayed"] == "true"
    finally:
        get_redis().delete(*cooldowns)
    assert (_provider_calls(simulator), _ledger_rows("idem-busy")) == (1, 1)


def test_a_call_that_ran_out_of_time_leaves_its_key_to_a_retry(api: httpx.Client, simulator):
    """A call that ended without an answer for no fault of the request (here its
    deadline, as a client's retry after a time-out meets it): the retry under the same
    key is a new call, and its answer is what the key replays from then on."""
    key = make_tenant("idem-retry")
    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "retry-1"}
    headers["X-Request-Timeout"] = "3"
    sim_config(simulator.base_url, latency_base_ms=20_000)
    try:
        late = api.post("/v1/chat/completions", json=CHAT, headers=headers)
    finally:
        sim_config(simulator.base_url, latency_base_ms=50)
    assert late.status_code == 504, late.text
    retried = api.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert retried.status_code == 200, retried.text
    assert "Idempotent-Replayed" not in retried.headers
    again = api.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert again.status_code == 200 and again.headers.get("Idempotent-Replayed") == "true"
    assert again.json() == retried.json()
