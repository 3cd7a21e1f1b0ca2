"""Gemini's and Bedrock's error bodies and wording (:mod:`batchgen.simulator.native`
answers in their formats; :mod:`batchgen.simulator.formats` words their errors here)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GEMINI, BEDROCK = "gemini", "bedrock"
NATIVE_APIS = frozenset({GEMINI, BEDROCK})
GOOGLE_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
AWS_ERRORS = {
    400: "ValidationException",
    403: "AccessDeniedException",
    404: "ResourceNotFoundException",
    408: "ModelTimeoutException",
    424: "ModelErrorException",
    429: "ThrottlingException",
    500: "InternalServerException",
    503: "ServiceUnavailableException",
}
# Bedrock's error names a status fault may ask for (x-sim-fault is read in lower case:
# ``status:429:servicequotaexceededexception``).
AWS_NAMES = {
    n.lower(): n
    for n in (
        *AWS_ERRORS.values(),
        "ServiceQuotaExceededException",
        "ModelNotReadyException",
        "ModelStreamErrorException",
    )
}
RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"


def error_body(api: str, status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """An error in the API's form (``code``: AWS's exception name, Google's status)."""
    if api == GEMINI:
        named = code.upper() if code and code.upper() in GOOGLE_STATUS.values() else None
        name = named or GOOGLE_STATUS.get(status, "UNKNOWN")
        return {"error": {"code": status, "message": message, "status": name}}
    kind = AWS_NAMES.get((code or "").lower()) or AWS_ERRORS.get(status)
    return {"__type": kind or "InternalServerException", "message": message}


def error_headers(api: str, body: Mapping[str, Any]) -> dict[str, str]:
    return {"x-amzn-ErrorType": str(body.get("__type"))} if api == BEDROCK else {}


def with_retry_info(body: dict[str, Any], retry_after_s: float) -> dict[str, Any]:
    """A Gemini 429 carrying its retry delay as Google does (``RetryInfo``)."""
    error = body.get("error")
    if isinstance(error, dict):
        delay = f"{max(retry_after_s, 0.001):.3f}".rstrip("0").rstrip(".") + "s"
        error["details"] = [{"@type": RETRY_INFO, "retryDelay": delay}]
    return body


def context_length_message(api: str, window: int, prompt_tokens: int) -> str:
    if api == GEMINI:
        return (
            f"The input token count ({prompt_tokens}) exceeds the maximum number of tokens "
            f"allowed ({window})."
        )
    return "Input is too long for requested model."
