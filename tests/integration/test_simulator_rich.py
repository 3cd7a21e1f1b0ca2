"""The simulator's answers beyond plain text (simulator.rich), over HTTP with both SDKs:
tool calls, n choices, logprobs, cached and reasoning token usage, thinking, and their
streams chunk by chunk (which merge back into the plain answer)."""

from __future__ import annotations

from typing import Any

import anthropic
import openai

from tests import http_client
from tests.integration import test_simulator

# The simulator's fixtures (reset to the test settings, both SDKs on it).
sim, base = test_simulator.sim, test_simulator.base
oai, claude = test_simulator.oai, test_simulator.claude

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a product up.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]
CLAUDE_TOOLS = [
    {
        "name": "lookup",
        "description": "Look a product up.",
        "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}},
    }
]
ASKED = [{"role": "user", "content": "Find the red chair."}]


def _merged(chunks: list[Any]) -> dict[int, dict[str, Any]]:
    """Each choice of an OpenAI stream, as the SDK's chunks carry it, merged by hand."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            got = out.setdefault(c.index, {"content": "", "args": "", "logprobs": [], "calls": 0})
            got["content"] += c.delta.content or ""
            for call in c.delta.tool_calls or ():
                got["calls"] += 1 if call.id else 0
                got["args"] += (call.function.arguments or "") if call.function else ""
            if c.logprobs and c.logprobs.content:
                got["logprobs"].extend(c.logprobs.content)
            got["finish"] = c.finish_reason or got.get("finish")
    return out


def test_tools_answer_with_a_deterministic_tool_call(oai: openai.OpenAI):
    first = oai.chat.completions.create(model="sim-gpt", messages=ASKED, tools=TOOLS)  # type: ignore[arg-type]
    again = oai.chat.completions.create(model="sim-gpt", messages=ASKED, tools=TOOLS)  # type: ignore[arg-type]
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "lookup"  # type: ignore[union-attr]
    assert calls[0].function.arguments.startswith('{"query": ')  # type: ignore[union-attr]
    assert again.choices[0].message.tool_calls == calls  # same request, same call

    stream = oai.chat.completions.create(
        model="sim-gpt",
        messages=ASKED,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        stream=True,
    )
    merged = _merged(list(stream))[0]
    assert merged["calls"] == 1 and merged["finish"] == "tool_calls"
    assert merged["args"] == calls[0].function.arguments  # type: ignore[union-attr]


def test_n_choices_and_logprobs_plain_and_streamed(oai: openai.OpenAI):
    asked: dict[str, Any] = {
        "model": "sim-gpt",
        "messages": ASKED,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "max_tokens": 40,
    }
    plain = oai.chat.completions.create(**asked)
    assert [c.index for c in plain.choices] == [0, 1]
    for choice in plain.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        tokens = "".join(t.token for t in choice.logprobs.content)
        assert tokens == choice.message.content
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    chunks = list(oai.chat.completions.create(**asked, stream=True))
    assert len(chunks) > 4  # chunk by chunk, not one answer
    merged = _merged(chunks)
    assert sorted(merged) == [0, 1]
    for i, choice in enumerate(plain.choices):
        assert merged[i]["content"] == choice.message.content
        assert merged[i]["logprobs"] == choice.logprobs.content  # type: ignore[union-attr]


def test_a_repeated_prefix_reports_cached_tokens(oai: openai.OpenAI):
    system = {"role": "system", "content": "You are a terse catalog assistant. " * 200}
    first = oai.chat.completions.create(
        model="sim-gpt",
        messages=[system, {"role": "user", "content": "A chair."}],  # type: ignore[list-item]
    )
    second = oai.chat.completions.create(
        model="sim-gpt",
        messages=[system, {"role": "user", "content": "A lamp."}],  # type: ignore[list-item]
    )
    assert first.usage.prompt_tokens_details is None  # type: ignore[union-attr]
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert 1024 <= cached < second.usage.prompt_tokens and cached % 128 == 0  # type: ignore[union-attr]


def test_a_reasoning_model_reports_reasoning_tokens(oai: openai.OpenAI):
    answer = oai.chat.completions.create(model="o3-mini", messages=ASKED)  # type: ignore[arg-type]
    details = answer.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None and 0 < details.reasoning_tokens <= answer.usage.completion_tokens  # type: ignore[operator, union-attr]
    plain = oai.chat.completions.create(model="sim-gpt", messages=ASKED)  # type: ignore[arg-type]
    assert plain.usage.completion_tokens_details is None  # type: ignore[union-attr]


def test_anthropic_tool_use_thinking_and_cache_control(claude: anthropic.Anthropic, base: str):
    system = [
        {
            "type": "text",
            "text": "You are a catalog assistant. " * 200,  # cacheable: 1024 tokens or more
            "cache_control": {"type": "ephemeral"},
        }
    ]
    params: dict[str, Any] = {
        "model": "sim-claude",
        "max_tokens": 200,
        "system": system,
        "tools": CLAUDE_TOOLS,
        "thinking": {"type": "enabled", "budget_tokens": 100},
        "messages": [{"role": "user", "content": "Find the red chair."}],
    }
    first = claude.messages.create(**params)
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    assert first.stop_reason == "tool_use"
    tool = first.content[1]
    assert tool.name == "lookup" and set(tool.input) == {"query"}  # type: ignore[union-attr]
    written = first.usage.cache_creation_input_tokens
    assert written and first.usage.cache_read_input_tokens == 0
    second = claude.messages.create(**params)
    assert second.usage.cache_read_input_tokens == written
    assert second.usage.cache_creation_input_tokens == 0
    last = http_client.get(base + "/_sim/last_request", params={"api": "anthropic"}).json()
    assert last["system"] == system and last["tools"] == CLAUDE_TOOLS

    with claude.messages.stream(**params) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert sum(e.type == "content_block_delta" for e in events) >= 3  # chunk by chunk
    assert final.content == second.content and final.usage == second.usage
