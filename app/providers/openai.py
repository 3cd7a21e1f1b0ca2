"""OpenAI-compatible adapter on the official ``openai`` SDK (any ``base_url``).

SDK retries are off: retry timing belongs to :mod:`batchgen.domain.lifecycle.retry` and the
dispatcher, which also honour the item's deadline.

A model (or deployment) of provider ``"azure"`` is called through the SDK's
``AzureOpenAI`` client: ``base_url`` is the resource's endpoint, the deployment
(``azure_deployment``, default the model's name) goes in the path, ``api_version``
in the query and the key in the ``api-key`` header. So does a ``base_url`` with an
``api-version`` query (``https://RES.openai.azure.com/openai?api-version=2024-10-21``):
then the model name is the deployment (``/openai/deployments/<model>/chat/completions``).
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import httpx2
import openai
import pydantic
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from batchgen import json_codec
from batchgen.domain.formats.answers import OpenAIMerge
from batchgen.domain.formats.endpoints import CHAT_COMPLETIONS, EMBEDDINGS, provider_path
from batchgen.domain.formats.tokens import count_messages, count_text
from batchgen.domain.scheduling.rate_limits import RateLimitState
from batchgen.errors import MalformedResponse, ProviderError
from batchgen.providers import lean_http
from batchgen.providers.base import (
    ITEM_HEADER,
    ProviderRequest,
    ProviderResponse,
    StreamWatch,
    cancelled_before_call,
    chat_params,
    classify_status,
    safe_code,
    sse_data,
    status_message,
    transport_error,
    unsendable,
    unusable_client,
)
from batchgen.providers.headers import openai_rate_limits
from batchgen.registry import ModelSpec, ProviderKind

__all__ = ["ITEM_HEADER", "OpenAIProvider", "classify_status", "endpoint_answer", "translate"]

# Body fields the adapter sets itself, and an Anthropic request's own parameters
# (kept for the Anthropic adapter: message_batches.NATIVE_PARAMS).
_OWN_FIELDS = ("model", "messages", "stream", "stream_options", "anthropic_params")
# Body fields of a Responses or embeddings request the adapter sets itself.
_ENDPOINT_OWN_FIELDS = ("model", "stream", "stream_options")
_MALFORMED = (json.JSONDecodeError, UnicodeDecodeError, pydantic.ValidationError)
_SDK_ERRORS: tuple[type[BaseException], ...] = (
    openai.OpenAIError,
    httpx2.HTTPError,
    *lean_http.transport_errors,
    *_MALFORMED,
)


@functools.cache
def sdk_client(base_url: str, api_key: str) -> openai.OpenAI:
    # One client (one connection pool) per endpoint and process; thread-safe.
    parts = urlsplit(base_url)
    query = dict(parse_qsl(parts.query))
    api_version = query.pop("api-version", None)
    if api_version is not None:
        bare = urlunsplit(parts._replace(query=""))
        return openai.AzureOpenAI(
            base_url=bare,
            api_version=api_version,
            api_key=api_key,
            default_query=query or None,
            max_retries=0,
        )
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


@functools.cache
def azure_client(endpoint: str, deployment: str, api_version: str, api_key: str) -> openai.OpenAI:
    # One client per Azure deployment and process (the deployment is in its base URL).
    return openai.AzureOpenAI(
        azure_endpoint=endpoint,
        azure_deployment=deployment,
        api_version=api_version,
        api_key=api_key,
        max_retries=0,
    )


def client_for(spec: ModelSpec) -> openai.OpenAI:
    """The SDK client of ``spec``'s endpoint (an Azure deployment's, or any other)."""
    if spec.provider is ProviderKind.AZURE:
        deployment = spec.azure_deployment or spec.name
        return azure_client(spec.base_url, deployment, spec.api_version or "", spec.api_key())
    return sdk_client(spec.base_url, spec.api_key())


def _error_code(exc: openai.APIStatusError) -> str | None:
    code = safe_code(exc.code)
    if code is None and isinstance(exc.body, dict):
        code = safe_code(exc.body.get("code")) or safe_code(exc.body.get("type"))
    return code


def translate(exc: BaseException, *, in_stream: bool = False) -> ProviderError:
    """Map an SDK (or raw decoding) exception to the project's error tree (no text)."""
    if isinstance(exc, openai.APIStatusError):
        code = _error_code(exc)
        # Inspected for context-length wording only (Ollama sends a bare string).
        provider_message = exc.body.get("message") if isinstance(exc.body, dict) else exc.body
        return classify_status(
            exc.status_code,
            status_message(exc.status_code, exc, code, exc.response.headers.get("x-request-id")),
            exc.response.headers,
            code,
            provider_message=provider_message if isinstance(provider_message, str) else None,
        )
    if isinstance(exc, (openai.APIResponseValidationError, httpx2.DecodingError, *_MALFORMED)):
        return MalformedResponse(f"malformed response ({type(exc).__name__})", billed=True)
    if isinstance(exc, openai.APIError) and not isinstance(exc, openai.APIConnectionError):
        # An error event inside a stream: the answer had started, so it may be billed.
        code = safe_code(exc.code) or safe_code(exc.type)
        message = f"stream error event {type(exc).__name__}" + (f" code={code}" if code else "")
        return classify_status(500, message, None, code, billed=True)
    if isinstance(exc, openai.OpenAIError) and not isinstance(exc, openai.APIError):
        return unusable_client(exc)  # the SDK's own configuration check: nothing was sent
    local = None if in_stream else unsendable(exc)
    if local is not None:
        return local
    # APIConnectionError (and APITimeoutError), raw httpx2 transport errors.
    return transport_error(exc, in_stream=in_stream)


def _params(request: ProviderRequest) -> dict[str, Any]:
    """The messages as they are, every other field of the body in ``extra_body``."""
    body = request.body
    extra = {k: v for k, v in body.items() if k not in _OWN_FIELDS}
    return chat_params(request, {"messages": body["messages"], "extra_body": extra or None})


def _stream_body(request: ProviderRequest) -> dict[str, Any]:
    """The JSON body of a streamed call: the batch line's fields, the registry's model
    name, and the stream flags (usage in the last chunk)."""
    body = {k: v for k, v in request.body.items() if k not in _OWN_FIELDS}
    body.update(
        model=request.spec.name,
        messages=request.body["messages"],
        stream=True,
        stream_options={"include_usage": True},
    )
    return body


def _raw_json(raw: Any) -> dict[str, Any]:
    """The answer's JSON as the provider sent it (every field, nulls included)."""
    return _json_object(raw.text)


def _json_object(text: str | bytes) -> dict[str, Any]:
    body = json_codec.loads(text)
    if not isinstance(body, dict):
        raise TypeError("answer is not an object")
    return body


def _usage_dict(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _output_text(response: dict[str, Any]) -> str:
    """The text of a Response's message items (its ``output_text``)."""
    return "".join(
        part.get("text") or ""
        for item in response.get("output") or ()
        if isinstance(item, dict) and item.get("type") == "message"
        for part in item.get("content") or ()
        if isinstance(part, dict) and part.get("type") == "output_text"
    )


def endpoint_answer(
    endpoint: str,
    body: dict[str, Any],
    request_id: str | None,
    rate_limits: RateLimitState | None = None,
) -> ProviderResponse:
    """A Responses API ``Response`` or an embeddings list, as it came, with the tokens
    its ``usage`` reports (an embedding has no output tokens); raises
    :class:`MalformedResponse` (billed) for an answer without them."""
    usage = body.get("usage")
    finish: Any = "stop"
    try:
        if not isinstance(usage, dict):
            raise TypeError("no usage")
        if endpoint == EMBEDDINGS:
            prompt, done, text = int(usage["prompt_tokens"]), 0, ""
        else:
            prompt, done = int(usage["input_tokens"]), int(usage["output_tokens"])
            text, finish = _output_text(body), body.get("status")
    except (KeyError, TypeError, ValueError) as exc:
        raise MalformedResponse(
            f"answer without usage ({type(exc).__name__})", status=200, billed=True
        ) from None
    return ProviderResponse(
        text=text,
        prompt_tokens=prompt,
        completion_tokens=done,
        finish_reason=finish if isinstance(finish, str) else None,
        request_id=request_id or body.get("id"),
        body=body,
        rate_limits=rate_limits or RateLimitState(),
    )


class OpenAIProvider:
    """Chat completions against any OpenAI-compatible server (plain or streaming), and
    its Responses API and embeddings (plain)."""

    def warm(self, spec: ModelSpec) -> None:
        client = client_for(spec)
        # The lean path where it applies (the default; a process with
        # BATCHGEN_LEAN_HTTP=false builds it for nothing, and the SDK's on first use).
        lean = lean_http.endpoint(client, True)
        if lean is not None:
            lean.warm()
        else:
            client.default_headers  # noqa: B018  (the SDK works out its platform headers once)

    def complete(self, request: ProviderRequest) -> ProviderResponse:
        cancelled_before_call(request)
        client = client_for(request.spec)
        try:
            if request.endpoint != CHAT_COMPLETIONS:
                return self._endpoint(client, request)
            if request.stream:
                return self._stream(client, request)
            return self._plain(client, request)
        except ProviderError:
            raise
        except _SDK_ERRORS as exc:  # before any answer: the connect may have failed
            raise translate(exc) from None

    def _plain(self, client: openai.OpenAI, request: ProviderRequest) -> ProviderResponse:
        raw = client.chat.completions.with_raw_response.create(**_params(request))
        completion: ChatCompletion = raw.parse()
        try:
            choice = completion.choices[0]
            usage = completion.usage
            if usage is None:
                raise TypeError("no usage")
            prompt, done = usage.prompt_tokens, usage.completion_tokens
            text, finish = choice.message.content or "", choice.finish_reason
            body = _raw_json(raw)
        except (AttributeError, IndexError, TypeError) as exc:
            raise MalformedResponse(
                f"answer without choices or usage ({type(exc).__name__})",
                status=raw.status_code,
                billed=True,
            ) from None
        return ProviderResponse(
            text=text,
            prompt_tokens=prompt,
            completion_tokens=done,
            finish_reason=finish,
            request_id=raw.headers.get("x-request-id") or completion.id,
            body=body,
            rate_limits=openai_rate_limits(raw.headers),
        )

    def _endpoint(self, client: openai.OpenAI, request: ProviderRequest) -> ProviderResponse:
        """A Responses or embeddings call, its body as the batch line has it (the model
        mapped), its answer kept as the provider sent it; on the lean path where it
        applies (the same POST, its whole answer read), else through the SDK."""
        body = {k: v for k, v in request.body.items() if k not in _ENDPOINT_OWN_FIELDS}
        body["model"] = request.spec.name
        route = provider_path(request.endpoint)
        content: str | bytes
        lean = lean_http.endpoint(client, request.lean_http)
        if lean is not None:
            answer = lean.post_stream(route, body, request.headers(), request.timeout_s)
            try:
                content = b"".join(answer.iter_bytes())
            finally:
                answer.close()
            headers: Any = answer.headers
        else:
            raw = client.post(
                route,
                body=body,
                cast_to=httpx2.Response,
                options={"headers": request.headers(), "timeout": request.timeout_s},
            )
            content, headers = raw.text, raw.headers
        try:
            answer_json = _json_object(content)
        except TypeError:  # JSON, but not an object
            raise MalformedResponse("answer is not an object", status=200, billed=True) from None
        return endpoint_answer(
            request.endpoint,
            answer_json,
            headers.get("x-request-id"),
            openai_rate_limits(headers),
        )

    def _stream(self, client: openai.OpenAI, request: ProviderRequest) -> ProviderResponse:
        watch = StreamWatch(request)
        raw = self._open_stream(client, request)
        try:
            limits = openai_rate_limits(raw.headers)  # as of now, the start of the stream
            try:
                merge = self._read_events(raw, watch)
            except _SDK_ERRORS as exc:  # the answer had started: it may be billed
                raise translate(exc, in_stream=True) from None
        finally:
            raw.close()
        headers = raw.headers
        finish = merge.finish_reason()
        if not merge.head or finish is None:
            raise MalformedResponse(
                "stream ended before its finish reason", status=200, billed=True
            )
        body = merge.completion()
        text, usage = merge.text(), merge.usage
        if usage is not None:
            prompt, done, estimated = usage["prompt_tokens"], usage["completion_tokens"], False
        else:  # server ignored stream_options.include_usage: count locally
            enc = request.spec.encoding
            prompt = count_messages(request.body["messages"], enc)
            done, estimated = count_text(text, enc), True
            body["usage"] = _usage_dict(prompt, done)
        body.setdefault("created", int(time.time()))
        return ProviderResponse(
            text=text,
            prompt_tokens=prompt,
            completion_tokens=done,
            finish_reason=finish,
            request_id=headers.get("x-request-id") or body.get("id"),
            body=body,
            rate_limits=limits,
            usage_estimated=estimated,
        )

    @staticmethod
    def _open_stream(client: openai.OpenAI, request: ProviderRequest) -> Any:
        """The streamed call, up to its status line and headers: on the lean path
        (:mod:`batchgen.providers.lean_http`) where it applies, else the SDK's.

        Either way the body goes as the batch line has it. The SDK's ``client.post`` (as
        for any route: its auth, headers, timeout and typed errors) is used without its
        sync Stream, which stops reading at [DONE] and so closes the connection after
        every call (a TCP connect per item): the events are read to the end of the body
        (:meth:`_read_events`) into plain dicts, skipping the per-chunk models."""
        body = _stream_body(request)
        lean = lean_http.endpoint(client, request.lean_http)
        if lean is not None:
            return lean.post_stream("/chat/completions", body, request.headers(), request.timeout_s)
        stream = client.post(
            "/chat/completions",
            body=body,
            cast_to=ChatCompletion,
            options={"headers": request.headers(), "timeout": request.timeout_s},
            stream=True,
            stream_cls=openai.Stream[ChatCompletionChunk],
        )
        return stream.response

    @staticmethod
    def _read_events(raw: Any, watch: StreamWatch) -> OpenAIMerge:
        """Read the server-sent events to the end of the body, merged into one answer
        (every choice, tool call and logprob: :mod:`batchgen.domain.formats.answers`); the first
        choice's text goes to ``watch`` as it comes."""
        merge = OpenAIMerge()
        relay = watch.request.on_chunk
        watch.check()
        for data in sse_data(raw.iter_bytes()):  # an httpx response, read to its end
            if data == b"[DONE]":
                continue  # read on: the end of the body frees the connection
            chunk = json_codec.loads(data)
            if not isinstance(chunk, dict):
                raise MalformedResponse("a stream chunk that is not an object", billed=True)
            if chunk.get("error"):
                raise openai.APIError("error event in the stream", raw.request, body=chunk["error"])
            try:
                for choice in chunk.get("choices") or ():
                    if choice.get("index") == 0:
                        watch.add((choice.get("delta") or {}).get("content"))
                merge.add(chunk)
                usage = merge.usage
                if usage is not None:
                    int(usage["prompt_tokens"]), int(usage["completion_tokens"])
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                raise MalformedResponse(
                    f"malformed stream chunk ({type(exc).__name__})", status=200, billed=True
                ) from None
            if relay is not None:
                relay(chunk)
            watch.check()
        return merge
