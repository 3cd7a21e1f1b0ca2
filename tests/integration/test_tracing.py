"""An item's trace, end to end: the submit and the release in this process (the SDK's
in-memory exporter), the delivery in a real worker process that exports OTLP over HTTP
to a receiver run here; one trace per item, GenAI attributes, no prompt or answer."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import select

from batchgen import python_api
from batchgen.registry import get_registry
from batchgen.store import db
from batchgen.store.schema import Item, Result
from batchgen.telemetry import genai, tracing
from tests.helpers import chat_line, make_tenant
from tests.invariants import wait_until

# A worker exporting OTLP to a receiver in the test; a synchronous call's trace.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = "Zorblax hover-kettle launch plan"
ITEMS = 3
WORKER_SPANS = {"batchgen.generate", "batchgen.budget", "chat sim-small", "batchgen.ledger"}


class _Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP receiver: keeps the spans (as dicts) and the metric names it is sent."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[dict[str, Any]] = []
        self.metrics: set[str] = set()
        self.raw: list[bytes] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _Receiver

    def do_POST(self) -> None:  # noqa: N802 - the http.server name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        with self.server.lock:
            self.server.raw.append(body)
            if self.path == "/v1/traces":
                self.server.spans.extend(_spans_of(body))
            elif self.path == "/v1/metrics":
                self.server.metrics |= _metric_names(body)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *_: Any) -> None:
        pass


def _value(any_value: Any) -> Any:
    return getattr(any_value, any_value.WhichOneof("value"))


def _spans_of(body: bytes) -> list[dict[str, Any]]:
    request = ExportTraceServiceRequest.FromString(body)
    return [
        {
            "name": span.name,
            "trace_id": int.from_bytes(span.trace_id, "big"),
            "span_id": int.from_bytes(span.span_id, "big"),
            "parent_id": int.from_bytes(span.parent_span_id, "big") if span.parent_span_id else 0,
            "attributes": {kv.key: _value(kv.value) for kv in span.attributes},
            "events": [e.name for e in span.events],
        }
        for resource in request.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]


def _metric_names(body: bytes) -> set[str]:
    request = ExportMetricsServiceRequest.FromString(body)
    return {
        metric.name
        for resource in request.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    server = _Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def in_memory() -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    provider = TracerProvider(id_generator=tracing.id_generator())
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracing.install(provider)
    yield spans
    tracing.shutdown()


def _exporting(receiver: _Receiver) -> dict[str, str]:
    """A worker's environment that turns traces and metrics on, sent to ``receiver``."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRIC_EXPORT_INTERVAL": "200",
        "OTEL_SERVICE_NAME": "batchgen-worker-under-test",
    }


def _done(batch_id: str) -> bool:
    from batchgen.tasks.dispatch import dispatch_now

    dispatch_now()  # this process releases (no worker runs a dispatcher here)
    with db.session_scope() as session:
        results = session.scalars(select(Result.item_id).where(Result.batch_id == batch_id))
        return len(results.all()) == ITEMS


def test_an_items_trace_runs_from_submit_to_the_ledger(
    clean_db, simulator, receiver, workers, in_memory
):  # the receiver outlives the worker, which sends what it holds as it stops
    make_tenant("traced")
    batch = python_api.submit_batch(
        [chat_line(f"t{i}", text=f"{PROMPT} #{i}") for i in range(ITEMS)], tenant="traced"
    )
    queue = get_registry()["sim-small"].queue
    workers([queue], concurrency=2, beat=False, env=_exporting(receiver))
    wait_until(lambda: _done(batch["id"]), 120, "the batch's items have results")
    with db.session_scope() as session:
        item_ids = session.scalars(select(Item.id).where(Item.batch_id == batch["id"])).all()

    def missing() -> dict[int, set[str]]:
        """Each item's worker spans not at the receiver yet. A task's span ends after
        its item's, and may come in the worker's next export."""
        with receiver.lock:
            names: dict[int, set[str]] = {}
            for s in receiver.spans:
                names.setdefault(s["trace_id"], set()).add(s["name"])
        wanted = {"batchgen.item", *WORKER_SPANS}
        traces = {i: genai.item_trace_ids(batch["id"], i)[0] for i in item_ids}
        lacking = {i: wanted - names.get(trace_id, set()) for i, trace_id in traces.items()}
        return {i: names for i, names in lacking.items() if names}

    wait_until(
        lambda: not missing(),
        60,
        lambda: f"every item's spans at the receiver; missing: {missing()}",
    )
    wait_until(lambda: genai.TOKEN_USAGE in receiver.metrics, 60, "the token usage histogram")
    assert genai.OPERATION_DURATION in receiver.metrics
    here = [
        {
            "name": s.name,
            "trace_id": s.context.trace_id,
            "span_id": s.context.span_id,
            "parent_id": s.parent.span_id if s.parent else 0,
            "attributes": dict(s.attributes or {}),
            "events": [e.name for e in s.events],
        }
        for s in in_memory.get_finished_spans()
    ]
    spans = here + receiver.spans
    (submit,) = [s for s in here if s["name"] == "batchgen.submit"]
    assert (submit["trace_id"], submit["span_id"]) == genai.batch_trace_ids(batch["id"])
    # The items travelled in a pack: each has its own release, delivery and call spans.
    releases = [s for s in spans if s["name"] == "batchgen.dispatch"]
    assert max(s["attributes"]["batchgen.pack_items"] for s in releases) > 1
    for item_id in item_ids:
        trace_id, root_id = genai.item_trace_ids(batch["id"], item_id)
        trace = {s["name"]: s for s in spans if s["trace_id"] == trace_id}
        assert {"batchgen.item", "batchgen.dispatch", *WORKER_SPANS} <= set(trace)
        assert trace["batchgen.item"]["span_id"] == root_id
        # released here, delivered there: the message's header carried the context
        assert trace["batchgen.dispatch"]["parent_id"] == root_id
        assert trace["batchgen.generate"]["parent_id"] == trace["batchgen.dispatch"]["span_id"]
        call = trace["chat sim-small"]["attributes"]
        assert call["gen_ai.operation.name"] == "chat"
        assert call["gen_ai.provider.name"] == "openai"
        assert call["gen_ai.request.model"] == "sim-small"
        assert call["gen_ai.usage.input_tokens"] > 0 and call["gen_ai.usage.output_tokens"] > 0
        assert call["batchgen.tenant"] == "traced" and call["batchgen.batch_id"] == batch["id"]
        assert call["batchgen.cost_usd"] > 0 and call["batchgen.route"] == "standard"
    # No prompt and no answer text in any attribute or event, nor anywhere on the wire.
    with db.session_scope() as session:
        answer = session.scalars(select(Result.response)).first()
    text = answer["choices"][0]["message"]["content"]
    assert text
    for span in spans:
        seen = repr(span["attributes"]) + repr(span["events"])
        assert PROMPT not in seen and text not in seen
    for body in receiver.raw:
        assert PROMPT.encode() not in body and text.encode() not in body


def test_a_streamed_synchronous_call_is_traced_with_its_first_chunk(clean_db, simulator, in_memory):
    from batchgen.api import create_app

    api = create_app().test_client()
    key = make_tenant("caller")
    body = {
        "model": "sim-small",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 20,
        "stream": True,
    }
    res = api.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert res.status_code == 200
    streamed = res.get_data(as_text=True)
    assert "chat.completion.chunk" in streamed

    def names() -> set[str]:
        return {s.name for s in in_memory.get_finished_spans()}

    wait_until(lambda: "batchgen.item" in names(), 60, lambda: f"the call's spans: {names()}")
    spans = {s.name: s for s in in_memory.get_finished_spans()}
    assert set(spans) >= WORKER_SPANS
    call = spans["chat sim-small"]
    assert call.context.trace_id == spans["batchgen.item"].context.trace_id
    assert call.attributes["gen_ai.request.stream"] is True
    assert call.attributes["batchgen.time_to_first_chunk_s"] >= 0
    assert call.attributes["batchgen.tenant"] == "caller"
    assert call.attributes["gen_ai.usage.output_tokens"] > 0
    for span in spans.values():
        assert PROMPT not in repr(dict(span.attributes or {})) + repr(span.events)
