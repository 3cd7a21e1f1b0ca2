"""The simulator's aiohttp application: OpenAI and Anthropic chat endpoints, OpenAI's
Responses API and embeddings (:mod:`batchgen.simulator.sim_endpoints`), their batch APIs
(:mod:`batchgen.simulator.batch_jobs`), plus /_sim.

Limits are enforced per (API key, model), by a sliding window (charge: tiktoken
prompt tokens + max_tokens) or a token bucket (charge: ceil(body bytes / 4) +
max_tokens), see :mod:`batchgen.simulator.sim_config`; under ``/d/<name>/`` every chat
route is a simulated deployment with limits and faults of its own
(:mod:`batchgen.simulator.lanes`). Every answer of the chat endpoints
carries the request id header and, once the model is known, the rate-limit
headers of its API. Faults come from :class:`~batchgen.simulator.faults.FaultInjector`
(``x-sim-fault`` header forces one). Log lines carry ids, sizes and token
counts only, never prompt or completion text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from batchgen.domain.formats.tokens import count_text, get_encoding
from batchgen.simulator import bedrock_batches, counting, gemini_batches, native, rich
from batchgen.simulator import flex as flex_tier
from batchgen.simulator import formats as fmt
from batchgen.simulator import native_errors as errors
from batchgen.simulator import sim_endpoints as other
from batchgen.simulator.batch_jobs import add_batch_routes
from batchgen.simulator.faults import status_fault_answer
from batchgen.simulator.formats import BadRequest, ChatRequest
from batchgen.simulator.lanes import Lane
from batchgen.simulator.limits import Admission
from batchgen.simulator.sim_admin import add_admin_routes
from batchgen.simulator.sim_config import SimulatorConfig
from batchgen.simulator.state import STATE, LimitKey, SimState, key_id
from batchgen.simulator.text import completion_text, split_chunks

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024
JSON = "application/json"


# What a request to each endpoint is (its API's formats; chat, responses, embeddings).
CHAT, RESPONSES, EMBEDDINGS = "chat", "responses", "embeddings"


@dataclass
class _Call:
    """One request in progress (chat, or OpenAI's responses or embeddings)."""

    api: str
    rid: str
    entry: dict[str, Any]
    headers: dict[str, str]
    lane: Lane
    endpoint: str = CHAT
    key: LimitKey | None = None
    prompt_tokens: int = 0
    body_bytes: int = 0
    delivered_tokens: int = 0
    sent: list[str] = field(default_factory=list)
    # The flex tier this call holds a place in (None: a standard call, or refused).
    flex: flex_tier.FlexTier | None = None
    # Gemini's and Bedrock's streamed routes (their body has no stream flag).
    native_stream: bool = False

    @property
    def admitted(self) -> bool:
        return bool(self.entry["admitted"])


def _api_key(request: web.Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    for name in ("x-api-key", "api-key", "x-goog-api-key"):
        if request.headers.get(name):
            return request.headers[name]
    return None


def _json(call: _Call, status: int, body: Any, extra: dict[str, str] | None = None) -> web.Response:
    call.entry["status"] = status
    call.entry["completed"] = True
    extra = dict(extra or {})
    if call.api in errors.NATIVE_APIS and status >= 400:
        extra.update(errors.error_headers(call.api, body))
        if call.api == errors.GEMINI and status == 429 and "retry-after-ms" in extra:
            body = errors.with_retry_info(body, int(extra["retry-after-ms"]) / 1000)
    return web.json_response(body, status=status, headers={**call.headers, **extra})


def _error(call: _Call, status: int, message: str, **kw: Any) -> web.Response:
    return _json(call, status, fmt.error_body(call.api, status, message, **kw))


def _rl_headers(state: SimState, call: _Call, req: Admission, tok: Admission) -> None:
    lane = call.lane
    call.headers.update(
        fmt.ratelimit_headers(call.api, (lane.requests.limit, req), (lane.tokens.limit, tok))
    )


def _parse(call: _Call, state: SimState, body: Any) -> ChatRequest:
    if call.endpoint == RESPONSES:
        return other.parse_responses(body, state.config.default_max_tokens)
    if call.endpoint == EMBEDDINGS:
        return other.parse_embeddings(body)
    if call.api == "anthropic":
        return fmt.parse_anthropic(body)
    if call.api in errors.NATIVE_APIS:
        parse = native.parse_gemini if call.api == errors.GEMINI else native.parse_bedrock
        return parse(body, call.entry["model"], call.native_stream, state.config.default_max_tokens)
    return fmt.parse_openai(body, state.config.default_max_tokens)


def _prompt_tokens(call: _Call, body: Any, req: ChatRequest, encoding: str) -> int:
    """The request's prompt as its provider counts it."""
    if call.endpoint == RESPONSES:
        return other.responses_prompt_tokens(body, req.prompt_messages, encoding)
    if call.endpoint == EMBEDDINGS:
        return other.embeddings_prompt_tokens(body, encoding)
    if call.api in errors.NATIVE_APIS:  # counted on the chat form it was read into
        return counting.prompt_tokens(call.api, req.body, req.prompt_messages, encoding)
    return counting.prompt_tokens(call.api, body, req.prompt_messages, encoding)


REQUEST_ID_HEADER = {"anthropic": "request-id", "bedrock": "x-amzn-RequestId"}


async def _chat(
    request: web.Request,
    api: str,
    model: str | None = None,
    endpoint: str = CHAT,
    stream: bool = False,
) -> web.StreamResponse:
    state = request.app[STATE]
    name = request.match_info.get("lane")
    lane = state.lane(name)
    if lane is None:
        body = fmt.error_body(api, 404, f"no simulated deployment {name!r}")
        return web.json_response(body, status=404)
    rid = other.new_response_id() if endpoint == RESPONSES else fmt.new_id(api)
    item = request.headers.get("x-batchgen-item")
    call = _Call(
        api,
        rid,
        state.start(api, rid, item, request.remote, name),
        {REQUEST_ID_HEADER.get(api, "x-request-id"): rid},
        lane,
        endpoint,
        native_stream=stream,
    )
    call.entry["endpoint"] = endpoint
    if api in errors.NATIVE_APIS:
        call.entry["model"] = model
    try:
        return await _serve(request, state, call, model)
    except asyncio.CancelledError:  # the client went away (handler cancellation)
        call.entry["completed"] = False
        raise
    finally:
        if call.admitted and call.key is not None:
            if call.entry["stream"] and call.sent:
                call.delivered_tokens = count_text("".join(call.sent), state.config.encoding)
            call.entry["completion_tokens"] = call.delivered_tokens
            call.entry["charged_tokens"] = state.settle(
                call.key, rid, call.prompt_tokens, call.delivered_tokens, call.lane
            )
        if call.flex is not None:
            call.flex.leave(call.lane.name)
        state.finish(call.entry)
        e = call.entry
        log.debug(
            "sim %s api=%s model=%s item=%s status=%s stream=%s completed=%s fault=%s "
            "prompt_tokens=%s completion_tokens=%s",
            rid,
            api,
            e["model"],
            e["item"],
            e["status"],
            e["stream"],
            e["completed"],
            e["fault"],
            e["prompt_tokens"],
            e["completion_tokens"],
        )


async def _serve(
    request: web.Request, state: SimState, call: _Call, model: str | None
) -> web.StreamResponse:
    raw = await request.read()
    call.body_bytes = len(raw)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        state.counters["bad_requests"] += 1
        return _error(call, 400, "request body is not valid UTF-8 JSON")
    if model is not None and isinstance(body, dict) and call.api not in errors.NATIVE_APIS:
        body["model"] = model  # Azure: the deployment is the model
    state.last_request[call.api if call.endpoint == CHAT else call.endpoint] = body
    try:
        req = _parse(call, state, body)
    except BadRequest as exc:
        state.counters["bad_requests"] += 1
        return _error(call, 400, exc.message, param=exc.param, code=exc.code)
    cfg = state.config
    entry = call.entry
    entry.update(model=req.model, stream=req.stream)
    state.models.setdefault(req.model)
    call.key = (key_id(_api_key(request)), req.model)
    entry["key"] = call.key[0]
    # Counted the providers' way: message text, and images, tools and response_format.
    call.prompt_tokens = entry["prompt_tokens"] = _prompt_tokens(call, body, req, cfg.encoding)
    try:
        fault = call.lane.fault(request.headers.get("x-sim-fault"))
    except ValueError as exc:
        state.counters["bad_requests"] += 1
        return _error(call, 400, str(exc))
    if cfg.context_window is not None and call.prompt_tokens > cfg.context_window:
        state.counters["bad_requests"] += 1
        _rl_headers(state, call, *state.peek(call.key, call.lane))
        return _error(
            call,
            400,
            fmt.context_length_message(call.api, cfg.context_window, call.prompt_tokens),
            param="messages",
            code="context_length_exceeded",
        )
    entry["fault"] = fault
    if fault:
        state.counters[f"fault_{fault}"] += 1
    if fault == "429":
        state.counters["rate_limited"] += 1
        _rl_headers(state, call, *state.peek(call.key, call.lane))
        body = fmt.error_body(
            call.api, 429, "Rate limit reached (simulated).", code="rate_limit_exceeded"
        )
        return _json(call, 429, body, fmt.retry_headers(1.0))
    if fault is not None and fault.startswith("status:"):
        status, body, extra = status_fault_answer(
            call.api, fault, call.prompt_tokens, cfg.context_window
        )
        state.counters["rate_limited" if status == 429 else "errors"] += 1
        _rl_headers(state, call, *state.peek(call.key, call.lane))
        return _json(call, status, body, extra)
    return await _admit_and_answer(request, state, call, req, fault)


async def _admit_and_answer(
    request: web.Request, state: SimState, call: _Call, req: ChatRequest, fault: str | None
) -> web.StreamResponse:
    cfg = state.config
    scope = call.key or ("anonymous", req.model)  # its limits' key, its caches' scope
    wants_flex = call.endpoint != EMBEDDINGS and flex_tier.requested(call.api, req.body)
    call.entry["service_tier"] = flex_tier.FLEX if wants_flex else None
    if wants_flex and state.flex.refuses(
        call.lane.name, cfg.flex_max_in_flight, cfg.flex_refusal_rate
    ):
        state.counters["flex_refused"] += 1  # before the limits: nothing is charged
        _rl_headers(state, call, *state.peek(scope, call.lane))
        return _json(call, *flex_tier.refusal(call.api))
    amount = state.charge(call.prompt_tokens, call.body_bytes, req.max_tokens, call.lane)
    call.entry["requested_tokens"] = amount
    req_adm, tok_adm = state.admit(call.key, amount, call.rid, call.lane)  # type: ignore[arg-type]
    _rl_headers(state, call, req_adm, tok_adm)
    if not (req_adm.ok and tok_adm.ok):
        state.counters["rate_limited"] += 1
        return _rate_limited(state, call, req, amount, req_adm, tok_adm)
    call.entry["admitted"] = True
    state.counters["admitted"] += 1
    state.counters["tokens_admitted"] += amount
    slow = 1.0
    if wants_flex:
        call.flex = state.flex
        call.flex.enter(call.lane.name)
        state.counters["flex_admitted"] += 1
        slow = cfg.flex_latency_factor
    if call.endpoint == EMBEDDINGS:  # no output
        text, ctoks, finish = "", 0, "stop"
    else:
        text, ctoks, finish = completion_text(req.prompt_messages, req.max_tokens, cfg.encoding)
    call.entry["finish_reason"] = finish
    base_ms = cfg.latency_base_ms + call.lane.faults.jitter_ms(cfg.latency_jitter_ms)
    first_s = slow * base_ms / 1000
    tokens_s = slow * cfg.latency_per_token_ms * ctoks / 1000
    if fault == "hang":
        await asyncio.sleep(cfg.hang_s)
    if fault == "5xx":
        await asyncio.sleep(first_s)
        state.counters["errors"] += 1
        status = call.lane.faults.server_error_status(call.api)
        return _error(
            call, status, "The server had an error while processing your request (simulated)."
        )
    if call.api in errors.NATIVE_APIS:
        answer = rich.RichAnswer(
            "openai",
            req.body,
            call.rid,
            req.model,
            (text, ctoks, finish),
            call.prompt_tokens,
            state.prompt_cache,
            cfg.encoding,
            0,
            scope,
        )
        call.entry["finish_reason"] = answer.finish
        return await _native_answer(request, state, call, req, answer, fault, (first_s, tokens_s))
    if call.endpoint != CHAT:
        delay_s = first_s + tokens_s
        return await _other_answer(request, state, call, req, (text, ctoks, finish), fault, delay_s)
    cached = (
        rich.openai_cached_tokens(state.prompt_cache, scope, req.body, cfg.encoding)
        if call.api == "openai"
        else 0
    )
    if fault not in ("reset", "malformed") and rich.wants_rich(
        call.api, req.body, req.model, cached
    ):
        answer = rich.RichAnswer(
            call.api,
            req.body,
            call.rid,
            req.model,
            (text, ctoks, finish),
            call.prompt_tokens,
            state.prompt_cache,
            cfg.encoding,
            cached,
            scope,
        )
        call.entry["finish_reason"] = answer.finish
        await asyncio.sleep(first_s + (0 if req.stream else tokens_s))
        call.delivered_tokens = ctoks
        if req.stream:
            return await _stream_rich(request, call, req, answer, tokens_s)
        if call.api == "anthropic":
            return _json(call, 200, answer.anthropic_message())
        return _json(call, 200, _tiered(call, answer.openai_completion(int(time.time()))))
    if req.stream:
        return await _stream(request, state, call, req, (text, ctoks, finish), first_s, fault)
    if fault == "reset":
        await asyncio.sleep(first_s)
        state.counters["errors"] += 1
        return _abort(request, call)
    await asyncio.sleep(first_s + tokens_s)
    call.delivered_tokens = ctoks
    if fault == "malformed":
        state.counters["errors"] += 1
        call.entry.update(status=200, completed=True)
        return web.Response(
            status=200,
            headers=call.headers,
            content_type="application/json",
            text='{"id": "' + call.rid + '", "object": "chat.compl',
        )
    if call.api == "anthropic":
        body = fmt.anthropic_message(call.rid, req.model, text, finish, call.prompt_tokens, ctoks)
        return _json(call, 200, body)
    body = fmt.openai_completion(call.rid, req.model, text, finish, call.prompt_tokens, ctoks)
    return _json(call, 200, _tiered(call, body))


def _tiered(call: _Call, body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI answer says the tier it was served at when it was flex (the provider
    bills it at the batch prices)."""
    if call.flex is not None:
        body["service_tier"] = flex_tier.FLEX
    return body


async def _other_answer(
    request: web.Request,
    state: SimState,
    call: _Call,
    req: ChatRequest,
    answer: tuple[str, int, str],
    fault: str | None,
    delay_s: float,
) -> web.StreamResponse:
    """A Response or an embeddings list, after its latency (or the fault asked for)."""
    if fault == "reset":
        await asyncio.sleep(delay_s)
        state.counters["errors"] += 1
        return _abort(request, call)
    await asyncio.sleep(delay_s)
    call.delivered_tokens = answer[1]
    if fault == "malformed":
        state.counters["errors"] += 1
        call.entry.update(status=200, completed=True)
        cut = '{"id": "' + call.rid + '", "object": "respo'
        return web.Response(
            status=200, headers=call.headers, content_type="application/json", text=cut
        )
    if call.endpoint == EMBEDDINGS:
        return _json(call, 200, other.embedding_list(req, call.prompt_tokens))
    scope = call.key or ("anonymous", req.model)
    cached = rich.openai_cached_tokens(
        state.prompt_cache, scope, {"messages": req.prompt_messages}, state.config.encoding
    )
    body = other.response_object(call.rid, req, answer, call.prompt_tokens, cached)
    return _json(call, 200, _tiered(call, body))


def _rate_limited(
    state: SimState,
    call: _Call,
    req: ChatRequest,
    amount: int,
    req_adm: Admission,
    tok_adm: Admission,
) -> web.Response:
    cfg = state.config
    lane = call.lane
    failing = [
        (a.retry_after_s, what, limit, a, n)
        for what, limit, a, n in (
            ("requests", lane.requests.limit, req_adm, 1),
            ("tokens", lane.tokens.limit, tok_adm, amount),
        )
        if not a.ok
    ]
    retry, what, limit, adm, requested = max(failing, key=lambda f: f[0])
    if retry == float("inf"):
        retry = cfg.window_s
        message = fmt.rate_limit_message(req.model, what, limit, None, requested, None)
    else:
        used = (limit or 0) - adm.remaining
        message = fmt.rate_limit_message(req.model, what, limit, used, requested, retry)
    body = fmt.error_body(
        call.api,
        429,
        message,
        kind=None if call.api == "anthropic" else what,
        code="rate_limit_exceeded",
    )
    return _json(call, 429, body, fmt.retry_headers(retry))


def _abort(request: web.Request, call: _Call) -> web.StreamResponse:
    """Reset the connection without an answer (the returned response is never sent)."""
    if request.transport is not None:
        request.transport.abort()
    call.entry.update(status=None, completed=False)
    return web.Response(status=500)


# A paced stream's writes are at most this often: each carries the chunks due by then.
STREAM_PACE_S = 0.01


async def _stream(
    request: web.Request,
    state: SimState,
    call: _Call,
    req: ChatRequest,
    answer: tuple[str, int, str],
    first_s: float,
    fault: str | None,
) -> web.StreamResponse:
    text, ctoks, finish = answer
    api, rid, model = call.api, call.rid, req.model
    chunks = split_chunks(text)
    per_chunk_s = state.config.latency_per_token_ms * ctoks / len(chunks) / 1000
    resp = web.StreamResponse(
        status=200,
        headers={**call.headers, "content-type": "text/event-stream", "cache-control": "no-cache"},
    )
    # With no fault mid-stream, events are gathered and written together, as a fast
    # server's share TCP segments: all in one write if nothing paces them (no per-token
    # latency), else at most every STREAM_PACE_S, each write carrying the chunks due by
    # then, none before its time; the first goes at its own time.
    gathered = fault is None
    paced = gathered and per_chunk_s > 0
    pending: list[bytes] = []
    pending_pieces: list[str] = []  # the text in ``pending``: sent (delivered) once written
    owed_s = 0.0  # the pacing not yet slept

    async def emit(data: bytes) -> None:
        if gathered:
            pending.append(data)
        else:
            await resp.write(data)

    async def flush() -> None:
        if pending:
            await resp.write(b"".join(pending))
            pending.clear()
        call.sent.extend(pending_pieces)
        pending_pieces.clear()

    await asyncio.sleep(first_s)
    try:
        await resp.prepare(request)
        call.entry["status"] = 200
        if api == "anthropic":
            for name, data in fmt.anthropic_start_events(rid, model, call.prompt_tokens):
                await emit(fmt.sse(api, name, data))
        else:
            first = fmt.openai_chunk(
                rid,
                model,
                {"role": "assistant", "content": "", "refusal": None},
                None,
                req.include_usage,
            )
            await emit(fmt.sse(api, "", first))
            delta_event = fmt.openai_delta_events(rid, model, req.include_usage)
        if paced:
            await flush()
        for i, piece in enumerate(chunks):
            due_now = False
            if paced:
                owed_s += per_chunk_s
                if i == 0 or owed_s >= STREAM_PACE_S:
                    await asyncio.sleep(owed_s)
                    owed_s, due_now = 0.0, True
            elif not gathered:
                await asyncio.sleep(per_chunk_s)
            if fault == "reset" and i == len(chunks) // 2:
                state.counters["errors"] += 1
                _abort(request, call)
                return resp
            if fault == "malformed" and i == min(1, len(chunks) - 1):
                state.counters["errors"] += 1
                event = b"event: content_block_delta\n" if api == "anthropic" else b""
                await resp.write(event + b'data: {"id": "' + rid.encode() + b'", "delta": {\n\n')
                await resp.write_eof()
                call.entry["completed"] = True
                return resp
            if api == "anthropic":
                name, data = fmt.anthropic_delta_event(piece)
                await emit(fmt.sse(api, name, data))
            else:
                await emit(delta_event(piece))
            if gathered:
                pending_pieces.append(piece)
                if due_now:  # with the chunks gathered since the last write
                    await flush()
            else:
                call.sent.append(piece)
        if owed_s > 0:
            await asyncio.sleep(owed_s)  # the last chunks' time
        if api == "anthropic":
            for name, data in fmt.anthropic_end_events(finish, call.prompt_tokens, ctoks):
                await emit(fmt.sse(api, name, data))
        else:
            await emit(
                fmt.sse(api, "", fmt.openai_chunk(rid, model, {}, finish, req.include_usage))
            )
            if req.include_usage:
                usage = fmt.openai_usage_chunk(rid, model, call.prompt_tokens, ctoks)
                await emit(fmt.sse(api, "", _tiered(call, usage)))
            await emit(fmt.sse(api, "", "[DONE]"))
        await flush()
        await resp.write_eof()
        call.entry["completed"] = True
    except ConnectionResetError:  # client closed the stream (no handler cancellation)
        call.entry["completed"] = False
    return resp


async def _stream_rich(
    request: web.Request, call: _Call, req: ChatRequest, answer: rich.RichAnswer, tokens_s: float
) -> web.StreamResponse:
    """A rich answer (:mod:`batchgen.simulator.rich`) as its stream, chunk by chunk: the
    first event at once (the base latency is spent), the answer's per-token time spread
    evenly over the gaps between the rest, as a provider's tokens come."""
    resp = web.StreamResponse(
        status=200,
        headers={**call.headers, "content-type": "text/event-stream", "cache-control": "no-cache"},
    )
    if call.api == "anthropic":
        events = [fmt.sse("anthropic", name, data) for name, data in answer.anthropic_events()]
    else:
        chunks = answer.openai_chunks(int(time.time()), req.include_usage)
        events = [
            fmt.sse("openai", "", _tiered(call, chunk) if chunk.get("usage") else chunk)
            for chunk in chunks
        ]
        events.append(fmt.sse("openai", "", "[DONE]"))
    gap_s = tokens_s / max(1, len(events) - 1)
    try:
        await resp.prepare(request)
        call.entry["status"] = 200
        for i, event in enumerate(events):
            if i and gap_s > 0:
                await asyncio.sleep(gap_s)
            await resp.write(event)
        await resp.write_eof()
        call.entry["completed"] = True
    except ConnectionResetError:  # client closed the stream
        call.entry["completed"] = False
    return resp


async def _native_answer(
    request: web.Request,
    state: SimState,
    call: _Call,
    req: ChatRequest,
    answer: rich.RichAnswer,
    fault: str | None,
    delays_s: tuple[float, float],
) -> web.StreamResponse:
    """A Gemini or Bedrock answer (plain, or its stream), after its latency."""
    first_s, tokens_s = delays_s
    completion = answer.openai_completion(int(time.time()))
    await asyncio.sleep(first_s + (0 if req.stream else tokens_s))
    if fault == "reset":
        state.counters["errors"] += 1
        return _abort(request, call)
    call.delivered_tokens = answer.ctoks
    if fault == "malformed":
        state.counters["errors"] += 1
        call.entry.update(status=200, completed=True)
        cut = '{"candidates": [{"content": {"parts": [{"te'
        return web.Response(status=200, headers=call.headers, content_type=JSON, text=cut)
    gemini = call.api == errors.GEMINI
    if not req.stream:
        body = (
            native.gemini_response(completion, call.rid, req.model)
            if gemini
            else native.bedrock_response(completion)
        )
        return _json(call, 200, body)
    if gemini:
        events = [native.sse(c) for c in native.gemini_stream(completion, call.rid, req.model)]
        kind = "text/event-stream"
    else:
        events = [native.bedrock_event(k, e) for k, e in native.bedrock_events(completion)]
        kind = "application/vnd.amazon.eventstream"
    resp = web.StreamResponse(status=200, headers={**call.headers, "content-type": kind})
    gap_s = tokens_s / max(1, len(events) - 1)
    try:
        await resp.prepare(request)
        call.entry["status"] = 200
        for i, event in enumerate(events):
            if i and gap_s > 0:
                await asyncio.sleep(gap_s)
            await resp.write(event)
        await resp.write_eof()
        call.entry["completed"] = True
    except ConnectionResetError:  # client closed the stream
        call.entry["completed"] = False
    return resp


def _gemini_call(request: web.Request) -> tuple[str, str]:
    """``(model, method)`` of a Gemini route's ``models/{model}:{method}``."""
    model, _, method = request.match_info["call"].rpartition(":")
    return model, method


async def _gemini(request: web.Request) -> web.StreamResponse:
    """``generateContent``, ``streamGenerateContent`` (``?alt=sse``), ``countTokens``,
    ``embedContent`` and ``batchEmbedContents`` of the Gemini API and Vertex AI."""
    model, method = _gemini_call(request)
    if method == "generateContent":
        return await _chat(request, errors.GEMINI, model)
    if method == "batchGenerateContent":
        return await gemini_batches.create(request, model)
    if method == "streamGenerateContent":
        if request.query.get("alt") != "sse":
            body = errors.error_body(errors.GEMINI, 400, "the simulator streams with alt=sse only")
            return web.json_response(body, status=400)
        return await _chat(request, errors.GEMINI, model, stream=True)
    state = request.app[STATE]
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        return web.json_response(errors.error_body(errors.GEMINI, 400, "not JSON"), status=400)
    encoding = state.config.encoding
    if method == "countTokens":
        try:
            req = native.parse_gemini(body, model, False, 1)
        except BadRequest as exc:
            return web.json_response(errors.error_body(errors.GEMINI, 400, exc.message), status=400)
        total = counting.prompt_tokens(errors.GEMINI, req.body, req.prompt_messages, encoding)
        return web.json_response({"totalTokens": total})
    if method in ("embedContent", "batchEmbedContents"):
        texts = native.gemini_texts(body)
        size = native.EMBEDDING_DIMENSIONS
        first = (body.get("requests") or [body])[0]
        size = first.get("outputDimensionality") or size
        vectors = [{"values": native.embedding(t, size)} for t in texts]
        state.counters["embeddings"] += len(texts)
        if method == "embedContent":
            return web.json_response({"embedding": vectors[0]})
        return web.json_response({"embeddings": vectors})
    body = errors.error_body(errors.GEMINI, 404, f"method {method!r} is not served")
    return web.json_response(body, status=404)


async def _oauth_token(request: web.Request) -> web.Response:
    """Google's OAuth 2.0 token endpoint for a service account's signed JWT (the
    ``jwt-bearer`` grant): an access token for an hour (the assertion is not verified)."""
    form = await request.post()
    if form.get("grant_type") != "urn:ietf:params:oauth:grant-type:jwt-bearer" or not form.get(
        "assertion"
    ):
        return web.json_response({"error": "invalid_grant"}, status=400)
    state = request.app[STATE]
    state.counters["oauth_tokens"] += 1
    token = "ya29.sim-" + fmt.new_id("openai").removeprefix("chatcmpl-")
    return web.json_response({"access_token": token, "expires_in": 3600, "token_type": "Bearer"})


async def _bedrock_converse(request: web.Request) -> web.StreamResponse:
    return await _chat(request, errors.BEDROCK, request.match_info["model"])


async def _bedrock_converse_stream(request: web.Request) -> web.StreamResponse:
    return await _chat(request, errors.BEDROCK, request.match_info["model"], stream=True)


async def _openai_chat(request: web.Request) -> web.StreamResponse:
    return await _chat(request, "openai")


async def _anthropic_messages(request: web.Request) -> web.StreamResponse:
    return await _chat(request, "anthropic")


async def _openai_responses(request: web.Request) -> web.StreamResponse:
    return await _chat(request, "openai", endpoint=RESPONSES)


async def _openai_embeddings(request: web.Request) -> web.StreamResponse:
    return await _chat(request, "openai", endpoint=EMBEDDINGS)


async def _azure_chat(request: web.Request) -> web.StreamResponse:
    """Azure OpenAI's classic route: the deployment names the model; ``api-version`` required."""
    if not request.query.get("api-version"):
        return web.json_response(
            {"error": {"code": "404", "message": "Resource not found"}}, status=404
        )
    return await _chat(request, "openai", request.match_info["deployment"])


def create_app(config: SimulatorConfig | None = None) -> web.Application:
    """The simulator as an aiohttp application (the config is copied, not shared)."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[STATE] = SimState(dataclasses.replace(config or SimulatorConfig()))
    get_encoding(app[STATE].config.encoding)  # loaded now, not inside the first answer
    for prefix in ("", "/d/{lane}"):  # the root lane, and simulated deployments
        app.router.add_post(f"{prefix}/v1/chat/completions", _openai_chat)
        app.router.add_post(f"{prefix}/v1/messages", _anthropic_messages)
        app.router.add_post(f"{prefix}/v1/responses", _openai_responses)
        app.router.add_post(f"{prefix}/v1/embeddings", _openai_embeddings)
        azure = f"{prefix}/openai/deployments/{{deployment}}/chat/completions"
        app.router.add_post(azure, _azure_chat)
        # Gemini API and Vertex AI (any API version), Bedrock's runtime.
        app.router.add_post(prefix + "/{version}/models/{call}", _gemini)
        vertex = "/{version}/projects/{project}/locations/{location}/publishers/google/models/"
        app.router.add_post(prefix + vertex + "{call}", _gemini)
        app.router.add_post(prefix + "/model/{model}/converse", _bedrock_converse)
        app.router.add_post(prefix + "/model/{model}/converse-stream", _bedrock_converse_stream)
    app.router.add_post("/token", _oauth_token)
    add_batch_routes(app)
    gemini_batches.add_routes(app)
    bedrock_batches.add_routes(app)
    add_admin_routes(app)
    return app
