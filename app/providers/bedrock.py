"""Models on AWS Bedrock (``provider = "bedrock"``), on ``boto3``'s ``bedrock-runtime``
``Converse`` / ``ConverseStream``: the AWS credential chain (environment, profile,
role; or a Bedrock API key in ``AWS_BEARER_TOKEN_BEDROCK``), the deployment's
``region``, and ``base_url`` as the endpoint URL.

Clients keep speaking OpenAI chat: the body is translated to Converse
(:mod:`batchgen.domain.formats.bedrock_converse`) and the answer, plain or streamed, back to a
``chat.completion`` and its chunks. botocore's retries are off (one attempt).

Errors: ``ThrottlingException`` and ``ServiceQuotaExceededException`` are
:class:`RateLimited`; ``ModelNotReadyException``, ``ModelTimeoutException``,
``InternalServerException``, ``ServiceUnavailableException`` and
``ModelErrorException`` transient; ``ValidationException`` permanent (its context
wording :class:`ContextLengthExceeded`); an error event inside a stream the same,
billed. Messages carry the status and AWS's error code only.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from batchgen.domain.formats import Untranslatable
from batchgen.domain.formats import bedrock_converse as bedrock_format
from batchgen.domain.formats.endpoints import CHAT_COMPLETIONS
from batchgen.domain.lifecycle.retry import parse_retry_after_s
from batchgen.domain.scheduling.rate_limits import RateLimitState
from batchgen.errors import (
    ContextLengthExceeded,
    MalformedResponse,
    PermanentProviderError,
    ProviderError,
    RateLimited,
    TransientProviderError,
    Unsendable,
)
from batchgen.providers.base import (
    ITEM_HEADER,
    UNSENDABLE_HINT,
    ProviderRequest,
    ProviderResponse,
    StreamWatch,
    cancelled_before_call,
    safe_code,
)
from batchgen.registry import ModelSpec

RATE_LIMITED = frozenset({"ThrottlingException", "ServiceQuotaExceededException"})
TRANSIENT = frozenset(
    {
        "ModelNotReadyException",
        "ModelTimeoutException",
        "InternalServerException",
        "ServiceUnavailableException",
        "ModelErrorException",
        "ModelStreamErrorException",
    }
)
_CONTEXT = re.compile(r"too long|context (window|length)|too many (input )?tokens", re.I)
# botocore's read timeout is per client: calls share the client of the next bound up.
TIMEOUT_STEPS_S = (30, 60, 120, 300, 600, 900, 1800, 3600)
_LOCK = threading.Lock()
_CALL = threading.local()


def _timeout_step(timeout_s: float) -> int:
    return next((s for s in TIMEOUT_STEPS_S if s >= timeout_s), TIMEOUT_STEPS_S[-1])


def _item_header(request: Any, **_: Any) -> None:
    """Adds this thread's call's headers (the item id) to the request being sent."""
    for name, value in (getattr(_CALL, "headers", None) or {}).items():
        request.headers[name] = value


@functools.cache
def sdk_client(region: str, endpoint_url: str, read_timeout_s: int) -> Any:
    """One client (one connection pool) per endpoint, region and timeout step."""
    config = botocore.config.Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=10,
        read_timeout=read_timeout_s,
        max_pool_connections=64,
        tcp_keepalive=True,
    )
    with _LOCK:  # a boto3 session is not thread-safe while it builds a client
        client = boto3.session.Session().client(
            "bedrock-runtime", region_name=region, endpoint_url=endpoint_url, config=config
        )
    client.meta.events.register("before-send.bedrock-runtime.*", _item_header)
    return client


@functools.cache
def aws_client(service: str, region: str, endpoint_url: str | None) -> Any:
    """A client of another AWS service the batch route uses (``bedrock``'s control plane,
    ``s3``), one per endpoint and process, botocore's retries off."""
    config = botocore.config.Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=10,
        read_timeout=120,
        s3={"addressing_style": "path"} if endpoint_url else None,
    )
    with _LOCK:
        return boto3.session.Session().client(
            service, region_name=region, endpoint_url=endpoint_url, config=config
        )


def client_for(spec: ModelSpec, timeout_s: float = 600.0) -> Any:
    return sdk_client(spec.region or "us-east-1", spec.base_url, _timeout_step(timeout_s))


def translate(exc: BaseException, *, in_stream: bool = False) -> ProviderError:
    """A botocore exception as the project's error (status and AWS error code only)."""
    if isinstance(exc, botocore.exceptions.ClientError):
        error = exc.response.get("Error") or {}
        meta = exc.response.get("ResponseMetadata") or {}
        code = safe_code(error.get("Code")) or "UnknownError"
        status = int(meta.get("HTTPStatusCode") or (500 if in_stream else 400))
        message = f"HTTP {status} {code}"
        if safe_code(meta.get("RequestId")):
            message += f" request_id={meta['RequestId']}"
        if code in RATE_LIMITED:
            headers = {k.lower(): v for k, v in (meta.get("HTTPHeaders") or {}).items()}
            return RateLimited(message, status=status, retry_after_s=parse_retry_after_s(headers))
        if code in TRANSIENT or status >= 500:
            return TransientProviderError(message, status=status, billed=in_stream)
        if code == "ValidationException" and _CONTEXT.search(str(error.get("Message") or "")):
            return ContextLengthExceeded(message, status=status)
        return PermanentProviderError(message, status=status)
    if isinstance(exc, botocore.exceptions.NoCredentialsError | botocore.exceptions.NoRegionError):
        return Unsendable(f"client not usable ({type(exc).__name__}): check AWS credentials")
    if isinstance(exc, botocore.exceptions.ParamValidationError):
        return PermanentProviderError(f"request refused by the SDK ({type(exc).__name__})")
    if isinstance(exc, botocore.exceptions.EndpointConnectionError) and not in_stream:
        # Includes ConnectTimeoutError: no byte of the request was written.
        return TransientProviderError(f"connection error ({type(exc).__name__})", billed=False)
    if isinstance(exc, botocore.exceptions.ReadTimeoutError):
        return TransientProviderError(f"timeout ({type(exc).__name__})", billed=True)
    if isinstance(exc, ValueError) and not in_stream:
        return Unsendable(f"request not sendable ({type(exc).__name__}): {UNSENDABLE_HINT}")
    if isinstance(exc, ValueError | KeyError | TypeError):
        return MalformedResponse(f"malformed response ({type(exc).__name__})", billed=True)
    return TransientProviderError(f"connection error ({type(exc).__name__})", billed=True)


_SDK_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, ValueError)


def _request_id(answer: dict[str, Any]) -> str:
    return str((answer.get("ResponseMetadata") or {}).get("RequestId") or "")


class BedrockProvider:
    """Chat completions (plain or streamed) on Bedrock's Converse API."""

    def warm(self, spec: ModelSpec) -> None:
        client_for(spec)

    def _params(self, request: ProviderRequest) -> dict[str, Any]:
        body = request.body
        max_tokens = int(
            body.get("max_completion_tokens") or body.get("max_tokens") or request.spec.output_cap
        )
        try:
            params = bedrock_format.request(body, max_tokens)
        except Untranslatable as exc:  # admission refuses these: a line stored before
            raise PermanentProviderError(f"not translatable: {exc.field}") from None
        params["modelId"] = request.spec.name
        return params

    def complete(self, request: ProviderRequest) -> ProviderResponse:
        cancelled_before_call(request)
        if request.endpoint != CHAT_COMPLETIONS:  # the registry lets no such request in
            raise PermanentProviderError(f"a bedrock model does not serve {request.endpoint}")
        params = self._params(request)
        _CALL.headers = {ITEM_HEADER: str(request.item_id)} if request.item_id else {}
        _CALL.headers.update(request.extra_headers or {})
        try:
            client = client_for(request.spec, request.timeout_s)
            if request.stream:
                return self._stream(client, request, params)
            return self._plain(client, request, params)
        except ProviderError:
            raise
        except _SDK_ERRORS as exc:
            raise translate(exc) from None
        finally:
            _CALL.headers = None

    def _plain(self, client: Any, request: ProviderRequest, params: dict[str, Any]) -> Any:
        answer = client.converse(**params)
        rid = _request_id(answer)
        try:
            body = bedrock_format.chat_completion(answer, rid, request.spec.name, int(time.time()))
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedResponse(
                f"answer without message or usage ({type(exc).__name__})", status=200, billed=True
            ) from None
        return self._response(body, rid)

    @staticmethod
    def _response(body: dict[str, Any], rid: str) -> ProviderResponse:
        usage, first = body["usage"], body["choices"][0]
        return ProviderResponse(
            text=first["message"].get("content") or "",
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
            finish_reason=first["finish_reason"],
            request_id=rid or None,
            body=body,
            rate_limits=RateLimitState(),
        )

    def _stream(
        self, client: Any, request: ProviderRequest, params: dict[str, Any]
    ) -> ProviderResponse:
        watch = StreamWatch(request)
        answer = client.converse_stream(**params)
        rid = _request_id(answer)
        merge = bedrock_format.StreamMerge(rid, request.spec.name, int(time.time()))
        relay = request.on_chunk
        stream = answer["stream"]
        try:
            watch.check()
            for event in stream:
                for out in merge.add(event):
                    watch.add(out["choices"][0]["delta"].get("content"))
                    if relay is not None:
                        relay(out)
                usage = (event.get("metadata") or {}).get("usage") or {}
                if usage.get("inputTokens") is not None:
                    watch.prompt_tokens = int(usage["inputTokens"])
                watch.check()
        except ProviderError:
            raise
        except _SDK_ERRORS as exc:  # the answer had started: it may be billed
            raise translate(exc, in_stream=True) from None
        except (KeyError, TypeError) as exc:
            raise MalformedResponse(
                f"malformed stream event ({type(exc).__name__})", status=200, billed=True
            ) from None
        finally:
            stream.close()
        if not merge.finished:
            raise MalformedResponse("stream ended before its stop reason", status=200, billed=True)
        if relay is not None:
            relay(merge.usage_chunk())
        try:
            body = merge.result()
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedResponse(
                f"malformed stream ({type(exc).__name__})", status=200, billed=True
            ) from None
        return self._response(body, rid)
