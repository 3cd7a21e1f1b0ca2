"""The official SDKs, unchanged, against a live batchgen API process (``batchgen api``).

Only ``base_url`` and the key change: what the SDK sends and parses is what a team's
code already does against the provider.
"""

from __future__ import annotations

import json
import socket
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import openai
import psutil
import pytest
from anthropic.types import Message, ModelInfo
from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse
from openai.types import FileObject, Model
from openai.types.chat import ChatCompletion
from sqlalchemy import func, select

from batchgen.domain.lifecycle.status import CALL_RANK
from batchgen.registry import get_registry
from batchgen.store import db
from batchgen.store.schema import Item, Result, Tenant, UsageLedger
from tests.helpers import (
    anthropic_batch_ended,
    chat_line,
    make_tenant,
    message_request,
    openai_batch_in,
    sim_config,
    sim_in_flight,
)
from tests.invariants import cut_calls, simulator_log, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(simulator, module_api_server, module_workers) -> str:
    """One API process and one worker draining into the simulator for the module's
    tests (each test still starts on empty tables); the API's URL."""
    worker = module_workers(concurrency=8, wait=False)  # starts while the API process does
    base_url = module_api_server()
    worker.wait_ready()
    return base_url


@pytest.fixture
def oai(clean_db, stack: str) -> Iterator[openai.OpenAI]:
    base_url = stack
    key = make_tenant("sdk")
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0) as client:
        yield client


def _no_extra_fields(obj: openai.BaseModel | anthropic.BaseModel) -> bool:
    return not (obj.model_extra or {})


def test_models_list_and_retrieve(oai: openai.OpenAI):
    """``client.models.list()`` pages through the registry's models as the SDK's
    ``Model`` objects, ``retrieve`` reads one, and an unknown one is ``NotFoundError``."""
    models = list(oai.models.list())  # the SDK's auto-pagination
    assert [m.id for m in models] == [spec.name for spec in get_registry()]
    assert all(isinstance(m, Model) and _no_extra_fields(m) for m in models)
    assert {m.owned_by for m in models} <= {"openai", "anthropic"}
    assert all(m.object == "model" and m.created > 0 for m in models)
    one = oai.models.retrieve("sim-small")
    assert (one.id, one.owned_by) == ("sim-small", "openai") and _no_extra_fields(one)
    with pytest.raises(openai.NotFoundError) as raised:
        oai.models.retrieve("no-such-model")
    assert raised.value.code == "not_found"
    assert raised.value.body == {  # OpenAI's shape: the error object, our code in it
        "code": "not_found",
        "message": "unknown model 'no-such-model'; available models: "
        "sim-claude, sim-large, sim-small, text-embedding-3-large, text-embedding-3-small",
        "param": "model",
    }


def test_a_wrong_key_is_the_sdk_authentication_error(oai: openai.OpenAI):
    stranger = oai.with_options(api_key="bg-not-a-key")
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()


@pytest.fixture
def claude(clean_db, stack: str) -> Iterator[anthropic.Anthropic]:
    base_url = stack
    key = make_tenant("sdk-anthropic")
    with anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0) as client:
        yield client


def test_anthropic_models_list_pages_and_retrieve(claude: anthropic.Anthropic):
    """The Anthropic SDK (``x-api-key``, ``anthropic-version``) gets its own shape from
    the same routes: ``ModelInfo`` objects, paged by id with ``limit`` and cursors."""
    names = [spec.name for spec in get_registry()]
    assert len(names) >= 3  # enough for a page of 2 to have a second page
    page = claude.models.list(limit=2)
    assert [m.id for m in page.data] == names[:2] and page.has_more
    everything = list(claude.models.list(limit=2))  # the SDK follows after_id
    assert [m.id for m in everything] == names
    assert all(isinstance(m, ModelInfo) and _no_extra_fields(m) for m in everything)
    spec = get_registry()[names[0]]
    first = claude.models.retrieve(names[0])
    assert (first.max_input_tokens, first.max_tokens) == (
        spec.context_window,
        spec.max_output_tokens,
    )
    assert first.lifecycle == "active" and first.created_at.year >= 2020
    before = claude.models.list(before_id=names[2], limit=1)
    assert [m.id for m in before.data] == [names[1]] and before.has_more
    with pytest.raises(anthropic.NotFoundError):
        claude.models.retrieve("no-such-model")
    with pytest.raises(anthropic.BadRequestError):
        claude.models.list(after_id="no-such-model")


def test_anthropic_errors_come_in_its_shape(claude: anthropic.Anthropic):
    """An error answered to the Anthropic SDK is ``{"type": "error", "error": {type,
    message}}`` with our code beside them; the SDK raises its typed exception."""
    with pytest.raises(anthropic.NotFoundError) as raised:
        claude.models.retrieve("no-such-model")
    body = raised.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error" and body["error"]["code"] == "not_found"
    assert "no-such-model" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.models.list(limit=0)
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError) as denied:
        claude.with_options(api_key="bg-not-a-key").models.list()
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


# -- the OpenAI Files + Batches flow, as the SDK runs it ---------------------------------

BATCH_FIELDS = set(openai.types.Batch.model_fields)
# Our own fields of the batch object, kept by the SDK as extras (documented in docs/http-api.md).
BATCH_EXTRAS = {"priority", "offload", "route", "cancel_requested_at", "finished_at"}


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _strict_dump(model: openai.BaseModel) -> dict[str, Any]:
    """The SDK's own dump, with any serializer warning (a value its type does not
    hold) raised as an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return model.model_dump()


@pytest.fixture
def oai_run(clean_db, stack: str) -> Iterator[openai.OpenAI]:
    """The SDK against an API process, with a worker draining into the simulator."""
    base_url = stack
    key = make_tenant("sdk-files")
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0) as client:
        yield client


@pytest.mark.slow
def test_openai_files_and_batches_flow(oai_run: openai.OpenAI):
    """files.create → batches.create → poll retrieve → files.content of the output and
    error files → batches.list with auto-pagination, every object the SDK's type."""
    lines = [chat_line(f"ok-{i}") for i in range(6)]
    lines.append({**chat_line("too-late"), "timeout": "1ms"})  # expires before it runs
    upload = oai_run.files.create(file=("requests.jsonl", _jsonl(lines)), purpose="batch")
    assert isinstance(upload, FileObject) and _no_extra_fields(upload)
    assert (upload.purpose, upload.status, upload.bytes) == (
        "batch",
        "processed",
        len(_jsonl(lines)),
    )
    assert upload.filename == "requests.jsonl" and upload.expires_at > upload.created_at
    assert oai_run.files.retrieve(upload.id).id == upload.id
    assert oai_run.files.content(upload.id).content == _jsonl(lines)

    batch = oai_run.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "sdk"},
    )
    assert isinstance(batch, openai.types.Batch)
    assert set(_strict_dump(batch)) == BATCH_FIELDS | BATCH_EXTRAS
    assert batch.model_fields_set == BATCH_FIELDS  # every field of its type was sent
    assert set(batch.model_extra or {}) == BATCH_EXTRAS
    assert (batch.input_file_id, batch.completion_window, batch.metadata) == (
        upload.id,
        "24h",
        {"job": "sdk"},
    )
    assert batch.status == "in_progress" and batch.in_progress_at == batch.created_at
    assert batch.output_file_id is None and batch.error_file_id is None

    done = openai_batch_in(oai_run, batch.id)
    _strict_dump(done)
    assert done.status == "completed" and done.completed_at >= done.created_at
    assert (done.request_counts.total, done.request_counts.completed) == (7, 6)
    assert done.output_file_id and done.error_file_id

    output = [json.loads(x) for x in oai_run.files.content(done.output_file_id).text.splitlines()]
    assert [row["custom_id"] for row in output] == [f"ok-{i}" for i in range(6)]
    for row in output:
        assert row["error"] is None and row["response"]["status_code"] == 200
        completion = ChatCompletion.model_validate(row["response"]["body"])
        assert completion.choices[0].message.content
    errors = [json.loads(x) for x in oai_run.files.content(done.error_file_id).text.splitlines()]
    assert [(r["custom_id"], r["error"]["code"], r["response"]) for r in errors] == [
        ("too-late", "batch_expired", None)
    ]
    out_file = oai_run.files.retrieve(done.output_file_id)
    assert out_file.purpose == "batch_output" and _no_extra_fields(out_file)
    assert out_file.bytes == len(oai_run.files.content(done.output_file_id).content)

    # A second batch from the same file, then the list pages through both.
    again = oai_run.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    listed = [b.id for b in oai_run.batches.list(limit=1)]  # auto-pagination, one per page
    assert listed == [again.id, batch.id]


@pytest.mark.slow
def test_openai_batch_cancel_and_file_errors(oai_run: openai.OpenAI):
    """batches.cancel stops a batch (its unrun requests go to the error file as
    batch_cancelled); a bad upload, another tenant's file and a deleted file are the
    SDK's typed errors."""
    lines = [chat_line(f"c-{i}", max_tokens=400) for i in range(40)]
    upload = oai_run.files.create(file=("many.jsonl", _jsonl(lines)), purpose="batch")
    batch = oai_run.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    cancelling = oai_run.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    ended = openai_batch_in(oai_run, batch.id, {"cancelled"})
    assert ended.cancelled_at and ended.error_file_id
    errors = [json.loads(x) for x in oai_run.files.content(ended.error_file_id).text.splitlines()]
    assert errors and {r["error"]["code"] for r in errors} <= {"batch_cancelled"}
    assert ended.request_counts.total == 40

    with pytest.raises(openai.BadRequestError) as bad:
        oai_run.files.create(file=("bad.jsonl", b'{"custom_id": "x"}\n'), purpose="batch")
    assert bad.value.body["line"] == 1  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        oai_run.files.create(file=("r.jsonl", _jsonl(lines)), purpose="fine-tune")

    stranger = oai_run.with_options(api_key=make_tenant("other-tenant"))
    with pytest.raises(openai.NotFoundError):
        stranger.files.retrieve(upload.id)
    with pytest.raises(openai.NotFoundError):
        stranger.files.content(ended.error_file_id)
    with pytest.raises(openai.NotFoundError):
        stranger.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

    listed = oai_run.files.list()
    assert [f.id for f in listed] == [upload.id]
    deleted = oai_run.files.delete(upload.id)
    assert (deleted.id, deleted.deleted) == (upload.id, True)
    with pytest.raises(openai.NotFoundError):
        oai_run.files.retrieve(upload.id)
    assert oai_run.batches.retrieve(batch.id).input_file_id == upload.id  # the batch stays


# -- Anthropic's Message Batches, as its SDK runs them -----------------------------------


@pytest.fixture
def claude_run(clean_db, stack: str) -> Iterator[anthropic.Anthropic]:
    base_url = stack
    key = make_tenant("sdk-claude")
    with anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0) as client:
        yield client


def _anthropic_strict(model: anthropic.BaseModel) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return model.model_dump()


def _request(custom_id: str, text: str = "Describe a chair.", **params: Any) -> dict[str, Any]:
    params = {"max_tokens": 60, "system": "You write product copy.", **params}
    request = message_request(custom_id, text, **params)
    request["params"]["messages"] = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    return request


@pytest.mark.slow
def test_anthropic_message_batches_flow(claude_run: anthropic.Anthropic):
    """messages.batches.create → retrieve until ended → results → list → cancel, every
    object the SDK's type, through the same dispatcher, budget and ledger."""
    requests = [_request(f"m-{i}") for i in range(5)]
    created = claude_run.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert isinstance(created, MessageBatch) and _no_extra_fields(created)
    _anthropic_strict(created)
    assert created.processing_status == "in_progress" and created.results_url is None
    assert created.request_counts.processing == 5

    ended = anthropic_batch_ended(claude_run, created.id)
    _anthropic_strict(ended)
    assert ended.request_counts.succeeded == 5 and ended.ended_at is not None
    assert ended.results_url and ended.results_url.endswith(f"/{created.id}/results")

    results = list(claude_run.messages.batches.results(created.id))
    assert [r.custom_id for r in results] == [f"m-{i}" for i in range(5)]
    for r in results:
        assert isinstance(r, MessageBatchIndividualResponse) and r.result.type == "succeeded"
        message = r.result.message
        assert isinstance(message, Message) and _no_extra_fields(message)
        assert message.content[0].type == "text" and message.content[0].text
        assert message.usage.input_tokens > 0 and message.stop_reason in ("end_turn", "max_tokens")

    # A second batch, cancelled at once: its unrun requests come back canceled.
    many = claude_run.messages.batches.create(
        requests=[_request(f"c-{i}", max_tokens=400) for i in range(40)]  # type: ignore[misc]
    )
    cancelling = claude_run.messages.batches.cancel(many.id)
    assert cancelling.processing_status in ("canceling", "ended")
    assert cancelling.cancel_initiated_at is not None
    stopped = anthropic_batch_ended(claude_run, many.id)
    assert stopped.request_counts.canceled >= 1
    kinds = {r.result.type for r in claude_run.messages.batches.results(many.id)}
    assert "canceled" in kinds and kinds <= {"canceled", "succeeded"}

    listed = [b.id for b in claude_run.messages.batches.list(limit=1)]  # the SDK follows after_id
    assert listed == [many.id, created.id]


@pytest.mark.slow
def test_anthropic_message_batch_errors(claude_run: anthropic.Anthropic):
    """A malformed request is a BadRequestError naming it, nothing is stored; another
    tenant's batch is a NotFoundError."""
    bad = _request("untyped")
    bad["params"]["messages"][0]["content"] = [{"source": {}}]  # a block without a type
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude_run.messages.batches.create(requests=[_request("ok"), bad])  # type: ignore[list-item]
    assert "requests[1].params.messages[0].content[0]" in raised.value.message
    assert list(claude_run.messages.batches.list()) == []
    with pytest.raises(anthropic.BadRequestError):
        claude_run.messages.batches.create(requests=[_request("m", model="no-such-model")])  # type: ignore[list-item]

    mine = claude_run.messages.batches.create(requests=[_request("one")])  # type: ignore[list-item]
    stranger = claude_run.with_options(api_key=make_tenant("other-claude"))
    with pytest.raises(anthropic.NotFoundError):
        stranger.messages.batches.retrieve(mine.id)
    with pytest.raises(anthropic.NotFoundError):
        stranger.messages.batches.cancel(mine.id)


# -- synchronous calls through the scheduler ------------------------------------------


def _call_rows(tenant: str) -> list[tuple[str, int, int]]:
    """(item status, ledger rows, results) of the tenant's calls."""
    with db.session_scope() as s:
        rows = s.execute(
            select(
                Item.status,
                select(func.count()).where(UsageLedger.item_id == Item.id).scalar_subquery(),
                select(func.count()).where(Result.item_id == Item.id).scalar_subquery(),
            )
            .join(Tenant, Tenant.id == Item.tenant_id)
            .where(Tenant.name == tenant, Item.priority_rank == CALL_RANK)
        )
        return [tuple(r) for r in rows]  # type: ignore[misc]


@pytest.mark.slow
def test_chat_completions_through_the_scheduler(oai_run: openai.OpenAI):
    """chat.completions.create, plain and streamed: the answer is the SDK's type, and each
    call is an item with its result and its one ledger row; calls stay out of the list
    of batches."""
    asked = [{"role": "user", "content": "Describe a red chair."}]
    plain = oai_run.chat.completions.create(model="sim-small", messages=asked, max_tokens=40)  # type: ignore[arg-type]
    assert isinstance(plain, ChatCompletion) and plain.choices[0].message.content
    assert plain.usage is not None and plain.usage.prompt_tokens > 0
    stream = oai_run.chat.completions.create(
        model="sim-small",
        messages=asked,  # type: ignore[arg-type]
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert sorted(_call_rows("sdk-files")) == [("succeeded", 1, 1), ("succeeded", 1, 1)]
    assert list(oai_run.batches.list()) == []

    with pytest.raises(openai.BadRequestError):  # validated as any line
        oai_run.chat.completions.create(model="no-such-model", messages=asked)  # type: ignore[arg-type]


@pytest.mark.slow
def test_messages_create_through_the_scheduler(claude_run: anthropic.Anthropic):
    message = claude_run.messages.create(
        model="sim-claude",
        max_tokens=40,
        system="You write product copy.",
        messages=[{"role": "user", "content": "Describe a lamp."}],
    )
    assert isinstance(message, Message) and _no_extra_fields(message)
    assert message.content[0].type == "text" and message.content[0].text
    with claude_run.messages.stream(
        model="sim-claude", max_tokens=40, messages=[{"role": "user", "content": "A desk."}]
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed and final.content[0].text == streamed  # type: ignore[union-attr]
    assert final.usage.output_tokens > 0
    assert sorted(_call_rows("sdk-claude")) == [("succeeded", 1, 1), ("succeeded", 1, 1)]


@pytest.mark.slow
def test_a_call_that_cannot_start_in_time_is_refused_at_once(oai_run: openai.OpenAI, simulator):
    """The fail-fast rule: with calls ahead of it that need longer than its deadline,
    a call is a 503 with Retry-After at once, and nothing of it is stored."""
    from batchgen.store.call_rows import calls_ahead_tokens

    sim_config(simulator.base_url, latency_base_ms=3000)
    try:
        slow = oai_run.with_options(timeout=30.0)
        with ThreadPoolExecutor(2) as pool:  # calls ahead of it, still running
            ahead = [
                pool.submit(
                    slow.chat.completions.create,
                    model="sim-small",
                    messages=[{"role": "user", "content": "x"}],
                    max_tokens=1000,
                )
                for _ in range(2)
            ]
            wait_until(lambda: _open_calls() == 2, 20, "two calls in flight")
            with db.session_scope() as s:
                tokens = calls_ahead_tokens(s, "sim-small")
            tpm = get_registry()["sim-small"].tokens_per_min
            needed_s = tokens / (tpm / 60)
            started = time.monotonic()
            with pytest.raises(openai.InternalServerError) as refused:
                oai_run.chat.completions.create(
                    model="sim-small",
                    messages=[{"role": "user", "content": "y"}],
                    max_tokens=1000,
                    extra_headers={"X-Request-Timeout": f"{needed_s / 2:.3f}"},
                )
            assert time.monotonic() - started < 2.0  # at once, not at the deadline
            assert refused.value.status_code == 503
            assert int(refused.value.response.headers["Retry-After"]) >= 1
            assert refused.value.code == "overloaded"
            assert _open_calls() == 2  # nothing of the refused call was stored
            for future in ahead:
                future.result()
    finally:
        sim_config(simulator.base_url, latency_base_ms=50)


def _open_calls() -> int:
    with db.session_scope() as s:
        return int(
            s.scalar(
                select(func.count())
                .select_from(Item)
                .where(
                    Item.priority_rank == CALL_RANK,
                    Item.status.in_(["pending", "queued", "running"]),
                )
            )
            or 0
        )


@pytest.mark.slow
def test_a_caller_that_goes_away_cancels_its_call(oai_run: openai.OpenAI, simulator):
    """The caller closes its connection while the provider is still answering: the call
    is cancelled (the item ends cancelled, the provider call is cut). The caller hangs up
    once the provider has the call, whatever the machine's speed, as an SDK whose
    timeout ran out would."""
    sim_config(simulator.base_url, latency_base_ms=200, latency_per_token_ms=100)
    body = json.dumps(
        {
            "model": "sim-small",
            "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 400,  # an answer of 10 s or more
        }
    ).encode()
    url = oai_run.base_url
    head = (
        f"POST {url.raw_path.decode().rstrip('/')}/chat/completions HTTP/1.1\r\n"
        f"Host: {url.host}:{url.port}\r\nAuthorization: Bearer {oai_run.api_key}\r\n"
        # The call's own deadline is far: the caller hangs up first.
        "Content-Type: application/json\r\nX-Request-Timeout: 60\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    try:
        with socket.create_connection((url.host, url.port), timeout=30) as caller:
            caller.sendall(head.encode() + body)
            wait_until(lambda: sim_in_flight(simulator.base_url) == 1, 20, "the provider call")
            assert _call_rows("sdk-files") == [("running", 0, 0)]
        try:
            wait_until(lambda: _call_rows("sdk-files") == [("cancelled", 1, 0)], 20, "the cancel")
            wait_until(lambda: cut_calls(simulator.base_url) >= 1, 20, "the provider call cut")
        except AssertionError as late:
            raise AssertionError(
                f"{late}; calls (status, ledger rows, results): {_call_rows('sdk-files')}, "
                f"provider log: {simulator_log(simulator.base_url)}"
            ) from None
    finally:
        sim_config(simulator.base_url, latency_base_ms=50, latency_per_token_ms=0.5)


@pytest.mark.slow
def test_a_call_past_its_deadline_is_a_504(oai_run: openai.OpenAI, simulator):
    """The deadline covers the whole call: a provider slower than it ends the call
    expired, answered 504 deadline_exceeded at the deadline."""
    sim_config(simulator.base_url, latency_base_ms=4000)
    try:
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as late:
            oai_run.chat.completions.create(
                model="sim-small",
                messages=[{"role": "user", "content": "slow"}],
                max_tokens=20,
                extra_headers={"X-Request-Timeout": "1.5"},
            )
        assert late.value.status_code == 504 and late.value.code == "deadline_exceeded"
        assert time.monotonic() - started < 4.0  # at the deadline, not the provider's answer
        assert [row[0] for row in _call_rows("sdk-files")] == ["expired"]
    finally:
        sim_config(simulator.base_url, latency_base_ms=50)


@pytest.mark.slow
def test_a_tenant_over_its_quota_is_the_sdks_rate_limit_error(oai_run: openai.OpenAI):
    """The tenant's own bounds apply to calls and to batches from files alike: a 429
    with Retry-After, which the SDK raises as RateLimitError with our JSON error."""
    capped = oai_run.with_options(api_key=make_tenant("capped", daily_token_quota=10))
    with pytest.raises(openai.RateLimitError) as limited:
        capped.chat.completions.create(
            model="sim-small", messages=[{"role": "user", "content": "hello"}], max_tokens=50
        )
    assert limited.value.code == "tenant_over_quota"
    assert int(limited.value.response.headers["Retry-After"]) >= 1
    upload = capped.files.create(file=("q.jsonl", _jsonl([chat_line("q")])), purpose="batch")
    with pytest.raises(openai.RateLimitError):
        capped.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )


@pytest.mark.slow
def test_a_call_is_answered_when_the_listening_connection_is_lost(oai_run: openai.OpenAI):
    """The API process hears a call's end through LISTEN; with that connection killed,
    the call is still answered (its waiter reads the item), and the listener comes back."""
    from sqlalchemy import text

    from batchgen.store.call_rows import listener_name

    asked = [{"role": "user", "content": "x"}]
    oai_run.chat.completions.create(model="sim-small", messages=asked, max_tokens=5)  # type: ignore[arg-type]
    port = int(str(oai_run.base_url).rstrip("/").rsplit(":", 1)[1].split("/")[0])
    # gunicorn's master and its workers all listen on the port; a worker that answered
    # a call has a listening connection.
    names = [
        listener_name(c.pid)
        for c in psutil.net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid
    ]
    all_listeners = text(
        "SELECT pid, application_name FROM pg_stat_activity "
        "WHERE application_name = ANY(:names) AND query = 'LISTEN batchgen_call_done'"
    ).bindparams(names=names)
    with db.session_scope() as s:
        found = list(s.execute(all_listeners))
        assert found, "no listening connection"
        s.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": found[0].pid})
    listeners = text(
        "SELECT pid FROM pg_stat_activity WHERE application_name = :name "
        "AND query = 'LISTEN batchgen_call_done'"
    ).bindparams(name=found[0].application_name)
    answer = oai_run.chat.completions.create(model="sim-small", messages=asked, max_tokens=5)  # type: ignore[arg-type]
    assert answer.choices[0].message.content

    def listening_again() -> bool:
        with db.session_scope() as s:
            return len(list(s.scalars(listeners))) == 1

    wait_until(listening_again, 10, "the listener to reconnect")
