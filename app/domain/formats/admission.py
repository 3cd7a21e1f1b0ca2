"""Validation of an OpenAI Batch API input file, one line at a time.

A line's ``url`` names its endpoint (:mod:`batchgen.domain.formats.endpoints`): chat
completions (validated here), the Responses API
(:mod:`batchgen.domain.formats.responses_api`) or embeddings
(:mod:`batchgen.domain.formats.embeddings_api`); every line of a batch names the same one.

Pure: no database, no network. :func:`parse_lines` streams a binary JSONL
body and yields one :class:`ItemDraft` per line, raising a
:class:`ValidationFailed` that names the line and the field at the first bad
line. Token estimates are computed here, once, and stored on the item.

Counting tokens costs CPU, so a line is first held against a floor computed
from its byte length alone (:func:`batchgen.domain.formats.tokens.min_tokens`), counting stops
once a prompt is known not to fit, and one request may hand the tokenizer at
most ``Limits.max_tokenize_bytes`` of text in all.

Text PostgreSQL cannot store (a NUL character, an unpaired surrogate: legal
JSON, refused by ``jsonb``) is refused here, before it reaches the database,
whose error messages would quote it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from batchgen.domain.formats import (
    NATIVE_KINDS,
    embeddings_api,
    gemini_embeddings,
    refusal,
    responses_api,
    tokens,
)
from batchgen.domain.formats.endpoints import (
    BATCH_ENDPOINTS,
    CHAT_COMPLETIONS,
    EMBEDDINGS,
    RESPONSES,
    not_served,
    unknown_endpoint,
)
from batchgen.domain.lifecycle.deadlines import parse_duration_s
from batchgen.errors import PayloadTooLarge, ValidationFailed
from batchgen.registry import ModelSpec, ProviderKind, Registry

MAX_CUSTOM_ID_CHARS = 512


@dataclass(slots=True)
class ItemDraft:
    """One validated request line, ready to store."""

    line_no: int
    custom_id: str
    model: str
    body: dict[str, Any]
    prompt_tokens_est: int
    # The output tokens reserved for the item: n (choices) times one choice's bound.
    max_tokens: int
    timeout_s: float | None = None  # optional per-item deadline, from admission
    # The line's url: the endpoint its request goes to (one for a whole batch).
    endpoint: str = CHAT_COMPLETIONS
    # The body as canonical JSON, once RequestFingerprint.track has spelled it (what
    # the store writes: the body is serialized once).
    body_json: str | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    max_lines: int
    max_bytes: int
    max_tokenize_bytes: int | None = None  # prompt text handed to the tokenizer, all lines


@dataclass(slots=True)
class TokenizeBudget:
    """How much prompt text one request may still hand the tokenizer."""

    max_bytes: int | None
    spent: int = 0

    def spend(self, text_bytes: int, line_no: int) -> None:
        self.spent += text_bytes
        if self.max_bytes is not None and self.spent > self.max_bytes:
            raise PayloadTooLarge(
                f"the batch's prompts hold more than {self.max_bytes} bytes of text to "
                "count; split it",
                line=line_no,
            )


# JSON escapes that may decode to text PostgreSQL refuses: NUL, or a surrogate.
_SUSPECT_ESCAPE = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")


def _storable(text: str) -> bool:
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # an unpaired surrogate
        return False
    return True


def unstorable_path(value: Any, path: str = "") -> str | None:
    """The path of the first string (key or value) that PostgreSQL cannot store, or None.

    Such a string holds a NUL character or an unpaired surrogate. Paths read
    ``body.messages[0].content``.
    """
    if isinstance(value, str):
        return None if _storable(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            if not _storable(str(key)):
                return path or "(key)"
            found = unstorable_path(item, sub)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = unstorable_path(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


UNSTORABLE = "contains a NUL character (\\u0000) or an unpaired surrogate, which cannot be stored"


def canonical_text(value: Any) -> str:
    """``value`` as canonical JSON: keys sorted, no spaces, text as is (not escaped), so
    neither key order nor whitespace changes it."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _canonical(value: Any) -> bytes:
    return canonical_text(value).encode()


def canonical_sha256(value: Any) -> str:
    """SHA-256 (hex) of ``value``'s canonical JSON (:func:`canonical_text`)."""
    return hashlib.sha256(_canonical(value)).hexdigest()


@dataclass
class RequestFingerprint:
    """SHA-256 of what a submit asks for: its parameters and every validated line.

    Spelled canonically (key order, whitespace, line endings and blank lines do
    not matter), so a resubmit of the same request matches however its JSON
    was written, and any other body or parameter does not.
    """

    params: dict[str, Any]
    _hash: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._hash = hashlib.sha256(_canonical(self.params) + b"\n")

    def track(self, drafts: Iterable[ItemDraft]) -> Iterator[ItemDraft]:
        """Pass ``drafts`` through, adding each to the fingerprint."""
        for d in drafts:
            # The canonical spelling of [custom_id, body, timeout_s], the body's part kept.
            d.body_json = canonical_text(d.body)
            line = f"[{canonical_text(d.custom_id)},{d.body_json},{canonical_text(d.timeout_s)}]"
            if d.endpoint != CHAT_COMPLETIONS:  # a chat line is spelled as it always was
                line += canonical_text(d.endpoint)
            self._hash.update(line.encode() + b"\n")
            yield d

    def hexdigest(self) -> str:
        return str(self._hash.hexdigest())


def _fail(line_no: int, field: str | None, message: str) -> ValidationFailed:
    where = f"line {line_no}" + (f", field {field!r}" if field else "")
    return ValidationFailed(f"{where}: {message}", line=line_no, field=field)


# The output-token fields a chat body may carry (OpenAI's current name, then the legacy
# one). Providers differ on which wins when both are given (OpenAI and vLLM read
# max_completion_tokens; a proxy may pass max_tokens on), so each is checked and the
# larger is reserved: whichever the provider honours, the reservation covers it.
MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens")
# OpenAI's bound on ``n`` (choices per request).
MAX_CHOICES = 128


def _token_field(body: dict[str, Any], key: str, line_no: int, limit: int, model: str) -> int:
    value = body[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(line_no, f"body.{key}", "must be an integer")
    if value <= 0:
        raise _fail(line_no, f"body.{key}", "must be greater than 0")
    if value > limit:
        raise _fail(line_no, f"body.{key}", f"{value} exceeds the limit of {limit} for {model}")
    return value


def _max_tokens(
    body: dict[str, Any],
    line_no: int,
    limit: int,
    model: str,
    fields: tuple[str, ...] = MAX_TOKENS_FIELDS,
) -> int:
    """The most output tokens one choice may take: the larger of the fields given (each
    checked; null is not given), else the model's maximum, as the provider would allow."""
    given = [
        _token_field(body, k, line_no, limit, model) for k in fields if body.get(k) is not None
    ]
    return max(given, default=limit)


def choices(body: dict[str, Any], line_no: int = 0) -> int:
    """``n``, the choices the provider generates for the request (each up to its max
    output tokens); 1 when absent."""
    value = body.get("n", 1)
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_CHOICES:
        raise _fail(line_no, "body.n", f"must be an integer from 1 to {MAX_CHOICES}")
    return value


def per_choice_max_tokens(body: dict[str, Any], reserved_output_tokens: int) -> int:
    """One choice's output bound, from an item's reserved output tokens (``n`` times it)."""
    return reserved_output_tokens // choices(body)


def _messages(body: dict[str, Any], line_no: int) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise _fail(line_no, "body.messages", "is required")
    if not isinstance(messages, list) or not messages:
        raise _fail(line_no, "body.messages", "must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _fail(line_no, f"body.messages[{i}]", "must be an object")
        if not isinstance(message.get("role"), str):
            raise _fail(line_no, f"body.messages[{i}].role", "is required")
        if "content" not in message:
            raise _fail(line_no, f"body.messages[{i}].content", "is required")
    return messages


def _check_fits(
    body: dict[str, Any],
    messages: list[dict[str, Any]],
    line_no: int,
    spec: ModelSpec,
    max_tokens: int,
    budget: TokenizeBudget,
    field: str = "body.messages",
) -> int:
    """The prompt's tokens (its text, and its images, tools and response_format schema
    the provider's way); refuses a prompt that cannot fit the context window, cheaply by
    its byte length first, and counts no further than the window."""
    allowed = spec.context_window - max_tokens
    extras = tokens.count_extras(
        body, messages, spec.encoding, spec.provider is ProviderKind.ANTHROPIC
    )
    size = tokens.text_bytes(messages)
    floor = tokens.min_tokens(size, spec.encoding) + extras
    prompt_tokens = floor
    if floor <= allowed:
        budget.spend(size, line_no)
        left = allowed - extras
        prompt_tokens = extras + tokens.count_messages(messages, spec.encoding, limit=left)
    if prompt_tokens > allowed:
        raise _fail(
            line_no,
            field,
            f"a prompt of more than {max(allowed, 0)} tokens plus max_tokens {max_tokens} "
            f"exceeds the context window of {spec.context_window} for {spec.name}",
        )
    return prompt_tokens


def _chat(
    body: dict[str, Any], line_no: int, spec: ModelSpec, budget: TokenizeBudget
) -> tuple[int, int]:
    """A chat request's prompt tokens and reserved output tokens."""
    messages = _messages(body, line_no)
    max_tokens = _max_tokens(body, line_no, spec.output_cap, spec.name)
    n = choices(body, line_no)
    _translatable(body, line_no, spec)
    # The context window holds the prompt and one choice; the budget pays for all n.
    return _check_fits(body, messages, line_no, spec, max_tokens, budget), n * max_tokens


def _translatable(body: dict[str, Any], line_no: int, spec: ModelSpec) -> None:
    """Refuse, naming the field, a chat request that a native-format provider of the
    model (Gemini, Vertex AI, Bedrock: any of its deployments) could not be sent whole
    (:mod:`batchgen.domain.formats`)."""
    kinds = sorted({d.provider.value for d in spec.deployments} & NATIVE_KINDS)
    for kind in kinds:
        why = refusal(body, kind)
        if why is not None:
            raise _fail(line_no, why.field, why.message)


def _responses(
    body: dict[str, Any], line_no: int, spec: ModelSpec, budget: TokenizeBudget
) -> tuple[int, int]:
    """A Responses request's prompt tokens (``input``, ``instructions``, tools) and its
    output bound (``max_output_tokens``, else the model's)."""
    responses_api.check_body(body)
    max_tokens = _max_tokens(body, line_no, spec.output_cap, spec.name, ("max_output_tokens",))
    prompt = responses_api.prompt(body)
    messages, extras = prompt.messages, prompt.extras
    fits = _check_fits(extras, messages, line_no, spec, max_tokens, budget, "body.input")
    return fits, max_tokens


def _embeddings(
    body: dict[str, Any], line_no: int, spec: ModelSpec, budget: TokenizeBudget
) -> tuple[int, int]:
    """An embeddings request's input tokens; it reserves no output."""
    inputs = embeddings_api.inputs(body)
    embeddings_api.check_options(body, spec)
    for kind in sorted({d.provider.value for d in spec.deployments} & NATIVE_KINDS):
        why = gemini_embeddings.refusal(body, kind)
        if why is not None:
            raise _fail(line_no, why.field, why.message)
    return embeddings_api.count(inputs, spec, lambda size: budget.spend(size, line_no)), 0


_KINDS = {CHAT_COMPLETIONS: _chat, RESPONSES: _responses, EMBEDDINGS: _embeddings}


def validate_line(
    raw: bytes,
    line_no: int,
    registry: Registry,
    budget: TokenizeBudget | None = None,
    endpoint: str | None = None,
) -> ItemDraft:
    """Validate one JSONL line; raises :class:`ValidationFailed`. ``endpoint``: the one
    its ``url`` must name (None: any endpoint batchgen runs)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(line_no, None, f"not valid UTF-8 (byte {exc.start})") from exc
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(line_no, None, f"malformed JSON: {exc.msg} at column {exc.colno}") from exc
    if not isinstance(obj, dict):
        raise _fail(line_no, None, "must be a JSON object")
    if _SUSPECT_ESCAPE.search(raw):
        bad = unstorable_path(obj)
        if bad is not None:
            raise _fail(line_no, bad, UNSTORABLE)

    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _fail(line_no, "custom_id", "is required and must be a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise _fail(line_no, "custom_id", f"longer than {MAX_CUSTOM_ID_CHARS} characters")
    method = obj.get("method", "POST")
    if method != "POST":
        raise _fail(line_no, "method", "must be POST")
    url = obj.get("url")
    if url not in BATCH_ENDPOINTS:
        raise _fail(line_no, "url", unknown_endpoint(url))
    if endpoint is not None and url != endpoint:
        raise _fail(
            line_no,
            "url",
            f"{url!r} is not the batch's endpoint {endpoint!r}: "
            "the requests of a batch all go to its endpoint",
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _fail(line_no, "body", "is required and must be an object")
    model_name = body.get("model")
    if not isinstance(model_name, str):
        raise _fail(line_no, "body.model", "is required")
    spec = registry.get(model_name)
    if spec is None:
        raise _fail(line_no, "body.model", registry.unknown(model_name))
    refused = not_served(spec, url)
    if refused is not None:
        raise _fail(line_no, "body.model", refused)
    if body.get("stream"):
        raise _fail(line_no, "body.stream", "streaming is not available in batches")
    try:
        prompt_tokens, max_tokens = _KINDS[url](body, line_no, spec, budget or TokenizeBudget(None))
    except ValidationFailed as exc:
        if exc.line is not None:
            raise
        raise _fail(line_no, exc.field, exc.message) from None
    timeout_s = None
    if "timeout" in obj:  # our extension of the Batch format: a per-item deadline
        try:
            timeout_s = parse_duration_s(obj["timeout"], "timeout")
        except ValidationFailed as exc:
            raise _fail(line_no, "timeout", exc.message) from exc
    return ItemDraft(
        line_no, custom_id, model_name, body, prompt_tokens, max_tokens, timeout_s, url
    )


def binding_tokens_per_min(spec: ModelSpec, tenant_tokens_per_min: int | None) -> tuple[int, str]:
    """The tokens-per-minute limit one request must fit within, and its name: the
    tenant's own or the model's, whichever is smaller (a pooled model's largest
    deployment's: one request runs on one deployment)."""
    largest = max(spec.deployments, key=lambda d: d.tokens_per_min)
    if tenant_tokens_per_min is not None and tenant_tokens_per_min <= largest.tokens_per_min:
        return tenant_tokens_per_min, "the tenant's tokens_per_min"
    if spec.pooled:
        return largest.tokens_per_min, (
            f"the tokens_per_min of {spec.name}'s largest deployment {largest.name!r}"
        )
    return largest.tokens_per_min, f"the tokens_per_min of {spec.name}"


def never_fits(tokens: int, spec: ModelSpec, tenant_tokens_per_min: int | None) -> str | None:
    """Why a request reserving ``tokens`` (its prompt and every choice's max output) can
    never be granted, naming the limit that binds; None when it can."""
    limit, name = binding_tokens_per_min(spec, tenant_tokens_per_min)
    if tokens <= limit:
        return None
    return (
        f"a request of {tokens} tokens (the prompt plus max_tokens times n) can never fit "
        f"{name} of {limit}"
    )


def fitting(
    drafts: Iterable[ItemDraft], registry: Registry, tenant_tokens_per_min: int | None
) -> Iterator[ItemDraft]:
    """The drafts, refusing the first one that could never be granted (it would wait
    for ever): :func:`never_fits`."""
    for draft in drafts:
        tokens = draft.prompt_tokens_est + draft.max_tokens
        why = never_fits(tokens, registry[draft.model], tenant_tokens_per_min)
        if why is not None:
            raise _fail(draft.line_no, _size_field(draft.body), why)
        yield draft


def _size_field(body: dict[str, Any]) -> str:
    """The field that sets a request's size: its output bound when it has one."""
    given = [k for k in (*MAX_TOKENS_FIELDS, "max_output_tokens") if body.get(k) is not None]
    return f"body.{given[0]}" if given else "body"


def iter_lines(stream: Iterable[bytes], limits: Limits) -> Iterator[tuple[int, bytes]]:
    """Numbered non-blank lines of a byte stream, enforcing line and byte limits."""
    total_bytes = 0
    line_no = 0
    count = 0
    for raw in stream:
        total_bytes += len(raw)
        if total_bytes > limits.max_bytes:
            raise PayloadTooLarge(f"body larger than {limits.max_bytes} bytes")
        line_no += 1
        if not raw.strip():
            continue
        count += 1
        if count > limits.max_lines:
            raise PayloadTooLarge(f"more than {limits.max_lines} lines", line=line_no)
        yield line_no, raw.rstrip(b"\r\n")


def parse_lines(
    stream: Iterable[bytes], registry: Registry, limits: Limits, endpoint: str | None = None
) -> Iterator[ItemDraft]:
    """Validate a JSONL body line by line; duplicates of custom_id are rejected. Every
    line's ``url`` must be ``endpoint`` (None: the first line's)."""
    seen: set[str] = set()
    any_line = False
    budget = TokenizeBudget(limits.max_tokenize_bytes)
    for line_no, raw in iter_lines(stream, limits):
        any_line = True
        draft = validate_line(raw, line_no, registry, budget, endpoint)
        endpoint = draft.endpoint
        if draft.custom_id in seen:
            raise _fail(line_no, "custom_id", f"duplicate custom_id {draft.custom_id!r}")
        seen.add(draft.custom_id)
        yield draft
    if not any_line:
        raise ValidationFailed("the batch is empty: no request lines")
