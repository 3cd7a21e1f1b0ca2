"""Answers beyond plain text: tool calls, ``n`` choices, logprobs, prompt caching, reasoning.

A request asks for one of these with the fields the real APIs read:

- ``tools`` (either API): the answer is one deterministic call of the first tool
  (OpenAI ``tool_calls``, finish ``tool_calls``; Anthropic a ``tool_use`` block,
  stop ``tool_use``), arguments ``{"query": <the digest of the prompt>}``;
- ``n`` > 1 (OpenAI): that many choices, each the same answer (choice ``i`` a call
  id ending in ``_i``);
- ``logprobs`` (OpenAI): ``logprobs.content``, one entry per stream piece, with
  ``top_logprobs`` alternatives when asked for;
- a repeated prefix (OpenAI: every message but the last, warm in the key's cache for
  the model, of 1024 tokens or more) reports
  ``usage.prompt_tokens_details.cached_tokens`` (rounded down to a multiple of 128,
  as OpenAI does); ``cache_control`` on any block (Anthropic) of a request whose
  cached prefix (system and tools) is ``prompt_cache_min_tokens`` or longer reports
  ``cache_creation_input_tokens`` when the prefix is cold and
  ``cache_read_input_tokens`` when it is warm (:mod:`batchgen.simulator.caching`:
  warm for ``prompt_cache_ttl_s`` after its last use);
- a reasoning model (name starting ``o<digit>`` or containing ``reason``) or
  ``reasoning_effort`` reports ``completion_tokens_details.reasoning_tokens``;
  Anthropic ``thinking`` adds a ``thinking`` block before the answer.

The streamed form sends the same answer chunk by chunk (tool-call argument deltas,
``input_json_delta``, ``thinking_delta``), so the chunks merge into the plain answer.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

from batchgen.domain.formats.tokens import count_messages, count_text
from batchgen.simulator.caching import PromptCache, Scope
from batchgen.simulator.text import request_digest, split_chunks

_REASONING_MODEL = re.compile(r"^o\d|reason", re.IGNORECASE)
# OpenAI caches prompts from 1024 tokens on, in steps of 128.
OPENAI_CACHE_MIN_TOKENS = 1024
OPENAI_CACHE_STEP_TOKENS = 128
_THINKING_TEXT = "Working through the request step by step."


def wants_rich(api: str, body: Mapping[str, Any], model: str, cached_tokens: int = 0) -> bool:
    """True when the request asks for anything but one plain text answer (or repeats a
    prefix: ``cached_tokens``, from :func:`openai_cached_tokens`)."""
    if (
        cached_tokens
        or body.get("tools")
        or _REASONING_MODEL.search(model)
        or body.get("reasoning_effort")
    ):
        return True
    if api == "anthropic":
        return bool(body.get("thinking")) or _has_cache_control(body)
    n = body.get("n")
    return bool(body.get("logprobs")) or (type(n) is int and n > 1)


def openai_cached_tokens(
    cache: PromptCache, scope: Scope, body: Mapping[str, Any], encoding: str
) -> int:
    """The cached tokens of an OpenAI request, as OpenAI counts them: its prefix (all
    messages but the last) warm in ``scope``'s cache and of at least 1024 tokens,
    rounded down to a multiple of 128; else 0. The prefix is warm from now on."""
    messages = body.get("messages")
    if not isinstance(messages, list) or len(messages) < 2:
        return 0
    head = messages[:-1]
    canonical = json.dumps(head, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if len(canonical.encode()) < OPENAI_CACHE_MIN_TOKENS:  # a token is a byte or more
        return 0
    tokens = count_messages(head, encoding)
    if tokens < OPENAI_CACHE_MIN_TOKENS:
        return 0
    if not cache.use(scope, _prefix_key("openai", head)):
        return 0
    return tokens - tokens % OPENAI_CACHE_STEP_TOKENS


def _has_cache_control(value: Any) -> bool:
    if isinstance(value, Mapping):
        return "cache_control" in value or any(_has_cache_control(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_cache_control(v) for v in value)
    return False


def _head_text(head: Mapping[str, Any]) -> str:
    """The text of an Anthropic request's cached prefix: its system prompt's text and
    its tools' definitions."""
    system = head.get("system")
    if isinstance(system, list):
        system = "".join(b.get("text", "") for b in system if isinstance(b, Mapping))
    tools = head.get("tools")
    return (system if isinstance(system, str) else "") + (
        json.dumps(tools, ensure_ascii=False, sort_keys=True) if tools else ""
    )


def _prefix_key(key: str, value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{key}\x00{canonical}".encode()).hexdigest()


def _tool_call(tools: list[Any], digest: str, api: str, i: int = 0) -> tuple[str, str, str]:
    """``(id, name, arguments JSON)`` of the deterministic call of the first tool."""
    tool = tools[0] if isinstance(tools[0], Mapping) else {}
    name = (tool.get("function") or {}).get("name") if api == "openai" else tool.get("name")
    prefix = "toolu_" if api == "anthropic" else "call_"
    return f"{prefix}{digest}_{i}", str(name or "tool"), json.dumps({"query": digest})


def _logprob(piece: str, top: int) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "token": piece,
        "logprob": -round(0.01 * (1 + len(piece) % 7), 4),
        "bytes": list(piece.encode()),
        "top_logprobs": [],
    }
    for k in range(top):
        alt = piece if k == 0 else f"{piece.strip()}#{k}"
        entry["top_logprobs"].append(
            {"token": alt, "logprob": -round(0.01 * (1 + k) * 3, 4), "bytes": list(alt.encode())}
        )
    return entry


class RichAnswer:
    """One request's answer in either API's form, plain or as stream events."""

    def __init__(
        self,
        api: str,
        body: Mapping[str, Any],
        rid: str,
        model: str,
        answer: tuple[str, int, str],
        prompt_tokens: int,
        cache: PromptCache,
        encoding: str,
        cached_tokens: int = 0,
        scope: Scope = ("anonymous", ""),
    ) -> None:
        self.api, self.body, self.rid, self.model = api, body, rid, model
        self.text, self.ctoks, finish = answer
        self.prompt = prompt_tokens
        self.digest = request_digest(body.get("messages") or [])
        self.tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        self.finish = "tool_calls" if self.tools else finish
        self.pieces = split_chunks(self.text)
        n = body.get("n")
        self.n = n if api == "openai" and type(n) is int and n > 1 else 1
        top = body.get("top_logprobs")
        self.top = top if type(top) is int and top > 0 else 0
        self.reasoning = (
            min(self.ctoks, max(1, self.ctoks // 2))
            if _REASONING_MODEL.search(model) or body.get("reasoning_effort")
            else None
        )
        self.cached, self.cache_write = self._cache(cache, scope, encoding, cached_tokens)

    def _cache(
        self, cache: PromptCache, scope: Scope, encoding: str, cached: int
    ) -> tuple[int, int]:
        """Tokens read from the cache and (Anthropic) written to it."""
        if self.api == "anthropic":
            if not _has_cache_control(self.body):
                return 0, 0
            head = {"system": self.body.get("system"), "tools": self.body.get("tools")}
            tokens = min(self.prompt - 1, max(1, count_text(_head_text(head), encoding)))
            if tokens < cache.min_tokens:  # too short to be cached: billed as plain input
                return 0, 0
            if cache.use(scope, _prefix_key("anthropic", head)):
                return tokens, 0
            return 0, tokens
        return min(self.prompt, cached), 0

    # -- OpenAI ----------------------------------------------------------------
    def _openai_usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt,
            "completion_tokens": self.ctoks,
            "total_tokens": self.prompt + self.ctoks,
            "prompt_tokens_details": {"cached_tokens": self.cached, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": self.reasoning or 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        }

    def _logprobs(self) -> dict[str, Any] | None:
        if not self.body.get("logprobs") or self.tools:
            return None
        return {"content": [_logprob(p, self.top) for p in self.pieces], "refusal": None}

    def openai_completion(self, created: int) -> dict[str, Any]:
        choices = []
        for i in range(self.n):
            message: dict[str, Any] = {"role": "assistant", "content": self.text, "refusal": None}
            if self.tools:
                cid, name, args = _tool_call(self.tools, self.digest, "openai", i)
                message["content"] = None
                message["tool_calls"] = [
                    {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                ]
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self._logprobs(),
                    "finish_reason": self.finish,
                }
            )
        return {
            "id": self.rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": self._openai_usage(),
        }

    def openai_chunks(self, created: int, include_usage: bool) -> Iterator[dict[str, Any]]:
        head = {
            "id": self.rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.model,
            "system_fingerprint": None,
        }
        extra = {"usage": None} if include_usage else {}

        def chunk(i: int, delta: dict[str, Any], **more: Any) -> dict[str, Any]:
            part = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None, **more}
            return {**head, "choices": [part], **extra}

        for i in range(self.n):
            if self.tools:
                yield chunk(i, {"role": "assistant", "content": None, "refusal": None})
                cid, name, args = _tool_call(self.tools, self.digest, "openai", i)
                first = {"index": 0, "id": cid, "type": "function"}
                first["function"] = {"name": name, "arguments": ""}
                yield chunk(i, {"tool_calls": [first]})
                half = len(args) // 2
                for part in (args[:half], args[half:]):
                    yield chunk(i, {"tool_calls": [{"index": 0, "function": {"arguments": part}}]})
            else:
                yield chunk(i, {"role": "assistant", "content": "", "refusal": None})
                want_logprobs = bool(self.body.get("logprobs"))
                for piece in self.pieces:
                    logprobs = (
                        {"content": [_logprob(piece, self.top)], "refusal": None}
                        if want_logprobs
                        else None
                    )
                    yield chunk(i, {"content": piece}, logprobs=logprobs)
            yield chunk(i, {}, finish_reason=self.finish)
        if include_usage:
            yield {**head, "choices": [], "usage": self._openai_usage()}

    # -- Anthropic -------------------------------------------------------------
    def _anthropic_usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt - self.cached - self.cache_write,
            "cache_creation_input_tokens": self.cache_write,
            "cache_read_input_tokens": self.cached,
            "output_tokens": self.ctoks,
        }

    def _stop_reason(self) -> str:
        if self.tools:
            return "tool_use"
        return "max_tokens" if self.finish == "length" else "end_turn"

    def anthropic_blocks(self) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = []
        if self.body.get("thinking"):
            signature = "sig_" + self.digest
            blocks.append({"type": "thinking", "thinking": _THINKING_TEXT, "signature": signature})
        if self.tools:
            cid, name, args = _tool_call(self.tools, self.digest, "anthropic")
            blocks.append({"type": "tool_use", "id": cid, "name": name, "input": json.loads(args)})
        else:
            blocks.append({"type": "text", "text": self.text})
        return blocks

    def anthropic_message(self) -> dict[str, Any]:
        return {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.anthropic_blocks(),
            "stop_reason": self._stop_reason(),
            "stop_sequence": None,
            "usage": self._anthropic_usage(),
        }

    def anthropic_events(self) -> Iterator[tuple[str, dict[str, Any]]]:
        message = self.anthropic_message()
        usage = {**message["usage"], "output_tokens": 1}
        start = {**message, "content": [], "stop_reason": None, "usage": usage}
        yield "message_start", {"type": "message_start", "message": start}
        for index, block in enumerate(message["content"]):
            kind = block["type"]
            if kind == "text":
                shell: dict[str, Any] = {"type": "text", "text": ""}
                deltas = [{"type": "text_delta", "text": p} for p in self.pieces]
            elif kind == "thinking":
                shell = {"type": "thinking", "thinking": "", "signature": ""}
                deltas = [
                    {"type": "thinking_delta", "thinking": block["thinking"]},
                    {"type": "signature_delta", "signature": block["signature"]},
                ]
            else:
                shell = {**block, "input": {}}
                raw = json.dumps(block["input"])
                half = math.ceil(len(raw) / 2)
                deltas = [
                    {"type": "input_json_delta", "partial_json": part}
                    for part in (raw[:half], raw[half:])
                ]
            start_block = {"type": "content_block_start", "index": index, "content_block": shell}
            yield "content_block_start", start_block
            for delta in deltas:
                yield (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": delta,
                    },
                )
            yield "content_block_stop", {"type": "content_block_stop", "index": index}
        end_usage = {k: v for k, v in message["usage"].items()}
        yield (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                "usage": end_usage,
            },
        )
        yield "message_stop", {"type": "message_stop"}
