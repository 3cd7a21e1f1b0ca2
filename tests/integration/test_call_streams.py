"""A streamed synchronous call reaches its caller as the provider sends it (issue 28 item 2).

The official SDKs call a live ``batchgen api`` process, which relays the simulator's
chunks as they arrive. What is checked is the order of events, never wall-clock
speed: the simulator paces its tokens (``latency_per_token_ms``), so while the caller
holds its first chunk the simulator's log still shows the provider answering. The
answer recorded is the whole one the chunks make, the ledger has one row for each
billed call, and a caller who hangs up mid-stream stops the provider's answer.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import anthropic
import openai
import psutil
import pytest
from sqlalchemy import select

from batchgen.limits.backend import get_redis
from batchgen.store import db
from batchgen.store.schema import Item, Result, UsageLedger
from tests import http_client
from tests.helpers import make_tenant, sim_config
from tests.invariants import (
    check_invariants,
    cut_calls,
    reset_simulator,
    simulator_log,
    wait_until,
)

# Tokens come 30 ms apart: an answer of 20 tokens or more streams for 0.6 s or more,
# the time the caller has to see its first chunk while the provider still answers.
PER_TOKEN_MS = 30
ASKED = [{"role": "user", "content": "Describe a red chair for the catalog."}]


@pytest.fixture(scope="module")
def api(simulator, module_api_server) -> str:
    """One API process for the module (no worker: calls run in the API process)."""
    return str(module_api_server())


@pytest.fixture
def paced(clean_db, simulator) -> Iterator[Any]:
    reset_simulator(simulator.base_url)
    sim_config(simulator.base_url, latency_per_token_ms=PER_TOKEN_MS)
    try:
        yield simulator
    finally:
        sim_config(
            simulator.base_url,
            latency_base_ms=50,
            latency_per_token_ms=0.5,
            fault_rate=0.0,
            fault_kinds=["5xx", "hang", "reset", "malformed"],
        )


def _oai(api: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api}/v1", api_key=make_tenant("streams"), max_retries=0)


def _claude(api: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=api, api_key=make_tenant("streams"), max_retries=0)


def _provider_call(simulator) -> dict[str, Any]:
    (entry,) = simulator_log(simulator.base_url)
    return entry


def _recorded() -> tuple[dict[str, Any], int]:
    """The one call's result of record and its ledger rows."""
    with db.session_scope() as s:
        (response,) = s.scalars(select(Result.response)).all()
        rows = len(s.scalars(select(UsageLedger.id)).all())
    return response, rows


@pytest.mark.parametrize("model", ["sim-small", "sim-claude"])
def test_a_chat_stream_reaches_the_caller_while_the_provider_answers(api, paced, model):
    """``client.chat.completions.stream``: the first chunk is in the caller's hands while
    the simulator is still sending the answer (its log has no end yet); the chunks the
    caller gets merge into the answer of record, ledgered once."""
    with (
        _oai(api) as client,
        client.chat.completions.stream(
            model=model, messages=ASKED, max_tokens=40, stream_options={"include_usage": True}
        ) as stream,
    ):
        events = iter(stream)
        first = next(e for e in events if e.type == "chunk")
        at_first = _provider_call(paced)
        rest = list(events)
        final = stream.current_completion_snapshot
    assert first.chunk.choices and at_first["end_ts"] is None, at_first
    assert _provider_call(paced)["completed"] is True
    chunks = 1 + sum(e.type == "chunk" for e in rest)
    assert chunks > 3
    response, ledger_rows = _recorded()
    assert ledger_rows == 1
    assert final.id == response["id"] and final.model == response["model"]
    choice = response["choices"][0]
    assert final.choices[0].message.content == choice["message"]["content"]
    assert final.choices[0].finish_reason == choice["finish_reason"]
    assert final.usage is not None
    assert final.usage.model_dump(exclude_none=True) == response["usage"]
    check_invariants(paced.base_url, get_redis())


@pytest.mark.parametrize("model", ["sim-claude", "sim-small"])
def test_a_messages_stream_reaches_the_caller_while_the_provider_answers(api, paced, model):
    """``client.messages.stream``, on an Anthropic model (its events as they came) and
    on an OpenAI-format one (the events of its answer's ``Message``)."""
    with (
        _claude(api) as client,
        client.messages.stream(model=model, max_tokens=40, messages=ASKED) as stream,
    ):
        events = iter(stream)
        first = next(events)
        at_first = _provider_call(paced)
        rest = list(events)
        final = stream.get_final_message()
    assert first.type == "message_start" and at_first["end_ts"] is None, at_first
    assert sum(e.type == "content_block_delta" for e in rest) > 3
    response, ledger_rows = _recorded()
    assert ledger_rows == 1
    if model == "sim-claude":  # the provider's Message, as it came
        assert final.model_dump(exclude={"content"}) == anthropic.types.Message.model_validate(
            response
        ).model_dump(exclude={"content"})
        assert final.content[0].text == response["content"][0]["text"]  # type: ignore[union-attr]
    else:  # the chat answer's first choice as a Message
        choice = response["choices"][0]
        assert final.content[0].text == choice["message"]["content"]  # type: ignore[union-attr]
        assert (final.usage.input_tokens, final.usage.output_tokens) == (
            response["usage"]["prompt_tokens"],
            response["usage"]["completion_tokens"],
        )
    check_invariants(paced.base_url, get_redis())


def test_the_first_read_holds_the_start_of_the_answer_only(api, paced):
    """On the wire: the caller's first read brings the first chunks while the provider
    is still answering, and not the end of the stream; the rest comes in later reads."""
    key = make_tenant("wire")
    body = {"model": "sim-small", "messages": ASKED, "max_tokens": 60, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    with http_client.stream(
        "POST", f"{api}/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        reads = response.iter_raw()
        first = next(reads)
        at_first = _provider_call(paced)
        later = list(reads)
    assert at_first["end_ts"] is None, at_first
    assert b"data: " in first and b"[DONE]" not in first
    assert later and b"[DONE]" in later[-1]
    events = (first + b"".join(later)).count(b"data: ")
    assert first.count(b"data: ") < events - 2


def test_a_caller_hanging_up_mid_stream_stops_the_provider_call(api, paced):
    """The SDK closes its stream after two chunks: the call ends cancelled, the
    simulator's answer is cut short, and the ledger holds the billed partial call."""
    sim_config(paced.base_url, latency_per_token_ms=100)
    with _oai(api) as client:
        stream = client.chat.completions.create(
            model="sim-small", messages=ASKED, max_tokens=200, stream=True
        )
        chunks = iter(stream)
        next(chunks), next(chunks)
        assert _provider_call(paced)["end_ts"] is None
        stream.close()
    wait_until(lambda: _statuses() == ["cancelled"], 20, "the call cancelled")
    wait_until(lambda: cut_calls(paced.base_url) == 1, 20, "the provider call cut")
    with db.session_scope() as s:
        (row,) = s.scalars(select(UsageLedger)).all()
    assert row.waste_reason is not None and row.completion_tokens > 0
    check_invariants(paced.base_url, get_redis())


def test_a_caller_hanging_up_on_a_whole_call_cancels_it(api_server, paced):
    """``batchgen api`` as production runs it (gunicorn, two threaded workers): a whole
    (not streamed) call whose caller closes its connection while the provider answers
    is seen gone (the server hands the call its socket), ends cancelled and cuts the
    provider's answer."""
    api = api_server({"BATCHGEN_API_WORKERS": "2"})
    port = int(api.rsplit(":", 1)[1])
    (listening,) = {
        os.getpgid(c.pid)
        for c in psutil.net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid
    }
    workers = psutil.Process(listening).children()
    assert len(workers) == 2, workers  # gunicorn's master (the group's leader) and two
    sim_config(paced.base_url, latency_per_token_ms=100)
    body = json.dumps({"model": "sim-small", "messages": ASKED, "max_tokens": 200}).encode()
    address = urlsplit(api)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\n"
        f"Host: {address.netloc}\r\n"
        f"Authorization: Bearer {make_tenant('streams')}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    caller = socket.create_connection((address.hostname, address.port))
    caller.sendall(head.encode() + body)
    wait_until(lambda: len(simulator_log(paced.base_url)) == 1, 20, "the call at the provider")
    assert _provider_call(paced)["end_ts"] is None
    caller.close()  # hung up, no answer read
    wait_until(lambda: _statuses() == ["cancelled"], 20, "the call cancelled")
    wait_until(lambda: cut_calls(paced.base_url) == 1, 20, "the provider call cut")
    check_invariants(paced.base_url, get_redis())


def _statuses() -> list[str]:
    with db.session_scope() as s:
        return list(s.scalars(select(Item.status)).all())


def test_a_stream_cut_by_the_provider_is_an_error_event_not_a_retry(api, paced):
    """The provider resets the connection halfway through: the caller, who has half an
    answer, gets an error event (the SDK raises); the call is not tried again (no
    retry could finish that answer) and ends cancelled, its cut call ledgered."""
    sim_config(paced.base_url, fault_rate=1.0, fault_kinds=["reset"])
    got: list[str] = []
    with _oai(api) as client, pytest.raises(openai.APIError) as broken:
        stream = client.chat.completions.create(
            model="sim-small", messages=ASKED, max_tokens=40, stream=True
        )
        for chunk in stream:
            got.append(chunk.choices[0].delta.content or "")
    assert len(got) > 1 and "broke off" in str(broken.value.body)
    wait_until(lambda: _statuses() == ["cancelled"], 20, "the call ended")
    assert len(simulator_log(paced.base_url)) == 1  # one provider call, not retried
    check_invariants(paced.base_url, get_redis())


def test_a_stream_that_ends_before_its_first_chunk_is_answered_with_a_status(api, paced):
    """No chunk before the deadline: the answer is a 504 status, as for a plain call
    (the SDK raises at ``create``), not a stream with an error in it."""
    sim_config(paced.base_url, latency_base_ms=3000)
    with _oai(api) as client, pytest.raises(openai.APIStatusError) as late:
        client.chat.completions.create(
            model="sim-small",
            messages=ASKED,
            max_tokens=20,
            stream=True,
            extra_headers={"X-Request-Timeout": "1"},
        )
    assert late.value.status_code == 504 and late.value.code == "deadline_exceeded"
    assert _statuses() == ["expired"]


def test_a_stream_run_elsewhere_is_answered_whole_at_its_end(paced):
    """A streamed call whose provider call is made by another process (a worker, after
    the API process lost the call) has no chunks here: its reader gets the whole
    answer of record once it is recorded. Here the call's item is run as a worker runs
    one, in another thread and with no relay."""
    from batchgen import python_api
    from batchgen.config import get_settings
    from batchgen.domain.formats.admission import CHAT_COMPLETIONS
    from batchgen.limits.gate import Gate
    from batchgen.registry import get_registry
    from batchgen.store import call_rows
    from batchgen.store.tenants import find
    from batchgen.worker import call_runner
    from batchgen.worker.cancellation import CancelWatcher
    from batchgen.worker.execution import run_item
    from batchgen.worker.relay import ChunkRelay, Wake

    make_tenant("elsewhere")
    line = {
        "custom_id": "call",
        "method": "POST",
        "url": CHAT_COMPLETIONS,
        "body": {"model": "sim-small", "messages": ASKED, "max_tokens": 30},
    }
    settings = get_settings()
    with db.session_scope() as s:
        stored = call_rows.store_call(
            s,
            find(s, "elsewhere"),
            line,
            deadline_s=60,
            endpoint=CHAT_COMPLETIONS,
            registry=get_registry(),
            settings=settings,
        )
    relay = ChunkRelay()
    woken = call_runner.call_waiter().register(stored.item_id, event=Wake(relay))
    pending = call_runner.PendingCall(stored, "elsewhere", 1e12, woken, relay=relay)
    gate, watcher = Gate(get_redis(), settings), CancelWatcher(get_redis())
    worker = threading.Thread(
        target=run_item,
        args=(stored.item_id, get_registry(), settings, gate, watcher),
        kwargs={"model": stored.model, "ticket": stored.queue_ticket},
    )
    worker.start()
    parts = list(python_api.stream_call(pending))
    worker.join(30)
    response, ledger_rows = _recorded()
    assert [p.chunk for p in parts] == [None] and parts[0].whole == response
    assert ledger_rows == 1 and relay.produced == 0
