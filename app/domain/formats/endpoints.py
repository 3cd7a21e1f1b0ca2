"""The endpoints a request may go to, and what a caller is told about them (pure).

A batch (OpenAI's Batch API) holds requests to one endpoint: every line's ``url`` is
the batch's ``endpoint``. batchgen runs chat completions, the Responses API and
embeddings through the same scheduler; Anthropic's Messages (its Message Batches and
``POST /v1/messages``) are chat requests underneath (their lines are chat lines).
"""

from __future__ import annotations

from batchgen.registry import Endpoint, ModelSpec

CHAT_COMPLETIONS = Endpoint.CHAT_COMPLETIONS.value
RESPONSES = Endpoint.RESPONSES.value
EMBEDDINGS = Endpoint.EMBEDDINGS.value
MESSAGES = "/v1/messages"
# What a line's ``url`` and a batch's ``endpoint`` may be, in the order they are named.
BATCH_ENDPOINTS: tuple[str, ...] = tuple(e.value for e in Endpoint)
# Everything the HTTP API serves under /v1, for the answer to a path it does not.
API_PATHS: tuple[str, ...] = (
    "POST /v1/chat/completions",
    "POST /v1/responses",
    "POST /v1/embeddings",
    "POST /v1/messages",
    "/v1/files",
    "/v1/batches",
    "/v1/messages/batches",
    "GET /v1/models",
    "GET /v1/usage",
    "GET /v1/status",
)


def listed(endpoints: tuple[str, ...] | list[str]) -> str:
    """``'/v1/chat/completions', '/v1/responses'`` (for a message)."""
    return ", ".join(repr(str(e)) for e in endpoints)


def unknown_endpoint(url: object) -> str:
    """What a line or batch naming an endpoint batchgen does not run is told."""
    return f"unsupported endpoint {url!r}; supported: {listed(BATCH_ENDPOINTS)}"


def unknown_path(method: str, path: str) -> str:
    """The message of a 404 for a path under /v1 that batchgen does not serve."""
    return f"unknown endpoint {method} {path}; batchgen serves: {', '.join(API_PATHS)}"


def line_endpoint(batch_endpoint: str) -> str:
    """The endpoint a batch's lines name: a Message Batch's (and a Messages call's) are
    chat lines; any other batch's lines name the batch's own endpoint."""
    return CHAT_COMPLETIONS if batch_endpoint == MESSAGES else batch_endpoint


def not_served(spec: ModelSpec, endpoint: str) -> str | None:
    """Why ``spec`` cannot take a request to ``endpoint`` (None: it can)."""
    if spec.serves(endpoint):
        return None
    return f"model {spec.name!r} does not serve {endpoint}; it serves {listed(spec.served)}"


def provider_path(endpoint: str) -> str:
    """The path of ``endpoint`` under an OpenAI-compatible ``base_url`` (which ends in
    ``/v1``): ``/v1/embeddings`` -> ``/embeddings``."""
    return endpoint.removeprefix("/v1")
