"""Requests and answers (pure): endpoints, validation, tokens, streams, and the other
providers' native formats.

Requests: :mod:`.endpoints`, :mod:`.admission` (a batch's input lines),
:mod:`.responses_api`, :mod:`.embeddings_api`, :mod:`.message_batches`,
:mod:`.call_rules` (a synchronous call's deadline and fail-fast rule), :mod:`.tokens`,
:mod:`.image_size`, :mod:`.prompt_cache`. Answers: :mod:`.answers`,
:mod:`.response_stream`, :mod:`.call_streams`, :mod:`.stream_usage`.

OpenAI chat requests and answers in and out of the other providers' native formats:

:mod:`.chat` reads an OpenAI chat body into the parts every format shares (system
text, turns of text, images, tool calls and tool results; tools, tool choice, a
JSON schema, sampling) and refuses, naming the field, what a provider kind cannot
take; :mod:`.gemini_chat` writes them as a Gemini ``generateContent`` request (the Gemini
API and Vertex AI alike) and reads its answer back as a ``chat.completion`` (and its
stream as ``chat.completion.chunk`` objects); :mod:`.bedrock_converse` does the same for
Bedrock's Converse / ConverseStream.

No SDK is imported here: the adapters (:mod:`batchgen.providers.gemini`,
:mod:`batchgen.providers.bedrock`) hand these functions plain dicts.
"""

from __future__ import annotations

from batchgen.domain.formats.chat import (
    BEDROCK,
    GEMINI,
    NATIVE_KINDS,
    VERTEX,
    Untranslatable,
    parse_chat,
    refusal,
)

__all__ = [
    "BEDROCK",
    "GEMINI",
    "NATIVE_KINDS",
    "VERTEX",
    "Untranslatable",
    "parse_chat",
    "refusal",
]
