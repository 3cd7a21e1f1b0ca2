"""The provider's own count of a streamed call's tokens, read from its chunks as they come,
and where a ledger row's usage came from (pure).

A stream reports its usage at its end: an OpenAI stream in its last chunk (batchgen
always asks for it: ``stream_options.include_usage``), an Anthropic one in
``message_start`` (the input) and ``message_delta`` (the output). Kept as soon as it
arrives, before the chunk is passed on (:mod:`batchgen.worker.execution`), it lets the
sweep ledger what the provider billed for a call whose process died before it recorded
the answer (:func:`batchgen.store.ledger.record_lost_call`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

# Anthropic's input counts: the uncached input, cache writes and cache reads.
_ANTHROPIC_INPUTS = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


class UsageSource(StrEnum):
    """Where a ledger row's tokens come from (``usage_ledger.usage_source``)."""

    PROVIDER = "provider"  # the provider's usage, as its answer (or its stream) said
    ESTIMATE = "estimate"  # no usage came back: what the call reserved


@dataclass(frozen=True)
class ReportedUsage:
    """A call's tokens as the provider reported them; ``body`` holds its usage object
    (``{"usage": ...}``), whose token kinds :func:`batchgen.domain.billing.cost.usage_of` reads."""

    prompt_tokens: int
    completion_tokens: int
    body: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt_tokens, "completion": self.completion_tokens, **self.body}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ReportedUsage:
        usage = data.get("usage")
        body = {"usage": dict(usage)} if isinstance(usage, Mapping) else {}
        return cls(int(data["prompt"]), int(data["completion"]), body)


@dataclass
class StreamUsage:
    """Reads a stream's chunks in order (an OpenAI ``chat.completion.chunk`` or an
    Anthropic event, as relayed); :meth:`add` returns the usage once the stream has
    reported it whole."""

    _anthropic_input: dict[str, Any] = field(default_factory=dict)

    def add(self, chunk: Mapping[str, Any]) -> ReportedUsage | None:
        kind = chunk.get("type")
        if kind == "message_start":
            message = chunk.get("message")
            usage = message.get("usage") if isinstance(message, Mapping) else None
            self._anthropic_input = dict(usage) if isinstance(usage, Mapping) else {}
            return None
        if kind == "message_delta":
            return self._anthropic_end(chunk.get("usage"))
        usage = chunk.get("usage")
        if isinstance(usage, Mapping) and "completion_tokens" in usage:
            prompt, completion = int(usage["prompt_tokens"]), int(usage["completion_tokens"])
            return ReportedUsage(prompt, completion, {"usage": dict(usage)})
        return None

    def _anthropic_end(self, delta: Any) -> ReportedUsage | None:
        """``message_delta`` carries the output count (and, on some servers, the input
        counts again: the later word wins)."""
        if not isinstance(delta, Mapping) or delta.get("output_tokens") is None:
            return None
        usage = {**self._anthropic_input, **{k: v for k, v in delta.items() if v is not None}}
        prompt = sum(int(usage.get(name) or 0) for name in _ANTHROPIC_INPUTS)
        return ReportedUsage(prompt, int(usage["output_tokens"]), {"usage": usage})
