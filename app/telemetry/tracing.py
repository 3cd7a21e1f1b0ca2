"""OpenTelemetry traces and metrics of items and calls: setup from the environment, and
the hooks the worker path calls at its edges.

Off by default. ``OTEL_TRACES_EXPORTER=otlp`` (or ``console``) turns traces on,
``OTEL_METRICS_EXPORTER=otlp`` (or ``console``) the GenAI client metrics, and
``OTEL_SDK_DISABLED=true`` turns both off whatever else is set (:func:`switch`).
The OTLP exporters send protobuf over HTTP to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (and
read every other standard ``OTEL_EXPORTER_OTLP_*`` variable themselves).

When off, every hook is one test of a module global (:data:`_state` is None) and a
direct call: no span object is built and the SDK is not imported.

One trace per item: its trace id is derived from the batch and item ids
(:func:`batchgen.telemetry.genai.item_trace_ids`), so the dispatcher, every worker
delivery and retry, and a synchronous caller join the same trace; the message's
``traceparent`` header carries the exact parent (the release that sent it, or the
attempt that retried it). The item's root span, ``batchgen.item``, runs from its
submit to its ledger write and is emitted once, by the attempt whose answer the
ledger recorded; it links the batch's ``batchgen.submit`` span.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from batchgen.telemetry import genai
from batchgen.telemetry.genai import CallInfo

log = logging.getLogger(__name__)
T = TypeVar("T")
EXPORTERS = ("otlp", "console")
TRACEPARENT = "traceparent"
# A pack's other items' contexts (item id -> traceparent): the message's own header
# carries its first item's.
PACK_TRACEPARENTS = "batchgen_traceparents"


def switch(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The trace and metric exporters the environment asks for (None: off)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None, None
    return _exporter(env, "OTEL_TRACES_EXPORTER"), _exporter(env, "OTEL_METRICS_EXPORTER")


def _exporter(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip().lower()
    if value in ("", "none"):
        return None
    if value not in EXPORTERS:
        log.warning("%s=%s is not supported (otlp, console, none): off", name, value)
        return None
    return value


@dataclass
class _State:
    tracer: Any
    tracer_provider: Any
    meter_provider: Any = None
    token_usage: Any = None
    duration_s: Any = None
    first_chunk_s: Any = None


_state: _State | None = None
# Set only while the span whose ids are derived (an item's root, a batch's submit) starts.
_forced_ids: ContextVar[tuple[int, int] | None] = ContextVar("batchgen_forced_ids", default=None)
# The contexts a pack's message carried for its other items (PACK_TRACEPARENTS).
_pack_parents: ContextVar[Mapping[str, str] | None] = ContextVar(
    "batchgen_pack_parents", default=None
)


def setup_from_env(service_name: str, env: Mapping[str, str] | None = None) -> bool:
    """Turn traces and metrics on if the environment says so (:func:`switch`); returns
    whether traces are on. Called once where a process starts (worker, API)."""
    traces, metrics = switch(os.environ if env is None else env)
    if traces is None and metrics is None:
        return False
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create({"service.name": service_name})  # OTEL_SERVICE_NAME wins
    tracer_provider = _tracer_provider(traces, resource) if traces else None
    meter_provider = _meter_provider(metrics, resource) if metrics else None
    install(tracer_provider, meter_provider)
    return tracer_provider is not None


def _tracer_provider(exporter: str, resource: Any) -> Any:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=resource, id_generator=_ids())
    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    return provider


def _meter_provider(exporter: str, resource: Any) -> Any:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        PeriodicExportingMetricReader,
    )

    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        reader = PeriodicExportingMetricReader(OTLPMetricExporter())
    else:
        reader = PeriodicExportingMetricReader(ConsoleMetricExporter())
    return MeterProvider(resource=resource, metric_readers=[reader])


def _ids() -> Any:
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class DerivedIds(RandomIdGenerator):
        """Random ids, except for the spans whose ids are derived from batchgen's."""

        def generate_trace_id(self) -> int:
            forced = _forced_ids.get()
            return forced[0] if forced else super().generate_trace_id()

        def generate_span_id(self) -> int:
            forced = _forced_ids.get()
            return forced[1] if forced else super().generate_span_id()

    return DerivedIds()


def install(tracer_provider: Any, meter_provider: Any = None) -> None:
    """Use these SDK providers (tests hand in one with an in-memory exporter; a tracer
    provider of their own should be built with :func:`id_generator`)."""
    global _state
    if tracer_provider is None and meter_provider is None:
        _state = None
        return
    from opentelemetry import trace

    tracer = (tracer_provider or trace.NoOpTracerProvider()).get_tracer("batchgen")
    state = _State(tracer, tracer_provider, meter_provider)
    if meter_provider is not None:
        meter = meter_provider.get_meter("batchgen")
        state.token_usage = meter.create_histogram(
            genai.TOKEN_USAGE,
            unit="{token}",
            description="Tokens per provider call, by gen_ai.token.type",
            explicit_bucket_boundaries_advisory=list(genai.TOKEN_BUCKETS),
        )
        state.duration_s = meter.create_histogram(
            genai.OPERATION_DURATION,
            unit="s",
            description="Duration of provider calls",
            explicit_bucket_boundaries_advisory=list(genai.DURATION_BUCKETS_S),
        )
        state.first_chunk_s = meter.create_histogram(
            genai.TIME_TO_FIRST_CHUNK,
            unit="s",
            description="Time to the first chunk of streamed provider calls",
            explicit_bucket_boundaries_advisory=list(genai.DURATION_BUCKETS_S),
        )
    _state = state


def id_generator() -> Any:
    """The id generator a tracer provider needs for batchgen's derived trace ids."""
    return _ids()


# How long a stopping process waits for its exporters to send what they hold: a
# collector that is away must not hold a worker's restart for the exporter's time-out.
SHUTDOWN_WAIT_S = 3.0


def shutdown(wait_s: float = SHUTDOWN_WAIT_S) -> None:
    """Flush and stop the exporters (a worker's shutdown), waiting at most ``wait_s``."""
    global _state
    state, _state = _state, None
    if state is None:
        return
    stopping = threading.Thread(target=_stop, args=(state,), name="otel-shutdown", daemon=True)
    stopping.start()
    stopping.join(wait_s)


def _stop(state: _State) -> None:
    for provider in (state.tracer_provider, state.meter_provider):
        if provider is not None:
            with contextlib.suppress(Exception):
                provider.shutdown()


def enabled() -> bool:
    return _state is not None and _state.tracer_provider is not None


# --- hooks at the edges of the worker path ----------------------------------------------


def submitted(batch_id: str, tenant: str, items: int, started_ns: int) -> None:
    """A batch was stored: its ``batchgen.submit`` span (each item's root links it)."""
    if _state is None or _state.tracer_provider is None:
        return
    span = _start_derived(
        "batchgen.submit",
        genai.batch_trace_ids(batch_id),
        {"batchgen.tenant": tenant, "batchgen.batch_id": batch_id, "batchgen.items": items},
        started_ns,
    )
    span.end()


def carry(options: dict[str, Any], *positional: Any) -> None:
    """Put the item's trace context in a ``generate`` message's headers: the context
    current in the item's trace when it retries itself, else a ``batchgen.dispatch``
    span's (a release)."""
    if _state is None or _state.tracer_provider is None:
        return
    # send_task(name, args, kwargs, **options), or its args and kwargs among the options
    args = (positional[0] if positional else options.get("args")) or []
    kwargs = (positional[1] if len(positional) > 1 else options.get("kwargs")) or {}
    ticket = kwargs.get("ticket") or {}
    if not args or not isinstance(ticket, dict) or "batch" not in ticket:
        return
    item_id, batch_id = int(args[0]), str(ticket["batch"])
    more = [entry for entry in kwargs.get("more") or () if _pack_entry(entry)]
    parent = _item_parent(batch_id, item_id)
    if parent is None:  # a retry, in the context its message carried: carry it on
        options["headers"] = _inject(options.get("headers"), None)
        carried = _pack_parents.get() or {}
        others = {str(i): carried[str(i)] for i, _ in more if str(i) in carried}
        if others:
            options["headers"][PACK_TRACEPARENTS] = others
        return
    pack_items = 1 + len(kwargs.get("more") or ())
    model = str(kwargs.get("model"))
    with _dispatch_span(batch_id, item_id, ticket, model, pack_items, parent):
        options["headers"] = _inject(options.get("headers"), None)
    others = {}
    for other_id, other_ticket in more:  # each item of a pack: a release in its own trace
        other_batch = str(other_ticket.get("batch") or batch_id)
        other_parent = _item_parent(other_batch, int(other_id))
        with _dispatch_span(
            other_batch, int(other_id), other_ticket, model, pack_items, other_parent
        ):
            others[str(other_id)] = _inject(None, None)[TRACEPARENT]
    if others:
        options["headers"][PACK_TRACEPARENTS] = others


def _pack_entry(entry: Any) -> bool:
    """A pack's other item as a message carries it: ``[id, ticket]``."""
    return (
        isinstance(entry, list | tuple)
        and len(entry) == 2
        and isinstance(entry[0], int)
        and isinstance(entry[1], dict)
    )


def _dispatch_span(
    batch_id: str, item_id: int, ticket: Mapping[str, Any], model: str, pack_items: int, parent: Any
) -> contextlib.AbstractContextManager[Any]:
    assert _state is not None
    attrs = {
        **genai.item_attributes(
            str(ticket.get("tenant_name") or ticket.get("tenant")),
            batch_id,
            item_id,
            int(ticket.get("attempt") or 0),
        ),
        "batchgen.model": model,
        "batchgen.pack_items": pack_items,
    }
    return _state.tracer.start_as_current_span("batchgen.dispatch", parent, attributes=attrs)


@contextlib.contextmanager
def _delivery(headers: Mapping[str, Any], pack: Mapping[str, str]) -> Iterator[None]:
    from opentelemetry import context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    token = context.attach(TraceContextTextMapPropagator().extract(headers))
    pack_token = _pack_parents.set(pack)
    try:
        yield
    finally:
        _pack_parents.reset(pack_token)
        context.detach(token)


def delivery(request: Any) -> contextlib.AbstractContextManager[None]:
    """The context a ``generate`` message carried, current while the task runs it."""
    if _state is None or _state.tracer_provider is None:
        return _NOTHING
    headers = getattr(request, "headers", None) or {}
    value = headers.get(TRACEPARENT) or getattr(request, TRACEPARENT, None)
    if not value:
        return _NOTHING
    pack = headers.get(PACK_TRACEPARENTS) or getattr(request, PACK_TRACEPARENTS, None)
    if not isinstance(pack, Mapping):
        pack = {}
    return _delivery(
        {TRACEPARENT: value}, {str(k): v for k, v in pack.items() if isinstance(v, str)}
    )


def attempt(
    item_id: int, batch_id: str, tenant: str, attempt_no: int, model: str
) -> contextlib.AbstractContextManager[Any]:
    """One delivery of an item (``batchgen.generate``), in the item's trace."""
    if _state is None or _state.tracer_provider is None:
        return _NOTHING
    attrs = {
        **genai.item_attributes(tenant, batch_id, item_id, attempt_no),
        "batchgen.model": model,
    }
    parent = _item_parent(batch_id, item_id)
    return _state.tracer.start_as_current_span("batchgen.generate", parent, attributes=attrs)


def gated(enter: Callable[..., T], *args: Any) -> T:
    """``enter(*args)``, the gate (token budget, slot), as a ``batchgen.budget`` span
    saying what it decided: pass (and the deployment), wait (and for how long), never."""
    if _state is None or _state.tracer_provider is None:
        return enter(*args)
    with _state.tracer.start_as_current_span("batchgen.budget") as span:
        decision = enter(*args)
        span.set_attribute("batchgen.budget.decision", type(decision).__name__.lower())
        wait_s = getattr(decision, "wait_s", None)
        if isinstance(wait_s, int | float):
            span.set_attribute("batchgen.budget.wait_s", float(wait_s))
        deployment = getattr(decision, "deployment", None)
        if isinstance(deployment, str):
            span.set_attribute("batchgen.deployment", deployment)
        return decision


@dataclass
class _FirstChunk:
    started_mono_s: float
    at_s: float | None = None


def called(described: Callable[[], CallInfo], complete: Callable[[Any], T], request: Any) -> T:
    """``complete(request)``, the provider call, as a client span in the GenAI
    conventions (``described()`` says what it is); a streamed call's time to its first
    chunk is measured too."""
    if _state is None:
        return complete(request)
    info = described()
    from opentelemetry.trace import SpanKind, Status, StatusCode

    state = _state
    first = _FirstChunk(time.monotonic())
    if getattr(request, "on_chunk", None) is not None:
        request = dataclasses.replace(request, on_chunk=_timing(request.on_chunk, first))
    metric_attrs = genai.metric_attributes(info)
    span_cm = (
        state.tracer.start_as_current_span(
            genai.span_name(info),
            kind=SpanKind.CLIENT,
            attributes=genai.request_attributes(info),
            record_exception=False,  # an exception's message may quote the request
            set_status_on_exception=False,
        )
        if state.tracer_provider is not None
        else _NOTHING
    )
    with span_cm as span:
        try:
            response = complete(request)
        except Exception as exc:
            kind = genai.error_type(exc)
            if span is not None:
                span.set_attribute("error.type", kind)
                span.set_status(Status(StatusCode.ERROR))
            _record_duration(state, first, {**metric_attrs, "error.type": kind})
            raise
        attrs = _response_attributes(info, response)
        if span is not None:
            span.set_attributes(attrs)
            if first.at_s is not None:
                span.set_attribute("batchgen.time_to_first_chunk_s", first.at_s)
        _record_call(state, first, metric_attrs, attrs)
        return response


def _timing(relay: Callable[[dict[str, Any]], None], first: _FirstChunk) -> Any:
    def on_chunk(chunk: dict[str, Any]) -> None:
        if first.at_s is None:
            first.at_s = time.monotonic() - first.started_mono_s
        relay(chunk)

    return on_chunk


def _response_attributes(info: CallInfo, response: Any) -> genai.Attributes:
    from batchgen.domain.billing import cost

    usage = cost.usage_of(response.prompt_tokens, response.completion_tokens, response.body)
    tier = cost.tier_of(False, response.body, info.tier)
    return genai.response_attributes(
        genai.response_model_of(response.body),
        response.request_id,
        response.finish_reason,
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.cached_tokens,
        cost.price_usage(usage, info.spec, tier),
    )


def _record_duration(state: _State, first: _FirstChunk, attrs: genai.Attributes) -> None:
    if state.duration_s is not None:
        state.duration_s.record(time.monotonic() - first.started_mono_s, attrs)


def _record_call(
    state: _State, first: _FirstChunk, metric_attrs: genai.Attributes, attrs: genai.Attributes
) -> None:
    if state.token_usage is None:
        return
    model = attrs.get("gen_ai.response.model")
    base = {**metric_attrs, "gen_ai.response.model": model} if model else metric_attrs
    _record_duration(state, first, base)
    for kind in ("input", "output"):
        tokens = attrs[f"gen_ai.usage.{kind}_tokens"]
        state.token_usage.record(tokens, {**base, "gen_ai.token.type": kind})
    if first.at_s is not None:
        state.first_chunk_s.record(first.at_s, base)


def ledgered(
    write: Callable[[], bool],
    described: Callable[[], CallInfo],
    created_at: dt.datetime,
    call_s: float,
) -> bool:
    """``write()``, the ledger write of an answer, as a ``batchgen.ledger`` span; once
    it recorded the answer, the item's root span (``batchgen.item``, from its submit)."""
    if _state is None or _state.tracer_provider is None:
        return write()
    with _state.tracer.start_as_current_span("batchgen.ledger") as span:
        recorded = write()
        span.set_attribute("batchgen.recorded", recorded)
    if recorded:
        _item_root(described(), int(created_at.timestamp() * 1e9), call_s)
    return recorded


def ended(
    batch_id: str, item_id: int, tenant: str, attempt_no: int, status: str, created_at: dt.datetime
) -> None:
    """An item ended without an answer (failed, expired, cancelled): its root span."""
    if _state is None or _state.tracer_provider is None:
        return
    attrs = {
        **genai.item_attributes(tenant, batch_id, item_id, attempt_no),
        "batchgen.status": status,
    }
    _emit_root(batch_id, item_id, attrs, int(created_at.timestamp() * 1e9))


# --- a pack's items, run side by side ---------------------------------------------


@dataclass(frozen=True)
class Packed:
    """One item of a pack run as a group: its ``batchgen.generate`` span, current on no
    thread but inside :func:`inside` (the pack's items share its threads)."""

    span: Any
    context: Any


def packed(
    item_id: int,
    batch_id: str,
    tenant: str,
    attempt_no: int,
    model: str,
    gated_ns: tuple[int, int],
    deployment: str,
) -> Packed | None:
    """Start a pack item's delivery span (``batchgen.generate``, from its entry at the
    gate) with its ``batchgen.budget`` span (the pack's entry pipeline, ``gated_ns``:
    its start and end, epoch ns), in the item's trace; None when tracing is off."""
    if _state is None or _state.tracer_provider is None:
        return None
    from opentelemetry import trace

    attrs = {
        **genai.item_attributes(tenant, batch_id, item_id, attempt_no),
        "batchgen.model": model,
    }
    parent = _item_parent(batch_id, item_id)
    span = _state.tracer.start_span(
        "batchgen.generate", parent, attributes=attrs, start_time=gated_ns[0]
    )
    context = trace.set_span_in_context(span, parent)
    gate_attrs = {"batchgen.budget.decision": "pass", "batchgen.deployment": deployment}
    budget = _state.tracer.start_span(
        "batchgen.budget", context, attributes=gate_attrs, start_time=gated_ns[0]
    )
    budget.end(end_time=gated_ns[1])
    return Packed(span, context)


def inside(item: Packed | None) -> contextlib.AbstractContextManager[None]:
    """The pack item's delivery span current on this thread meanwhile."""
    return _NOTHING if item is None else _inside(item)


@contextlib.contextmanager
def _inside(item: Packed) -> Iterator[None]:
    from opentelemetry import context

    token = context.attach(item.context)
    try:
        yield
    finally:
        context.detach(token)


def ledgered_packed(
    item: Packed | None,
    started_ns: int,
    described: Callable[[], CallInfo],
    created_at: dt.datetime,
    call_s: float,
) -> None:
    """The pack's group commit (from ``started_ns``) that recorded the item's answer, as
    its ``batchgen.ledger`` span, and the item's root span (as :func:`ledgered`)."""
    if item is None or _state is None or _state.tracer_provider is None:
        return
    span = _state.tracer.start_span("batchgen.ledger", item.context, start_time=started_ns)
    span.set_attribute("batchgen.recorded", True)
    span.end()
    _item_root(described(), int(created_at.timestamp() * 1e9), call_s)


def end(item: Packed | None) -> None:
    """End the pack item's delivery span."""
    if item is not None:
        item.span.end()


def _item_root(info: CallInfo, created_at_ns: int, call_s: float) -> None:
    attrs = {
        **genai.request_attributes(info),
        "batchgen.status": "succeeded",
        "batchgen.call_s": call_s,
    }
    _emit_root(info.batch_id, info.item_id, attrs, created_at_ns)


def _emit_root(batch_id: str, item_id: int, attrs: dict[str, Any], created_at_ns: int) -> None:
    """The item's root span, from its submit to now, linking its batch's submit span."""
    from opentelemetry.trace import Link, SpanContext, TraceFlags

    batch_trace, batch_span = genai.batch_trace_ids(batch_id)
    submit = SpanContext(batch_trace, batch_span, True, TraceFlags(TraceFlags.SAMPLED))
    ids = genai.item_trace_ids(batch_id, item_id)
    _start_derived("batchgen.item", ids, attrs, created_at_ns, [Link(submit)]).end()


# --- the item's trace ----------------------------------------------------------------


def _start_derived(
    name: str, ids: tuple[int, int], attrs: dict[str, Any], start_ns: int, links: Any = None
) -> Any:
    """Start a root span whose trace and span ids are ``ids``."""
    from opentelemetry.context import Context

    assert _state is not None
    token = _forced_ids.set(ids)
    try:
        return _state.tracer.start_span(
            name, Context(), attributes=attrs, start_time=start_ns, links=links
        )
    finally:
        _forced_ids.reset(token)


def _item_parent(batch_id: str, item_id: int) -> Any:
    """The current context if it is in the item's trace (a message's header, an outer
    span), else the item's root span as a remote parent."""
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    trace_id, span_id = genai.item_trace_ids(batch_id, item_id)
    if trace.get_current_span().get_span_context().trace_id == trace_id:
        return None  # the current context
    carried = (_pack_parents.get() or {}).get(str(item_id))
    if carried is not None:  # one of the pack's other items: the release that sent it
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract({TRACEPARENT: carried})
        if trace.get_current_span(parent).get_span_context().trace_id == trace_id:
            return parent
    root = SpanContext(trace_id, span_id, True, TraceFlags(TraceFlags.SAMPLED))
    return trace.set_span_in_context(NonRecordingSpan(root))


def _inject(headers: Mapping[str, Any] | None, parent: Any) -> dict[str, Any]:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    out = dict(headers or {})
    out.pop(TRACEPARENT, None)
    TraceContextTextMapPropagator().inject(out, parent)
    return out


_NOTHING: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
