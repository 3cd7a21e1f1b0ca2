"""The simulator serves the providers' own batch APIs, driven here by the official SDKs:
turnaround, per-row errors, expiry, job failure, the enqueued-token limit and cancel."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.helpers import anthropic_batch_ended, chat_line, openai_batch_in, sim_config
from tests.waiting import hold

pytestmark = pytest.mark.integration
DEFAULTS = {
    "batch_turnaround_s": 0.5,
    "batch_row_error_rate": 0.0,
    "batch_expire": False,
    "batch_fail": False,
    "batch_enqueued_tokens_limit": None,
    "batch_create_delay_s": 0.0,
}


@pytest.fixture
def sim(simulator) -> Iterator[Any]:
    sim_config(simulator.base_url, **DEFAULTS)
    yield simulator
    sim_config(simulator.base_url, **{**DEFAULTS, "batch_turnaround_s": 2.0})


def _oai(sim: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim.base_url}/v1", api_key="sim-batches", max_retries=0)


def _job(client: openai.OpenAI, n: int, max_tokens: int = 30) -> Any:
    lines = [chat_line(f"r-{i}", max_tokens=max_tokens) for i in range(n)]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    upload = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def _ended(client: openai.OpenAI, batch_id: str) -> Any:
    return openai_batch_in(client, batch_id, timeout_s=20)


def _rows(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_an_openai_job_answers_every_row_after_its_turnaround(sim):
    client = _oai(sim)
    job = _job(client, 5)
    assert job.status == "in_progress" and job.output_file_id is None
    done = _ended(client, job.id)
    assert done.status == "completed" and done.completed_at >= done.created_at
    assert (done.request_counts.total, done.request_counts.completed) == (5, 5)
    rows = _rows(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in rows) == [f"r-{i}" for i in range(5)]
    online = client.chat.completions.create(**chat_line("r-0", max_tokens=30)["body"])
    first = next(r for r in rows if r["custom_id"] == "r-0")["response"]["body"]
    assert first["choices"][0]["message"]["content"] == online.choices[0].message.content
    assert first["usage"]["prompt_tokens"] == online.usage.prompt_tokens  # type: ignore[union-attr]
    assert done.error_file_id is None


def test_row_errors_expiry_and_cancel(sim):
    client = _oai(sim)
    sim_config(sim.base_url, batch_row_error_rate=0.5)
    mixed = _ended(client, _job(client, 20).id)
    errors = _rows(client, mixed.error_file_id)
    assert 0 < len(errors) < 20 and mixed.request_counts.failed == len(errors)
    assert {r["response"]["status_code"] for r in errors} == {500}
    assert len(_rows(client, mixed.output_file_id)) + len(errors) == 20

    sim_config(sim.base_url, batch_row_error_rate=0.0, batch_expire=True)
    expired = _ended(client, _job(client, 3).id)
    assert expired.status == "expired" and expired.output_file_id is None
    assert {r["error"]["code"] for r in _rows(client, expired.error_file_id)} == {"batch_expired"}

    sim_config(sim.base_url, batch_expire=False, batch_turnaround_s=30)
    running = _job(client, 3)
    cancelled = client.batches.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    assert {r["error"]["code"] for r in _rows(client, cancelled.error_file_id)} == {
        "batch_cancelled"
    }
    listed = [b.id for b in client.batches.list(limit=2)]
    assert listed[:3] == [running.id, expired.id, mixed.id]


def test_the_enqueued_token_limit_and_a_failing_job(sim):
    client = _oai(sim)
    sim_config(sim.base_url, batch_turnaround_s=30, batch_enqueued_tokens_limit=3000)
    first = _job(client, 10, max_tokens=200)  # about 2 100 tokens enqueued
    assert first.status == "in_progress"
    second = _job(client, 10, max_tokens=200)
    assert second.status == "failed" and second.errors is not None
    assert second.errors.data[0].code == "token_limit_exceeded"  # type: ignore[index]
    client.batches.cancel(first.id)  # its tokens leave the queue
    assert _job(client, 10, max_tokens=200).status == "in_progress"

    claude = anthropic.Anthropic(base_url=sim.base_url, api_key="sim-batches-a", max_retries=0)
    request = {
        "custom_id": "a",
        "params": {
            "model": "sim-claude",
            "max_tokens": 1000,
            "messages": [{"role": "user", "content": "x"}],
        },
    }
    claude.messages.batches.create(requests=[request, {**request, "custom_id": "b"}])  # type: ignore[list-item]
    with pytest.raises(anthropic.RateLimitError):
        claude.messages.batches.create(requests=[{**request, "custom_id": "c"}])  # type: ignore[list-item]
    sim_config(sim.base_url, batch_enqueued_tokens_limit=None, batch_fail=True)
    assert _job(client, 1).status == "failed"


def test_an_anthropic_job_and_its_cancel(sim):
    claude = anthropic.Anthropic(base_url=sim.base_url, api_key="sim-batches-b", max_retries=0)
    requests = [
        {
            "custom_id": f"m-{i}",
            "params": {
                "model": "sim-claude",
                "max_tokens": 30,
                "system": "Be brief.",
                "messages": [{"role": "user", "content": f"Describe {i}."}],
            },
        }
        for i in range(4)
    ]
    job = claude.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert job.processing_status == "in_progress" and job.request_counts.processing == 4
    job = anthropic_batch_ended(claude, job.id, 20)
    assert job.request_counts.succeeded == 4 and job.results_url
    results = list(claude.messages.batches.results(job.id))
    assert sorted(r.custom_id for r in results) == [f"m-{i}" for i in range(4)]
    assert all(r.result.type == "succeeded" and r.result.message.content for r in results)  # type: ignore[union-attr]

    sim_config(sim.base_url, batch_turnaround_s=30)
    slow = claude.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    ended = claude.messages.batches.cancel(slow.id)
    assert ended.processing_status == "ended" and ended.request_counts.canceled == 4
    assert {r.result.type for r in claude.messages.batches.results(slow.id)} == {"canceled"}
    assert [b.id for b in claude.messages.batches.list(limit=1)][:2] == [slow.id, job.id]


def test_a_job_cancelled_midway_keeps_the_rows_it_finished(sim):
    # Four rows over 4 s: one finishes every second.
    sim_config(sim.base_url, batch_turnaround_s=4.0)
    client = _oai(sim)
    job = _job(client, 4)
    hold(2.3, "two of the four rows finish: one a second")
    client.batches.cancel(job.id)
    ended = _ended(client, job.id)
    assert ended.status == "cancelled"
    assert ended.request_counts is not None and ended.request_counts.completed == 2
    done = sorted(r["custom_id"] for r in _rows(client, ended.output_file_id))
    assert done == ["r-0", "r-1"]
    left = _rows(client, ended.error_file_id)
    assert sorted(r["error"]["code"] for r in left) == ["batch_cancelled"] * 2

    claude = anthropic.Anthropic(base_url=sim.base_url, api_key="sim-batches", max_retries=0)
    request = {
        "params": {
            "model": "sim-claude",
            "max_tokens": 20,
            "messages": [{"role": "user", "content": "hi"}],
        }
    }
    created = claude.messages.batches.create(
        requests=[{"custom_id": f"m-{i}", **request} for i in range(4)]  # type: ignore[misc]
    )
    hold(2.3, "two of the four rows finish: one a second")
    cancelled = claude.messages.batches.cancel(created.id)
    assert cancelled.processing_status == "ended"
    assert (cancelled.request_counts.succeeded, cancelled.request_counts.canceled) == (2, 2)
    kinds = {e.custom_id: e.result.type for e in claude.messages.batches.results(created.id)}
    assert kinds == {"m-0": "succeeded", "m-1": "succeeded", "m-2": "canceled", "m-3": "canceled"}


def test_a_create_can_be_answered_after_the_job_exists(sim):
    sim_config(sim.base_url, batch_create_delay_s=1.0)
    client = _oai(sim)
    before = {b.id for b in client.batches.list(limit=100).data}
    started = time.monotonic()
    job = _job(client, 1)
    assert time.monotonic() - started >= 1.0
    assert job.id not in before and job.id in {b.id for b in client.batches.list(limit=100).data}


LONG_SYSTEM = " ".join(f"Rule {i}: write plainly about the product." for i in range(300))


def test_a_jobs_rows_read_the_prompt_cache_as_online_calls_do(sim):
    """Rows sharing a prefix read it from the cache after the first (OpenAI: by itself;
    Anthropic: at a breakpoint, the first row writing it), so the batch discount stacks
    with the cache's; results read twice say the same."""
    client = _oai(sim)
    lines = [
        chat_line(f"c-{i}", max_tokens=20)
        | {
            "body": {
                "model": "sim-small",
                "max_tokens": 20,
                "messages": [
                    {"role": "system", "content": LONG_SYSTEM},
                    {"role": "user", "content": f"Describe product {i}."},
                ],
            }
        }
        for i in range(3)
    ]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    upload = client.files.create(file=("in.jsonl", data), purpose="batch")
    job = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    ended = _ended(client, job.id)
    rows = sorted(_rows(client, ended.output_file_id), key=lambda r: r["custom_id"])
    cached = [
        r["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for r in rows
    ]
    assert cached[0] == 0 and cached[1] >= 1024 and cached[2] == cached[1]

    claude = anthropic.Anthropic(base_url=sim.base_url, api_key="sim-batches-c", max_retries=0)
    system = [{"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral"}}]
    requests = [
        {
            "custom_id": f"m-{i}",
            "params": {
                "model": "sim-claude",
                "max_tokens": 20,
                "system": system,
                "messages": [{"role": "user", "content": f"Describe {i}."}],
            },
        }
        for i in range(3)
    ]
    batch = claude.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    anthropic_batch_ended(claude, batch.id, 20)

    def usage() -> list[tuple[int, int]]:
        out = sorted(claude.messages.batches.results(batch.id), key=lambda r: r.custom_id)
        return [
            (
                r.result.message.usage.cache_creation_input_tokens or 0,  # type: ignore[union-attr]
                r.result.message.usage.cache_read_input_tokens or 0,
            )  # type: ignore[union-attr]
            for r in out
        ]

    first = usage()
    written, read = first[0][0], first[1][1]
    assert written >= 1024 and first[0][1] == 0
    assert first[1:] == [(0, written), (0, written)] and read == written
    assert usage() == first  # made once
