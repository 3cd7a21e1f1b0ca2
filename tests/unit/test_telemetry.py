"""The OpenTelemetry switch, the GenAI attribute builders, and the hooks' spans."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from batchgen.errors import TransientProviderError
from batchgen.registry import ModelSpec, ProviderKind, Tier, get_registry
from batchgen.telemetry import genai, tracing
from batchgen.telemetry.genai import CallInfo

PROMPT = "the secret prompt about hover-kettles"
ANSWER = "the secret answer about hover-kettles"


def _spec(provider: str = "openai") -> ModelSpec:
    """The registry's sim-small, as a model of ``provider``."""
    return get_registry()["sim-small"].model_copy(update={"provider": ProviderKind(provider)})


def _info(stream: bool = False) -> CallInfo:
    return CallInfo(
        model="sim-small",
        spec=_spec(),
        endpoint="/v1/chat/completions",
        tenant="acme",
        batch_id="batch_1",
        item_id=7,
        attempt=1,
        route="standard",
        stream=stream,
        tier=Tier.STANDARD,
    )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (None, None)),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp", None)),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp"}, ("otlp", "otlp")),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, (None, None)),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "console"}, (None, "console")),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, (None, None)),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, (None, None)),
    ],
)
def test_the_switch_is_the_exporter_variables(env, expected):
    assert tracing.switch(env) == expected


def test_request_attributes_follow_the_genai_conventions():
    attrs = genai.request_attributes(_info())
    assert attrs == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "sim-small",
        "batchgen.deployment": "default",
        "batchgen.tenant": "acme",
        "batchgen.batch_id": "batch_1",
        "batchgen.item_id": 7,
        "batchgen.attempt": 1,
        "batchgen.route": "standard",
        "gen_ai.request.stream": False,
    }
    assert genai.span_name(_info()) == "chat sim-small"
    assert genai.provider_name(_spec("anthropic")) == "anthropic"
    assert genai.PROVIDER_NAMES[ProviderKind.BEDROCK] == "aws.bedrock"
    assert genai.operation_name("/v1/embeddings") == "embeddings"


def test_response_attributes_carry_counts_and_cost_only():
    attrs = genai.response_attributes("m-2025", "req_1", "stop", 120, 30, 100, Decimal("0.0004"))
    assert attrs == {
        "gen_ai.usage.input_tokens": 120,
        "gen_ai.usage.output_tokens": 30,
        "gen_ai.usage.cache_read.input_tokens": 100,
        "gen_ai.response.model": "m-2025",
        "gen_ai.response.id": "req_1",
        "gen_ai.response.finish_reasons": "stop",
        "batchgen.cost_usd": 0.0004,
    }
    bare = genai.response_attributes(None, None, None, 1, 2, 0, Decimal(0))
    assert "gen_ai.usage.cache_read.input_tokens" not in bare


def test_trace_ids_are_derived_from_the_item():
    one = genai.item_trace_ids("batch_1", 7)
    assert one == genai.item_trace_ids("batch_1", 7)
    assert one != genai.item_trace_ids("batch_1", 8) != genai.batch_trace_ids("batch_1")
    assert all(n > 0 for n in one) and one[0] < 2**128 and one[1] < 2**64


def test_off_the_hooks_call_straight_through(monkeypatch):
    from opentelemetry import trace
    from opentelemetry.sdk import trace as sdk_trace

    def built(*_: Any, **__: Any) -> None:
        raise AssertionError("a span was built while off")

    monkeypatch.setattr(sdk_trace.Span, "__init__", built)
    monkeypatch.setattr(trace.NonRecordingSpan, "__init__", built)
    assert tracing._state is None
    assert tracing.gated(lambda a, b: a + b, 1, 2) == 3
    assert tracing.called(_unreachable, lambda r: r * 2, 21) == 42
    assert tracing.ledgered(lambda: True, _unreachable, dt.datetime.now(dt.UTC), 0.1)
    options: dict[str, Any] = {"args": [7], "kwargs": {"ticket": {"batch": "batch_1"}}}
    tracing.carry(options)
    assert "headers" not in options
    with tracing.attempt(7, "batch_1", "acme", 1, "m") as span:
        assert span is None


def _unreachable() -> CallInfo:
    raise AssertionError("built while off")


@pytest.fixture
def exported() -> Iterator[tuple[InMemorySpanExporter, InMemoryMetricReader]]:
    spans = InMemorySpanExporter()
    provider = TracerProvider(id_generator=tracing.id_generator())
    provider.add_span_processor(SimpleSpanProcessor(spans))
    metrics = InMemoryMetricReader()
    tracing.install(provider, MeterProvider(metric_readers=[metrics]))
    yield spans, metrics
    tracing.shutdown()


@dataclass
class _Response:
    prompt_tokens: int = 120
    completion_tokens: int = 30
    finish_reason: str = "stop"
    request_id: str = "req_1"
    body: dict[str, Any] = field(
        default_factory=lambda: {
            "model": "m-2025",
            "choices": [{"message": {"content": ANSWER}}],
            "usage": {"prompt_tokens_details": {"cached_tokens": 100}},
        }
    )


@dataclass(frozen=True)
class _Request:
    body: dict[str, Any]
    on_chunk: Any = None


@dataclass
class _Pass:
    deployment: str = "m"


def _deliver(chunks: list[dict[str, Any]]) -> _Response:
    """One delivery of item 7 as the worker runs it, through every hook."""
    options: dict[str, Any] = {
        "args": [7],
        "kwargs": {"model": "m", "ticket": {"batch": "batch_1", "tenant_name": "acme"}},
    }
    tracing.carry(options)  # the dispatcher's release

    class Request:
        headers = options["headers"]

    def complete(request: _Request) -> _Response:
        for chunk in chunks:
            request.on_chunk(chunk)
        return _Response()

    relayed: list[dict[str, Any]] = []
    request = _Request({"messages": [{"content": PROMPT}]}, on_chunk=relayed.append)
    with tracing.delivery(Request()), tracing.attempt(7, "batch_1", "acme", 1, "m"):
        tracing.gated(lambda: _Pass())
        response = tracing.called(lambda: _info(stream=True), complete, request)
        assert relayed == chunks
        created = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=3)
        assert tracing.ledgered(lambda: True, lambda: _info(stream=True), created, 0.5)
    return response


def test_one_trace_per_item_with_genai_attributes_and_no_text(exported):
    spans, metrics = exported
    _deliver([{"choices": [{"delta": {"content": ANSWER}}]}])
    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert set(by_name) == {
        "batchgen.dispatch",
        "batchgen.generate",
        "batchgen.budget",
        "chat sim-small",
        "batchgen.ledger",
        "batchgen.item",
    }
    trace_id, root_id = genai.item_trace_ids("batch_1", 7)
    assert {s.context.trace_id for s in by_name.values()} == {trace_id}
    assert by_name["batchgen.item"].context.span_id == root_id
    assert by_name["batchgen.dispatch"].parent.span_id == root_id
    assert (
        by_name["batchgen.generate"].parent.span_id == by_name["batchgen.dispatch"].context.span_id
    )
    generate_id = by_name["batchgen.generate"].context.span_id
    for child in ("batchgen.budget", "chat sim-small", "batchgen.ledger"):
        assert by_name[child].parent.span_id == generate_id
    call = by_name["chat sim-small"].attributes
    assert call["gen_ai.usage.input_tokens"] == 120
    assert call["gen_ai.usage.cache_read.input_tokens"] == 100
    assert call["gen_ai.response.model"] == "m-2025"
    assert call["batchgen.cost_usd"] > 0
    assert call["batchgen.time_to_first_chunk_s"] >= 0
    assert by_name["batchgen.budget"].attributes["batchgen.budget.decision"] == "_pass"
    submit_trace, submit_span = genai.batch_trace_ids("batch_1")
    link = by_name["batchgen.item"].links[0].context
    assert (link.trace_id, link.span_id) == (submit_trace, submit_span)
    for span in by_name.values():
        text = repr(dict(span.attributes or {})) + repr([e.attributes for e in span.events])
        assert PROMPT not in text and ANSWER not in text and "hover" not in text
    names = {
        m.name
        for rm in metrics.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert names == {genai.TOKEN_USAGE, genai.OPERATION_DURATION, genai.TIME_TO_FIRST_CHUNK}


def test_a_failed_call_says_its_error_type_only(exported):
    spans, _ = exported

    def complete(request: Any) -> Any:
        raise TransientProviderError(f"upstream choked on {PROMPT}", billed=True)

    with pytest.raises(TransientProviderError):
        tracing.called(_info, complete, _Request({}))
    (span,) = spans.get_finished_spans()
    assert span.attributes["error.type"]
    assert PROMPT not in repr(dict(span.attributes)) and not span.events


def test_a_ratio_sampler_keeps_or_drops_an_items_trace_whole():
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    spans = InMemorySpanExporter()
    provider = TracerProvider(sampler=TraceIdRatioBased(0.5), id_generator=tracing.id_generator())
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracing.install(provider)
    try:
        for item_id in range(20):
            with tracing.attempt(item_id, "batch_1", "acme", 1, "m"):
                tracing.gated(_Pass)
    finally:
        tracing.shutdown()
    by_trace: dict[int, set[str]] = {}
    for span in spans.get_finished_spans():
        by_trace.setdefault(span.context.trace_id, set()).add(span.name)
    assert 0 < len(by_trace) < 20
    assert all(names == {"batchgen.generate", "batchgen.budget"} for names in by_trace.values())


def test_an_item_ended_without_an_answer_gets_its_root(exported):
    spans, _ = exported
    created = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=2)
    tracing.ended("batch_1", 7, "acme", 2, "failed", created)
    (root,) = spans.get_finished_spans()
    trace_id, span_id = genai.item_trace_ids("batch_1", 7)
    assert (root.name, root.context.trace_id, root.context.span_id) == (
        "batchgen.item",
        trace_id,
        span_id,
    )
    assert root.attributes["batchgen.status"] == "failed"
    assert root.start_time == int(created.timestamp() * 1e9) and not root.parent


def test_a_retry_carries_the_context_its_message_brought(exported):
    spans, _ = exported
    ticket = {"batch": "batch_1", "tenant_name": "acme"}
    released: dict[str, Any] = {"args": [7], "kwargs": {"model": "m", "ticket": ticket}}
    tracing.carry(released)

    class Request:
        headers = released["headers"]

    retried: dict[str, Any] = {"args": [7], "kwargs": {"model": "m", "ticket": ticket}}
    with tracing.delivery(Request()):
        tracing.carry(retried, [7], {"model": "m", "ticket": ticket})  # Task.retry's form
    assert retried["headers"]["traceparent"] == released["headers"]["traceparent"]
    assert [s.name for s in spans.get_finished_spans()] == ["batchgen.dispatch"]


def test_a_packs_items_are_each_released_delivered_and_retried_in_their_own_trace(exported):
    """A message carrying items 7, 8 and 9: a release span in each item's trace; the
    message's traceparent is item 7's, its pack header the others'. Run as a group, item
    8's delivery, budget, call and ledger spans are in its own trace, under its release,
    though item 7's context is current on the message's thread; the pack's retry carries
    the others' contexts on."""
    spans, _ = exported
    ticket = {"batch": "batch_1", "tenant_name": "acme", "attempt": 1}
    more = [[8, dict(ticket)], [9, dict(ticket)], ["not", "an entry"]]
    released: dict[str, Any] = {
        "args": [7],
        "kwargs": {"model": "m", "ticket": ticket, "more": more},
    }
    tracing.carry(released)
    releases = {
        dict(s.attributes or {})["batchgen.item_id"]: s
        for s in spans.get_finished_spans()
        if s.name == "batchgen.dispatch"
    }
    assert sorted(releases) == [7, 8, 9]
    for item_id, span in releases.items():
        assert span.context.trace_id == genai.item_trace_ids("batch_1", item_id)[0]
        assert dict(span.attributes or {})["batchgen.pack_items"] == 4
    carried = released["headers"][tracing.PACK_TRACEPARENTS]
    assert sorted(carried) == ["8", "9"]
    assert f"{releases[8].context.span_id:016x}" in carried["8"]

    class Request:
        headers = released["headers"]

    with tracing.delivery(Request()):
        item = tracing.packed(8, "batch_1", "acme", 1, "m", (1, 2), "m")
        info = dataclasses.replace(_info(stream=True), item_id=8)
        with tracing.inside(item):
            tracing.called(lambda: info, lambda request: _Response(), _Request({}))
        created = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=3)
        tracing.ledgered_packed(item, 3, lambda: info, created, 0.5)
        tracing.end(item)
        retried: dict[str, Any] = {"args": [7], "kwargs": {"model": "m", "ticket": ticket}}
        retried["kwargs"]["more"] = more[:1]  # item 8 waits with item 7; 9 went on
        tracing.carry(retried)
    assert retried["headers"][tracing.PACK_TRACEPARENTS] == {"8": carried["8"]}
    eight = [
        s
        for s in spans.get_finished_spans()
        if s.context.trace_id == genai.item_trace_ids("batch_1", 8)[0]
    ]
    by_name = {s.name: s for s in eight}
    assert set(by_name) >= {"batchgen.generate", "batchgen.budget", "batchgen.ledger"}
    generate = by_name["batchgen.generate"]
    assert generate.parent is not None and generate.parent.span_id == releases[8].context.span_id
    for name in ("batchgen.budget", "batchgen.ledger"):
        parent = by_name[name].parent
        assert parent is not None and parent.span_id == generate.context.span_id
    calls = [s for s in eight if s.kind.name == "CLIENT"]
    assert len(calls) == 1 and calls[0].parent is not None
    assert calls[0].parent.span_id == generate.context.span_id
    assert "batchgen.item" in by_name  # its root, once the ledger recorded its answer
