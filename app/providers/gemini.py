"""Gemini, on the official ``google-genai`` SDK: the Gemini API (``provider = "gemini"``:
an API key) and Vertex AI (``provider = "vertex"``: a Google Cloud ``project``, its
``region`` as the location, and service-account credentials).

Clients keep speaking OpenAI chat: the body is translated to ``generateContent``
(:mod:`batchgen.domain.formats.gemini_chat`) and the answer, plain or streamed, back to a
``chat.completion`` and its chunks. The SDK's own retries are off (no
``retry_options``): retry timing belongs to :mod:`batchgen.domain.lifecycle.retry`.

Vertex AI's credentials: ``api_key_env`` names the variable holding the path of a
service-account key file (``GOOGLE_APPLICATION_CREDENTIALS`` is the usual one); when
it is unset, Application Default Credentials. The SDK refreshes the access token.

Errors: a 429 ``RESOURCE_EXHAUSTED`` is :class:`RateLimited` with its ``RetryInfo``
delay; 5xx (``UNAVAILABLE``, ``INTERNAL``) transient, but a flex call's 503
``UNAVAILABLE`` (Google sheds flex traffic when busy) is :class:`FlexUnavailable` (no
cooldown, no attempt used: :func:`batchgen.domain.scheduling.routes.after_flex_refusal`
decides); a 400 whose wording says the input is over the model's tokens
:class:`ContextLengthExceeded`; other 4xx permanent.
Messages carry the status and Google's status name only, never the provider's text.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from typing import Any

import google.auth
import google.auth.exceptions
import httpx
import httpx2
import pydantic
from google import genai
from google.genai import errors as genai_errors
from google.oauth2 import service_account

from batchgen.domain.formats import Untranslatable, gemini_embeddings
from batchgen.domain.formats import gemini_chat as gemini_format
from batchgen.domain.formats.endpoints import CHAT_COMPLETIONS, EMBEDDINGS
from batchgen.domain.scheduling.rate_limits import RateLimitState
from batchgen.errors import (
    ContextLengthExceeded,
    FlexUnavailable,
    MalformedResponse,
    PermanentProviderError,
    ProviderError,
    RateLimited,
    TransientProviderError,
)
from batchgen.providers.base import (
    ProviderRequest,
    ProviderResponse,
    StreamWatch,
    cancelled_before_call,
    classify_status,
    exception_chain,
    safe_code,
    status_message,
    transport_error,
    unsendable,
    unusable_client,
)
from batchgen.registry import ModelSpec, ProviderKind

SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
# The API versions the SDK calls by default (a deployment's api_version overrides).
DEFAULT_API_VERSION = {ProviderKind.GEMINI: "v1beta", ProviderKind.VERTEX: "v1beta1"}
# Gemini's wording of a prompt over the model's input limit.
_CONTEXT = re.compile(r"token count .*exceeds|exceeds the maximum number of tokens", re.I)
# Failures before any byte of the request was written, in httpx (1.x), which the SDK
# may use, beside the httpx2 ones providers.base knows.
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_TRANSPORT = (httpx.HTTPError, httpx2.HTTPError, google.auth.exceptions.TransportError)
_LOCK = threading.Lock()
# The answer's fields that are not the answer (the SDK's own).
_SDK_FIELDS = {"sdk_http_response", "automatic_function_calling_history", "parsed"}


def _credentials(path: str | None) -> Any:
    if path:
        return service_account.Credentials.from_service_account_file(path, scopes=list(SCOPES))
    credentials, _ = google.auth.default(scopes=list(SCOPES))
    return credentials


@functools.cache
def sdk_client(
    kind: ProviderKind,
    base_url: str,
    credential: str | None,
    project: str | None,
    region: str | None,
    api_version: str | None,
) -> genai.Client:
    """One client (one connection pool, one token) per endpoint and process;
    ``credential``: the API key (Gemini API), or the path of a service-account key file
    (Vertex AI; None: Application Default Credentials)."""
    options = genai.types.HttpOptions(
        base_url=base_url, api_version=api_version or DEFAULT_API_VERSION[kind]
    )
    with _LOCK:
        if kind is ProviderKind.VERTEX:
            return genai.Client(
                vertexai=True,
                project=project,
                location=region,
                credentials=_credentials(credential),
                http_options=options,
            )
        return genai.Client(api_key=credential, http_options=options)


def vertex_credentials(spec: ModelSpec) -> Any:
    """The credentials a Vertex AI deployment's calls use (not yet refreshed)."""
    return _credentials(os.environ.get(spec.api_key_env))


def client_for(spec: ModelSpec) -> genai.Client:
    credential = (
        os.environ.get(spec.api_key_env) if spec.provider is ProviderKind.VERTEX else spec.api_key()
    )
    return sdk_client(
        spec.provider, spec.base_url, credential, spec.project, spec.region, spec.api_version
    )


def translate(exc: BaseException, *, in_stream: bool = False, flex: bool = False) -> ProviderError:
    """An SDK, transport or credentials exception as the project's error (no text);
    ``flex``: the call asked the flex tier."""
    if isinstance(exc, genai_errors.APIError):
        code = safe_code(exc.status)
        status = int(exc.code or 500)
        message = status_message(status, exc, code, None)
        headers = getattr(exc.response, "headers", None)
        if flex and status == 503 and not in_stream:
            delay = gemini_format.retry_delay_s(exc.details)
            return FlexUnavailable(f"flex tier busy: {message}", status=503, retry_after_s=delay)
        if status == 429:
            delay = gemini_format.retry_delay_s(exc.details)
            if delay is None:
                return classify_status(429, message, headers, code)
            return RateLimited(message, retry_after_s=delay)
        if status == 400 and _CONTEXT.search(exc.message or ""):
            return ContextLengthExceeded(message, status=status)
        return classify_status(status, message, headers, code, billed=in_stream)
    if isinstance(exc, google.auth.exceptions.RefreshError):
        return PermanentProviderError(f"credentials refused ({type(exc).__name__})")
    if isinstance(exc, google.auth.exceptions.DefaultCredentialsError | OSError) and not any(
        isinstance(e, _TRANSPORT) for e in exception_chain(exc)
    ):
        return unusable_client(exc)
    if isinstance(exc, pydantic.ValidationError | ValueError) and not isinstance(exc, OSError):
        return MalformedResponse(f"malformed response ({type(exc).__name__})", billed=True)
    local = None if in_stream else unsendable(exc)
    if local is not None:
        return local
    if not in_stream and any(isinstance(e, _NEVER_SENT) for e in exception_chain(exc)):
        return TransientProviderError(f"connection error ({type(exc).__name__})", billed=False)
    return transport_error(exc, in_stream=in_stream)


_SDK_ERRORS: tuple[type[BaseException], ...] = (
    genai_errors.APIError,
    google.auth.exceptions.GoogleAuthError,
    *_TRANSPORT,
    pydantic.ValidationError,
    ValueError,
    OSError,
)


def _dump(response: Any) -> dict[str, Any]:
    out: dict[str, Any] = response.model_dump(mode="json", exclude_none=True, exclude=_SDK_FIELDS)
    return out


def _headers(response: Any) -> dict[str, str]:
    raw = getattr(response, "sdk_http_response", None)
    return dict(getattr(raw, "headers", None) or {})


def _request_id(headers: dict[str, str], body: dict[str, Any]) -> str | None:
    lowered = {k.lower(): v for k, v in headers.items()}
    return lowered.get("x-request-id") or body.get("id") or None


class GeminiProvider:
    """Chat completions (plain or streamed) on Gemini's ``generateContent``; on the
    Gemini API, embeddings on ``embedContent``."""

    def warm(self, spec: ModelSpec) -> None:
        client_for(spec)

    def _params(self, request: ProviderRequest) -> dict[str, Any]:
        max_tokens = int(
            request.body.get("max_completion_tokens")
            or request.body.get("max_tokens")
            or request.spec.output_cap
        )
        try:
            params = gemini_format.request(request.body, request.spec.provider.value, max_tokens)
        except Untranslatable as exc:  # admission refuses these: a line stored before
            raise PermanentProviderError(f"not translatable: {exc.field}") from None
        params["config"]["http_options"] = self._http(request)
        return params

    def complete(self, request: ProviderRequest) -> ProviderResponse:
        cancelled_before_call(request)
        if request.endpoint == EMBEDDINGS and request.spec.provider is ProviderKind.GEMINI:
            return self._embed(request)
        if request.endpoint != CHAT_COMPLETIONS:  # the registry lets no such request in
            raise PermanentProviderError(f"a gemini model does not serve {request.endpoint}")
        params = self._params(request)
        try:
            client = client_for(request.spec)
            if request.stream:
                return self._stream(client, request, params)
            return self._plain(client, request, params)
        except ProviderError:
            raise
        except _SDK_ERRORS as exc:
            raise translate(exc, flex=gemini_format.is_flex(params)) from None

    def _embed(self, request: ProviderRequest) -> ProviderResponse:
        """``embedContent`` (``batchEmbedContents`` for several texts); the Gemini API
        reports no tokens for it, so the prompt is its free ``countTokens``."""
        try:
            texts = gemini_embeddings.texts(request.body, request.spec.provider.value)
        except Untranslatable as exc:  # admission refuses these: a line stored before
            raise PermanentProviderError(f"not translatable: {exc.field}") from None
        model, http = request.spec.name, genai.types.HttpOptions(**self._http(request))
        config: dict[str, Any] = {**gemini_embeddings.config(request.body), "http_options": http}
        try:
            client = client_for(request.spec)
            types = genai.types
            contents = [types.Content(role="user", parts=[types.Part(text=t)]) for t in texts]
            answer = client.models.embed_content(  # one content a text: one embedding each
                model=model, contents=contents, config=genai.types.EmbedContentConfig(**config)
            )
            counted = client.models.count_tokens(
                model=model, contents=texts, config=genai.types.CountTokensConfig(http_options=http)
            )
        except _SDK_ERRORS as exc:
            raise translate(exc) from None
        vectors = [list(e.values or []) for e in answer.embeddings or []]
        prompt = int(counted.total_tokens or 0)
        if len(vectors) != len(texts):
            raise MalformedResponse("an embedding per input was not answered", billed=True)
        body = gemini_embeddings.embeddings_list(vectors, model, prompt, request.body)
        return ProviderResponse(
            text="",
            prompt_tokens=prompt,
            completion_tokens=0,
            finish_reason="stop",
            request_id=_request_id(_headers(answer), body),
            body=body,
            rate_limits=RateLimitState(),
        )

    def _http(self, request: ProviderRequest) -> dict[str, Any]:
        return {"headers": request.headers(), "timeout": max(1, int(request.timeout_s * 1000))}

    def _plain(
        self, client: genai.Client, request: ProviderRequest, params: dict[str, Any]
    ) -> ProviderResponse:
        answer = client.models.generate_content(model=request.spec.name, **params)
        headers = _headers(answer)
        try:
            body = gemini_format.chat_completion(_dump(answer), request.spec.name, int(time.time()))
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedResponse(
                f"answer without usage ({type(exc).__name__})", status=200, billed=True
            ) from None
        usage = body["usage"]
        first = body["choices"][0]
        return ProviderResponse(
            text=first["message"].get("content") or "",
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
            finish_reason=first["finish_reason"],
            request_id=_request_id(headers, body),
            body=body,
            rate_limits=RateLimitState(),
        )

    def _stream(
        self, client: genai.Client, request: ProviderRequest, params: dict[str, Any]
    ) -> ProviderResponse:
        watch = StreamWatch(request)
        merge = gemini_format.StreamMerge(request.spec.name, int(time.time()))
        relay = request.on_chunk
        stream = client.models.generate_content_stream(model=request.spec.name, **params)
        headers: dict[str, str] = {}
        try:
            watch.check()
            for chunk in stream:
                headers = headers or _headers(chunk)
                data = _dump(chunk)
                meta = data.get("usage_metadata") or {}
                if meta.get("prompt_token_count") is not None:
                    watch.prompt_tokens = int(meta["prompt_token_count"])
                for out in merge.add(data):
                    choice = out["choices"][0]
                    if choice["index"] == 0:
                        watch.add(choice["delta"].get("content"))
                    if relay is not None:
                        relay(out)
                watch.check()
        except ProviderError:
            raise
        except _SDK_ERRORS as exc:  # the answer may have started: it may be billed
            raise translate(
                exc, in_stream=bool(headers), flex=gemini_format.is_flex(params)
            ) from None
        except (KeyError, TypeError) as exc:
            raise MalformedResponse(
                f"malformed stream chunk ({type(exc).__name__})", status=200, billed=True
            ) from None
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        if not merge.finished:
            raise MalformedResponse(
                "stream ended before its finish reason", status=200, billed=True
            )
        if relay is not None:
            relay(merge.usage_chunk())
        body = merge.result()
        usage = body["usage"]
        first = body["choices"][0]
        return ProviderResponse(
            text=first["message"].get("content") or "",
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
            finish_reason=first["finish_reason"],
            request_id=_request_id(headers, body),
            body=body,
            rate_limits=RateLimitState(),
        )
