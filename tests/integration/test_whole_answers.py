"""Every answer comes back whole: what the provider returned reaches the caller unchanged
through a batch's output file, Anthropic message-batch results, a sync call and a sync
stream, with both official SDKs; and what the caller sent reaches the provider unchanged.

"Unchanged" is checked against the same SDK calling the simulator directly: the JSON
is equal apart from the answer's ``id`` and ``created`` (each call is a new answer). A
stream is compared as the SDK's own accumulator merges it (``get_final_completion``,
``get_final_message``). The simulator answers deterministically (simulator.rich)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from batchgen.registry import get_registry
from tests import http_client
from tests.helpers import anthropic_batch_ended, make_tenant, openai_batch_in
from tests.integration.test_simulator_rich import CLAUDE_TOOLS, TOOLS

# A system prompt long enough for OpenAI's prompt cache (1024 tokens and more).
LONG_SYSTEM = "You are a terse catalog assistant for a furniture shop. " * 120
OPENAI_BODIES: dict[str, dict[str, Any]] = {
    "tools-n2": {
        "messages": [{"role": "user", "content": "Find the red chair."}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "n": 2,
        "max_tokens": 200,
    },
    "logprobs-n2": {
        "messages": [{"role": "user", "content": "Describe a lamp."}],
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "max_tokens": 200,
    },
    "cached-reasoning": {
        "messages": [
            {"role": "system", "content": LONG_SYSTEM},
            {"role": "user", "content": "Describe a desk."},
        ],
        "reasoning_effort": "low",
        "max_tokens": 200,
    },
}
IMAGE = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
}
CLAUDE_PARAMS: dict[str, Any] = {
    "max_tokens": 200,
    "system": [
        {"type": "text", "text": "You write product copy. " * 250},  # cacheable: 1024+
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
    ],
    "tools": CLAUDE_TOOLS,
    "tool_choice": {"type": "auto"},
    "thinking": {"type": "enabled", "budget_tokens": 100},
    "messages": [
        {"role": "user", "content": [IMAGE, {"type": "text", "text": "What is this chair?"}]}
    ],
}
VOLATILE = ("id", "created")


def _diff(a: Any, b: Any, path: str = "") -> str | None:
    """The first path at which ``a`` and ``b`` differ (for the failure message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}.{key} only in {'left' if key in a else 'right'}"
            found = _diff(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} != {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _diff(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def _same(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in VOLATILE}


@pytest.fixture(scope="module")
def stack(simulator, module_api_server, module_workers) -> str:
    """An API process and a worker draining into the simulator, for the module's tests;
    the API's URL."""
    worker = module_workers(concurrency=4, wait=False)  # starts while the API process does
    base_url = module_api_server()
    worker.wait_ready()
    return base_url


@pytest.fixture
def runtime(clean_db, stack: str) -> str:
    """The module's API process and worker, on empty tables; the API's URL."""
    return stack


@pytest.fixture
def oai(runtime: str) -> Iterator[openai.OpenAI]:
    key = make_tenant("whole-openai")
    with openai.OpenAI(base_url=f"{runtime}/v1", api_key=key, max_retries=0) as client:
        yield client


@pytest.fixture
def claude(runtime: str) -> Iterator[anthropic.Anthropic]:
    key = make_tenant("whole-anthropic")
    with anthropic.Anthropic(base_url=runtime, api_key=key, max_retries=0) as client:
        yield client


def _key() -> str:
    """The key batchgen calls the simulator with: its prompt caches, like a provider's,
    are per key (an organisation's), so a direct call warms the one batchgen reads."""
    return get_registry()["sim-small"].api_key()


@pytest.fixture(scope="module")
def direct_oai(simulator) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{simulator.base_url}/v1", api_key=_key(), max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def direct_claude(simulator) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=simulator.base_url, api_key=_key(), max_retries=0) as c:
        yield c


def _name(model: str) -> str:
    return get_registry()[model].name


def _direct(client: openai.OpenAI, body: dict[str, Any]) -> dict[str, Any]:
    """The simulator's own answer, called twice (the second finds its prompt cached, as
    the call through batchgen then does)."""
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(model=_name("sim-small"), **body)
    return json.loads(raw.text)


def _last_request(simulator, api: str) -> dict[str, Any]:
    got = http_client.get(f"{simulator.base_url}/_sim/last_request", params={"api": api}).json()
    assert isinstance(got, dict)
    return got


def test_sync_calls_and_their_streams_come_back_whole(
    oai: openai.OpenAI, direct_oai: openai.OpenAI, simulator
):
    """tool_calls with n=2, logprobs with n=2, cached and reasoning token usage: equal
    to the simulator's own answer, plain and streamed."""
    for case in sorted(OPENAI_BODIES):
        _sync_case(oai, direct_oai, simulator, case)


def _sync_case(oai: openai.OpenAI, direct_oai: openai.OpenAI, simulator, case: str) -> None:
    body = OPENAI_BODIES[case]
    expected = _direct(direct_oai, body)
    sent_directly = _last_request(simulator, "openai")
    raw = oai.chat.completions.with_raw_response.create(model="sim-small", **body)
    through = json.loads(raw.text)
    assert _same(through) == _same(expected), _diff(through, expected)
    assert through["id"]  # the provider's id, as it came
    # What reached the simulator: the caller's body, the model mapped, streamed by the worker.
    sent = _last_request(simulator, "openai")
    assert {k: v for k, v in sent.items() if k not in ("stream", "stream_options")} == {
        k: v for k, v in sent_directly.items()
    }

    kwargs = {**body, "stream_options": {"include_usage": True}}
    with direct_oai.chat.completions.stream(model=_name("sim-small"), **kwargs) as stream:
        direct_final = stream.get_final_completion()
    with oai.chat.completions.stream(model="sim-small", **kwargs) as stream:
        chunks = list(stream)
        final = stream.get_final_completion()
    assert sum(e.type == "chunk" for e in chunks) > 2
    skip = set(VOLATILE)
    got, want = final.model_dump(exclude=skip), direct_final.model_dump(exclude=skip)
    assert got == want, _diff(got, want)


def test_a_batch_output_file_carries_the_whole_answer(
    oai: openai.OpenAI, direct_oai: openai.OpenAI
):
    expected = {case: _direct(direct_oai, body) for case, body in OPENAI_BODIES.items()}
    lines = [
        {
            "custom_id": case,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "sim-small", **body},
        }
        for case, body in sorted(OPENAI_BODIES.items())
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = oai.files.create(file=("whole.jsonl", content), purpose="batch")
    batch = oai.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = openai_batch_in(oai, batch.id)
    assert done.status == "completed" and done.output_file_id
    rows = [json.loads(x) for x in oai.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(OPENAI_BODIES)
    for row in rows:
        answer = row["response"]["body"]
        assert _same(answer) == _same(expected[row["custom_id"]]), row["custom_id"]
    tools = next(r for r in rows if r["custom_id"] == "tools-n2")["response"]["body"]
    assert [c["finish_reason"] for c in tools["choices"]] == ["tool_calls", "tool_calls"]
    assert all(c["message"]["tool_calls"] for c in tools["choices"])
    cached = next(r for r in rows if r["custom_id"] == "cached-reasoning")["response"]["body"]
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1024
    assert cached["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def _direct_message(client: anthropic.Anthropic) -> dict[str, Any]:
    for _ in range(2):  # the second reads the prompt cache the first wrote
        raw = client.messages.with_raw_response.create(model=_name("sim-claude"), **CLAUDE_PARAMS)
    return json.loads(raw.http_response.text)


def test_anthropic_messages_reach_the_provider_and_come_back_whole(
    claude: anthropic.Anthropic, direct_claude: anthropic.Anthropic, simulator
):
    """cache_control, a list system prompt, tools, images and thinking reach the
    simulator as the caller sent them; its Message (tool_use, thinking, cache usage)
    comes back unchanged, plain and streamed."""
    expected = _direct_message(direct_claude)
    sent_directly = _last_request(simulator, "anthropic")
    raw = claude.messages.with_raw_response.create(model="sim-claude", **CLAUDE_PARAMS)
    through = json.loads(raw.http_response.text)
    assert _same(through) == _same(expected)
    assert [b["type"] for b in through["content"]] == ["thinking", "tool_use"]
    assert through["usage"]["cache_read_input_tokens"] > 0
    sent = _last_request(simulator, "anthropic")
    assert {k: v for k, v in sent.items() if k != "stream"} == sent_directly

    with direct_claude.messages.stream(model=_name("sim-claude"), **CLAUDE_PARAMS) as stream:
        direct_final = stream.get_final_message()
    with claude.messages.stream(model="sim-claude", **CLAUDE_PARAMS) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert sum(e.type == "content_block_delta" for e in events) >= 3
    assert final.model_dump(exclude={"id"}) == direct_final.model_dump(exclude={"id"})


def test_anthropic_batch_results_carry_the_whole_message(
    claude: anthropic.Anthropic, direct_claude: anthropic.Anthropic
):
    expected = _direct_message(direct_claude)
    requests = [{"custom_id": "whole", "params": {"model": "sim-claude", **CLAUDE_PARAMS}}]
    created = claude.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    anthropic_batch_ended(claude, created.id)
    results = list(claude.messages.batches.results(created.id))
    assert [r.result.type for r in results] == ["succeeded"]
    message = results[0].result.message  # type: ignore[union-attr]
    assert message.model_dump(exclude={"id"}) == anthropic.types.Message.model_validate(
        expected
    ).model_dump(exclude={"id"})
