"""The project's one exception tree.

``BatchgenError``
├── ``ConfigError``            bad settings or registry (operator's fault)
├── ``ClientError``            caller's fault → 4xx with a precise message
│   ├── ``ValidationFailed``   400, names the line and field
│   ├── ``PayloadTooLarge``    413
│   ├── ``Unauthorized``       401
│   ├── ``Forbidden``          403 (an admin key is needed)
│   ├── ``NotFound``           404 (also another tenant's id)
│   ├── ``Conflict``           409
│   ├── ``IdempotencyKeyReused`` 422 (the key names another request)
│   └── ``OverQuota``          429 + Retry-After (the tenant's own limits)
│       ├── ``FileQuotaExceeded`` 429: its uploads fill its file quota
│       └── ``OverShare``      429 + Retry-After (its sync calls fill its share)
├── ``Overloaded``             503 + Retry-After (model backlog full)
├── ``Unavailable``            503 + Retry-After (PostgreSQL or Redis unreachable)
├── ``CallFailed``             a synchronous call ended without an answer (400/429/502/504…)
├── ``ItemFailed``             the worker task's end after its item failed for good (FAILURE)
└── ``ProviderError``          a provider call failed
    ├── ``TransientProviderError``   retry with backoff (408, 409, 5xx, reset, timeout)
    │   ├── ``RateLimited``          429, carries retry-after
    │   ├── ``FlexUnavailable``      429 "resource unavailable": a flex call refused
    │   └── ``MalformedResponse``    an unreadable answer (transient: retried)
    ├── ``PermanentProviderError``   fail the item (400, 401, 403, 404, 422)
    │   ├── ``ContextLengthExceeded``
    │   └── ``Unsendable``           the request could not leave (a deployment's config)
    └── ``CallCancelled``            ``request.cancel`` was set: the call was abandoned
"""

from __future__ import annotations


class BatchgenError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(BatchgenError):
    """Settings or the model registry are invalid."""


class ClientError(BatchgenError):
    """The caller's request is wrong; maps to a 4xx answer."""

    status_code = 400
    code = "invalid_request"

    def __init__(self, message: str, *, line: int | None = None, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.line = line
        self.field = field

    def to_dict(self) -> dict[str, object]:
        body: dict[str, object] = {"code": self.code, "message": self.message}
        if self.line is not None:
            body["line"] = self.line
        if self.field is not None:
            body["param"] = self.field
        return body


class ValidationFailed(ClientError):
    status_code = 400
    code = "invalid_request"


class PayloadTooLarge(ClientError):
    status_code = 413
    code = "payload_too_large"


class Unauthorized(ClientError):
    status_code = 401
    code = "unauthorized"


class Forbidden(ClientError):
    status_code = 403
    code = "forbidden"


class NotFound(ClientError):
    status_code = 404
    code = "not_found"


class Conflict(ClientError):
    status_code = 409
    code = "conflict"


class IdempotencyKeyReused(ClientError):
    """The Idempotency-Key was used before for a different request (IETF draft: 422)."""

    status_code = 422
    code = "idempotency_key_reused"


class RetryAdvice:
    """Mixin for errors that tell the caller when to come back."""

    retry_after_s: float


class OverQuota(ClientError, RetryAdvice):
    status_code = 429
    code = "tenant_over_quota"

    def __init__(self, message: str, *, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class FileQuotaExceeded(OverQuota):
    """The tenant's uploads already fill its file quota (count or bytes); Retry-After
    is when its first file expires (deleting one frees room at once)."""

    code = "file_quota_exceeded"


class OverShare(OverQuota):
    """The tenant's own synchronous calls on the model, at its share of the model's
    slots, would hold a new call past its deadline (429: the tenant's own flood)."""

    code = "tenant_over_share"


class BudgetExhausted(OverQuota):
    """A dollar budget of the tenant or of its key cannot cover the call's worst-case
    price this period (429); Retry-After and ``resets_at`` say when the period rolls
    (a ``total`` budget never does: no Retry-After, ``resets_at`` null)."""

    code = "budget_exhausted"

    def __init__(self, message: str, *, retry_after_s: float | None, resets_at: str | None = None):
        ClientError.__init__(self, message)
        self.retry_after_s = retry_after_s  # type: ignore[assignment]
        self.resets_at = resets_at

    def to_dict(self) -> dict[str, object]:
        body = super().to_dict()
        body["resets_at"] = self.resets_at
        return body


class KeyRateLimited(OverQuota):
    """The API key's own requests-per-minute limit is used up (429); Retry-After is
    when its next request may go."""

    code = "key_rate_limited"


class Overloaded(BatchgenError, RetryAdvice):
    """The model's backlog is full; come back later (503)."""

    status_code = 503
    code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: float):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message}


class Unavailable(BatchgenError, RetryAdvice):
    """A service the answer needs (PostgreSQL, Redis) is unreachable: 503, come back later.

    ``code`` names the service (``database_unavailable``, ``redis_unavailable``);
    the message never carries the driver's text, which may quote the request.
    """

    status_code = 503

    def __init__(self, code: str, message: str, *, retry_after_s: float):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message}


class CallFailed(BatchgenError):
    """A synchronous call (``POST /v1/chat/completions``, ``/v1/messages``) ended without
    an answer: its item failed, expired or was cancelled. ``status_code`` and ``code``
    are :func:`batchgen.domain.formats.call_rules.call_error`'s."""

    def __init__(self, status_code: int, code: str, message: str):
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message}


class ItemFailed(BatchgenError):
    """Raised by the worker task once its item has failed for good (the item's state is
    already recorded, exactly once, in PostgreSQL), so that the task ends ``FAILURE``
    and Flower counts it. The message names the item and its error code, nothing else."""


class ProviderError(BatchgenError):
    """A provider call failed. ``status`` is the HTTP status when there was one."""

    kind = "provider_error"

    def __init__(self, message: str, *, status: int | None = None, billed: bool = False):
        super().__init__(message)
        self.message = message
        self.status = status
        # True when the provider may have charged for the call (it reached the model).
        self.billed = billed


class TransientProviderError(ProviderError):
    kind = "transient"


class RateLimited(TransientProviderError):
    """A 429. ``rate_limits`` is what the answer's rate-limit headers said (a
    :class:`batchgen.domain.scheduling.rate_limits.RateLimitState`, typed loosely because this
    module sits below the domain layer), None when there were none to read."""

    kind = "rate_limited"

    def __init__(
        self,
        message: str,
        *,
        status: int | None = 429,
        retry_after_s: float | None,
        rate_limits: object | None = None,
    ):
        super().__init__(message, status=status)
        self.retry_after_s = retry_after_s
        self.rate_limits = rate_limits


class FlexUnavailable(TransientProviderError):
    """A flex call refused with 429 "resource unavailable" (OpenAI's flex tier is busy).

    Not a rate limit: the account's limits are not full, so it starts no cooldown, and
    not a failure: it uses none of the item's attempts. Never billed. What follows is
    :func:`batchgen.domain.scheduling.routes.after_flex_refusal`'s decision (flex again after a
    wait, or a standard call in time)."""

    kind = "flex_unavailable"

    def __init__(self, message: str, *, status: int | None = 429, retry_after_s: float | None):
        super().__init__(message, status=status, billed=False)
        self.retry_after_s = retry_after_s


class PermanentProviderError(ProviderError):
    kind = "permanent"


class ContextLengthExceeded(PermanentProviderError):
    kind = "context_length_exceeded"


class Unsendable(PermanentProviderError):
    """The request could not be built or sent as the deployment is configured (a base
    URL no client can use, an API key no header can carry, an SDK configuration error):
    a local failure before any byte left, so never billed, and no retry can mend it.
    A pool hands the item to another deployment; else the item fails."""

    kind = "unsendable"

    def __init__(self, message: str):
        super().__init__(message, status=None, billed=False)


class MalformedResponse(TransientProviderError):
    """Unreadable answer: retried (usually a proxy or a truncated body)."""

    kind = "malformed_response"


class CallCancelled(ProviderError):
    """The call was abandoned because ``ProviderRequest.cancel`` was set.

    Neither transient nor permanent: the item was cancelled, so it is not
    retried. ``billed`` is True once the provider had started answering (it
    may charge for what it generated); ``prompt_tokens`` / ``completion_tokens``
    are what is known of the usage at that point (``completion_tokens``: the
    tokens of the text received, counted locally), ``None`` when unknown.
    """

    kind = "cancelled"

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        billed: bool = True,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
    ):
        super().__init__(message, status=status, billed=billed)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
