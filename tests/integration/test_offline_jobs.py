"""The providers' batch APIs through batchgen's adapters (app/providers/offline.py),
against the simulator's: a job is created, found again by its tag, read while it
runs and once it ended, its rows normalised, and cancelled."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from batchgen.domain.formats.message_batches import to_chat_line
from batchgen.providers.offline import (
    JobStatus,
    OfflineRow,
    RowKind,
    custom_id,
    is_native,
    item_of,
    jobs_for,
)
from batchgen.registry import get_registry
from tests import http_client
from tests.helpers import chat_line, sim_config
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
MODELS = ["sim-small", "sim-claude"]


@pytest.fixture
def sim(simulator) -> Iterator[Any]:
    httpx_reset(simulator.base_url)
    sim_config(simulator.base_url, batch_turnaround_s=0.5, batch_row_error_rate=0.0)
    yield simulator
    sim_config(
        simulator.base_url, batch_turnaround_s=2.0, batch_row_error_rate=0.0, batch_expire=False
    )


def httpx_reset(base_url: str) -> None:
    http_client.post(f"{base_url}/_sim/reset", timeout=10).raise_for_status()


def _spec(sim: Any, model: str) -> Any:
    """The registry's model, pointed at this module's simulator (the registry may have
    been read by an earlier test, with another simulator's address)."""
    spec = get_registry()[model]
    suffix = "/v1" if spec.base_url.endswith("/v1") else ""
    return spec.model_copy(update={"base_url": f"{sim.base_url}{suffix}"})


def _rows(n: int) -> list[OfflineRow]:
    return [OfflineRow(100 + i, chat_line(f"r{i}")["body"], 30) for i in range(n)]


def _ended(jobs: Any, spec: Any, job_id: str) -> Any:
    return wait_until(
        lambda: (state := jobs.state(spec, job_id)).status is not JobStatus.RUNNING and state,
        20,
        f"job {job_id} to end",
    )


def test_custom_ids_name_the_job_and_the_item():
    assert item_of(custom_id("job-1", 42), "job-1") == 42
    assert item_of(custom_id("job-1", 42), "job-2") is None
    assert item_of("not-ours", "job-1") is None
    native = custom_id("job-1", 42, native=True)
    assert item_of(native, "job-1") == 42 and is_native(native)
    assert not is_native(custom_id("job-1", 42))


def test_a_messages_request_is_offloaded_whole_and_its_message_kept(sim):
    """A line made from a Messages request goes to Anthropic's batch API with its own
    parameters (list system, cache_control, tools, images), and its row is the Message."""
    params = {
        "model": "sim-claude",
        "max_tokens": 30,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "lookup", "input_schema": {"type": "object"}}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
    }
    body = to_chat_line(0, {"custom_id": "m", "params": params})["body"]
    spec = _spec(sim, "sim-claude")
    jobs = jobs_for(spec)
    job_id = jobs.create(spec, [OfflineRow(7, body, 30)], "tag-native")
    sent = http_client.get(f"{sim.base_url}/_sim/last_request", params={"api": "anthropic_batch"})
    [request] = sent.json()["requests"]
    assert request["params"] == {**params, "model": spec.name}
    _ended(jobs, spec, job_id)
    assert jobs.find(spec, "tag-native") == job_id
    [row] = jobs.results(spec, job_id, "tag-native")
    assert row.item_id == 7 and row.kind is RowKind.SUCCEEDED and row.response is not None
    message = row.response.body
    # Answered as the online endpoint answers the same request: a call of its one tool.
    assert message["type"] == "message" and message["stop_reason"] == "tool_use"
    assert [(b["type"], b["name"]) for b in message["content"]] == [("tool_use", "lookup")]
    assert row.response.completion_tokens == message["usage"]["output_tokens"] > 0


def test_an_anthropic_row_of_a_shared_prefix_marks_it_for_the_cache(sim):
    """A row whose prefix is shared (``cache_prefix``) carries an ephemeral breakpoint on
    its system prompt; one that shares nothing, or marks its own, is sent as it is."""
    shared = chat_line("s", model="sim-claude")["body"]
    shared["messages"].insert(0, {"role": "system", "content": "Brand guidelines."})
    own = {"type": "text", "text": "Mine.", "cache_control": {"type": "ephemeral"}}
    native = {"model": "sim-claude", "max_tokens": 30, "system": [own]}
    native["messages"] = [{"role": "user", "content": "hi"}]
    mine = to_chat_line(0, {"custom_id": "m", "params": native})["body"]
    rows = [
        OfflineRow(1, shared, 30, cache_prefix=True),
        OfflineRow(2, shared, 30),
        OfflineRow(3, mine, 30, cache_prefix=True),
    ]
    spec = _spec(sim, "sim-claude")
    jobs_for(spec).create(spec, rows, "tag-cache")
    sent = http_client.get(f"{sim.base_url}/_sim/last_request", params={"api": "anthropic_batch"})
    marked, plain, own_row = (r["params"] for r in sent.json()["requests"])
    breakpoint = {"type": "ephemeral"}
    assert marked["system"] == [
        {"type": "text", "text": "Brand guidelines.", "cache_control": breakpoint}
    ]
    assert plain["system"] == "Brand guidelines."
    assert own_row["system"] == [own]


@pytest.mark.parametrize("model", MODELS)
def test_a_job_is_created_found_and_read(sim, model):
    spec = _spec(sim, model)
    jobs = jobs_for(spec)
    job_id = jobs.create(spec, _rows(4), "tag-a")
    running = jobs.state(spec, job_id)
    assert running.status is JobStatus.RUNNING and running.total == 4
    ended = _ended(jobs, spec, job_id)
    assert (ended.status, ended.succeeded) == (JobStatus.ENDED, 4)
    assert jobs.find(spec, "tag-a") == job_id and jobs.find(spec, "tag-b") is None
    rows = sorted(jobs.results(spec, job_id, "tag-a"), key=lambda r: r.item_id)
    assert [r.item_id for r in rows] == [100, 101, 102, 103]
    for row in rows:
        assert row.kind is RowKind.SUCCEEDED and row.response is not None
        assert row.response.text and row.response.prompt_tokens > 0
        assert row.response.body["object"] == "chat.completion"
    assert list(jobs.results(spec, job_id, "tag-other")) == []


@pytest.mark.parametrize("model", MODELS)
def test_errored_expired_and_cancelled_rows(sim, model):
    spec = _spec(sim, model)
    jobs = jobs_for(spec)
    sim_config(sim.base_url, batch_row_error_rate=0.5)
    mixed = jobs.create(spec, _rows(20), "tag-m")
    _ended(jobs, spec, mixed)
    kinds = [r.kind for r in jobs.results(spec, mixed, "tag-m")]
    assert len(kinds) == 20 and 0 < kinds.count(RowKind.ERRORED) < 20
    assert set(kinds) == {RowKind.SUCCEEDED, RowKind.ERRORED}

    sim_config(sim.base_url, batch_row_error_rate=0.0, batch_expire=True)
    expired = jobs.create(spec, _rows(3), "tag-e")
    _ended(jobs, spec, expired)
    assert {r.kind for r in jobs.results(spec, expired, "tag-e")} == {RowKind.EXPIRED}

    sim_config(sim.base_url, batch_expire=False, batch_turnaround_s=30)
    running = jobs.create(spec, _rows(3), "tag-c")
    jobs.cancel(spec, running)
    assert jobs.state(spec, running).status is JobStatus.ENDED
    assert {r.kind for r in jobs.results(spec, running, "tag-c")} == {RowKind.CANCELLED}


def test_an_openai_job_refused_as_a_whole(sim):
    spec = _spec(sim, "sim-small")
    jobs = jobs_for(spec)
    sim_config(sim.base_url, batch_enqueued_tokens_limit=10)
    try:
        state = jobs.state(spec, jobs.create(spec, _rows(2), "tag-f"))
    finally:
        sim_config(sim.base_url, batch_enqueued_tokens_limit=None)
    assert (state.status, state.reason) == (JobStatus.FAILED, "token_limit_exceeded")
