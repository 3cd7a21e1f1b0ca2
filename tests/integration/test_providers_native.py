"""The Gemini, Vertex AI and Bedrock adapters over real HTTP against the simulator: the
official SDKs (``google-genai``, ``boto3``) speak their native formats to it, batchgen
translates OpenAI chat both ways.

Needs neither PostgreSQL nor Redis: only the simulator in a background thread (Vertex
AI's service-account token comes from the simulator's OAuth endpoint)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from batchgen.errors import (
    CallCancelled,
    ContextLengthExceeded,
    FlexUnavailable,
    MalformedResponse,
    PermanentProviderError,
    RateLimited,
    TransientProviderError,
)
from batchgen.providers import get_provider
from batchgen.providers.base import ProviderRequest
from batchgen.registry import ModelSpec, ProviderKind
from batchgen.simulator import SimulatorConfig, SimulatorThread
from tests import http_client
from tests.env_vars import environment
from tests.images import png_data_url
from tests.native_setup import AWS_ENV, VERTEX_KEY_ENV, service_account_file
from tests.waiting import wait_until

KINDS = ("gemini", "vertex", "bedrock")
SECRET = "walrus-tangerine-secret"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "find_product",
            "description": "Find a product in the catalog.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "chair",
        "schema": {
            "type": "object",
            "properties": {"colour": {"type": "string"}},
            "required": ["colour"],
        },
    },
}
_items = iter(range(1, 1_000_000))


def tools_body() -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": "You are a catalog assistant."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"Which chair is this? ({SECRET})"},
                    {"type": "image_url", "image_url": {"url": png_data_url(64, 48)}},
                ],
            },
        ],
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 200,
    }


def schema_body() -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": "Describe the red chair."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "find_product", "arguments": '{"query": "chair"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"colour": "red"}'},
        ],
        "tools": TOOLS,
        "response_format": SCHEMA,
        "temperature": 0.2,
        "stop": ["END"],
        "max_tokens": 60,
    }


@pytest.fixture(scope="module")
def sim() -> Iterator[SimulatorThread]:
    config = SimulatorConfig(seed=3, latency_base_ms=0, latency_per_token_ms=0)
    with SimulatorThread(config) as server:
        yield server


@pytest.fixture
def base(sim: SimulatorThread) -> str:
    http_client.post(f"{sim.base_url}/_sim/reset").raise_for_status()
    return sim.base_url


@pytest.fixture(scope="module", autouse=True)
def credentials(sim: SimulatorThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Dummy AWS credentials, and a service-account key file whose token endpoint is the
    simulator's (google-auth signs a real JWT with it)."""
    key_file = service_account_file(tmp_path_factory.mktemp("vertex"), f"{sim.base_url}/token")
    with environment({**AWS_ENV, VERTEX_KEY_ENV: str(key_file)}):
        yield


def make_spec(kind: str, base_url: str) -> ModelSpec:
    names = {"gemini": "gemini-2.5-flash", "vertex": "gemini-2.5-pro", "bedrock": "us.claude-x"}
    return ModelSpec(
        name=names[kind],
        provider=ProviderKind(kind),
        base_url=base_url,
        api_key_env="BATCHGEN_TEST_VERTEX_KEY_FILE" if kind == "vertex" else "BATCHGEN_TEST_KEY",
        region="us-east-1",
        project="sim-project" if kind == "vertex" else None,
        group="sim",
        budget_key=f"sim-{kind}",
        context_window=32768,
        max_output_tokens=1024,
        tokens_per_min=1_000_000,
        requests_per_min=10_000,
        max_concurrency=8,
        input_usd_per_1m=1.0,
        output_usd_per_1m=2.0,
    )


def request(
    spec: ModelSpec,
    body: dict[str, Any],
    *,
    stream: bool = False,
    fault: str | None = None,
    chunks: list[dict[str, Any]] | None = None,
    cancel: threading.Event | None = None,
    timeout_s: float = 10.0,
) -> ProviderRequest:
    return ProviderRequest(
        spec=spec,
        body={"model": spec.name, **body},
        timeout_s=timeout_s,
        item_id=next(_items),
        stream=stream,
        extra_headers={"x-sim-fault": fault} if fault else None,
        on_chunk=chunks.append if chunks is not None else None,
        cancel=cancel or threading.Event(),
    )


def sim_entry(base: str, item: int | None) -> dict[str, Any]:
    def finished() -> dict[str, Any] | None:
        entries = http_client.get(f"{base}/_sim/log", params={"item": str(item)}).json()
        if entries and entries[0]["end_ts"] is not None:
            entry: dict[str, Any] = entries[0]
            return entry
        return None

    entry: dict[str, Any] = wait_until(
        finished, 5, f"a finished log entry for item {item}", poll_s=0.02
    )
    return entry


def merged(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The chunks merged as an OpenAI client merges them: text, tool calls (by index,
    arguments concatenated), finish reason, and the usage of the last chunk."""
    message: dict[str, Any] = {"role": None, "content": "", "tool_calls": {}}
    finish, usage = None, None
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            message["role"] = delta.get("role") or message["role"]
            message["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = message["tool_calls"].setdefault(
                    call["index"], {"id": None, "name": None, "arguments": ""}
                )
                entry["id"] = call.get("id") or entry["id"]
                fn = call.get("function") or {}
                entry["name"] = fn.get("name") or entry["name"]
                entry["arguments"] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return {"message": message, "finish": finish, "usage": usage}


# -- answers ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_tools_and_images_come_back_in_openai_form(base: str, kind: str) -> None:
    spec = make_spec(kind, base)
    req = request(spec, tools_body())
    response = get_provider(spec).complete(req)
    body = response.body
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == response.finish_reason == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "find_product"
    assert set(json.loads(call["function"]["arguments"])) == {"query"}
    assert choice["message"]["content"] is None
    entry = sim_entry(base, req.item_id)
    assert entry["api"] == ("bedrock" if kind == "bedrock" else "gemini")
    assert entry["model"] == spec.name and entry["finish_reason"] == "tool_calls"
    # The usage is the simulator's own count (its image and tool tokens included).
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        entry["prompt_tokens"],
        entry["completion_tokens"],
    )
    assert (response.prompt_tokens, response.completion_tokens) == (
        entry["prompt_tokens"],
        entry["completion_tokens"],
    )
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # An image and the tool definitions were counted: more than the text alone.
    assert entry["prompt_tokens"] > 60


@pytest.mark.parametrize("kind", KINDS)
def test_tool_results_and_schema_reach_the_provider_natively(base: str, kind: str) -> None:
    spec = make_spec(kind, base)
    req = request(spec, schema_body())
    response = get_provider(spec).complete(req)
    sent = http_client.get(
        f"{base}/_sim/last_request", params={"api": "bedrock" if kind == "bedrock" else "gemini"}
    ).json()
    if kind == "bedrock":
        inference = {"maxTokens": 60, "temperature": 0.2, "stopSequences": ["END"]}
        assert sent["inferenceConfig"] == inference
        turns = sent["messages"]
        assert [t["role"] for t in turns] == ["user", "assistant", "user"]
        assert turns[1]["content"][0]["toolUse"]["input"] == {"query": "chair"}
        assert turns[2]["content"][0]["toolResult"]["toolUseId"] == "call_1"
        structure = sent["outputConfig"]["textFormat"]["structure"]["jsonSchema"]
        assert json.loads(structure["schema"]) == SCHEMA["json_schema"]["schema"]
    else:
        config = sent["generationConfig"]
        assert config["maxOutputTokens"] == 60 and config["stopSequences"] == ["END"]
        assert config["responseMimeType"] == "application/json"
        assert config["responseJsonSchema"] == SCHEMA["json_schema"]["schema"]
        turns = sent["contents"]
        assert [t["role"] for t in turns] == ["user", "model", "user"]
        assert turns[1]["parts"][0]["functionCall"]["args"] == {"query": "chair"}
        assert turns[2]["parts"][0]["functionResponse"]["response"] == {"colour": "red"}
    assert response.body["choices"][0]["finish_reason"] == "tool_calls"  # tools are offered


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make_body", [tools_body, schema_body], ids=["tools", "schema"])
def test_a_stream_relays_chunk_by_chunk_and_merges_to_the_plain_answer(
    base: str, kind: str, make_body: Any
) -> None:
    spec = make_spec(kind, base)
    provider = get_provider(spec)
    plain = provider.complete(request(spec, make_body())).body
    chunks: list[dict[str, Any]] = []
    req = request(spec, make_body(), stream=True, chunks=chunks)
    streamed = provider.complete(req)
    assert len(chunks) >= 3
    got = merged(chunks)
    want = plain["choices"][0]
    assert got["message"]["role"] == "assistant" and got["finish"] == want["finish_reason"]
    assert got["message"]["content"] == (want["message"]["content"] or "")
    calls = [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": a}}
        for c in got["message"]["tool_calls"].values()
        for a in [c["arguments"]]
    ]
    assert calls == (want["message"].get("tool_calls") or [])
    assert got["usage"] == streamed.body["usage"] == plain["usage"]
    assert streamed.body["choices"] == plain["choices"]
    entry = sim_entry(base, req.item_id)
    assert entry["stream"] and entry["completed"]
    assert streamed.prompt_tokens == entry["prompt_tokens"]
    assert streamed.completion_tokens == entry["completion_tokens"]


def test_plain_text_and_its_length_finish(base: str) -> None:
    for kind in KINDS:
        spec = make_spec(kind, base)
        body = {"messages": [{"role": "user", "content": "Describe a lamp."}], "max_tokens": 8}
        response = get_provider(spec).complete(request(spec, body))
        assert response.finish_reason == "length" and response.completion_tokens == 8
        assert response.text and response.body["choices"][0]["message"]["content"] == response.text


def test_a_vertex_call_carries_the_service_account_token(base: str) -> None:
    spec = make_spec("vertex", base)
    req = request(spec, tools_body())
    get_provider(spec).complete(req)
    entry = sim_entry(base, req.item_id)
    assert entry["key"] is not None and entry["key"] != "anonymous"


# -- errors ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_rate_limits_carry_their_retry_delay(base: str, kind: str) -> None:
    spec = make_spec(kind, base)
    with pytest.raises(RateLimited) as caught:
        get_provider(spec).complete(request(spec, tools_body(), fault="429"))
    assert caught.value.status == 429 and SECRET not in str(caught.value)
    if kind != "bedrock":  # Gemini's RetryInfo; Bedrock's throttling says no delay
        assert caught.value.retry_after_s == pytest.approx(1.0)
        assert "RESOURCE_EXHAUSTED" in caught.value.message
    else:
        assert "ThrottlingException" in caught.value.message


@pytest.mark.parametrize(
    ("kind", "fault", "error", "text"),
    [
        ("gemini", "status:503", TransientProviderError, "UNAVAILABLE"),
        ("vertex", "status:500", TransientProviderError, "INTERNAL"),
        ("gemini", "status:400:context_length_exceeded", ContextLengthExceeded, "INVALID"),
        ("gemini", "status:403", PermanentProviderError, "PERMISSION_DENIED"),
        ("bedrock", "status:429:servicequotaexceededexception", RateLimited, "ServiceQuota"),
        ("bedrock", "status:429:modelnotreadyexception", TransientProviderError, "NotReady"),
        ("bedrock", "status:503", TransientProviderError, "ServiceUnavailable"),
        ("bedrock", "status:400:context_length_exceeded", ContextLengthExceeded, "Validation"),
        ("bedrock", "status:400", PermanentProviderError, "ValidationException"),
        ("gemini", "malformed", MalformedResponse, "malformed"),
        ("bedrock", "reset", TransientProviderError, "error"),
    ],
)
def test_errors_map_onto_the_retry_rules(
    base: str, kind: str, fault: str, error: type[Exception], text: str
) -> None:
    spec = make_spec(kind, base)
    with pytest.raises(error) as caught:
        get_provider(spec).complete(request(spec, tools_body(), fault=fault))
    assert type(caught.value) is error
    assert text in str(caught.value) and SECRET not in str(caught.value)
    if fault.endswith("modelnotreadyexception"):
        assert not isinstance(caught.value, RateLimited)


@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_connection_is_transient_and_not_billed(kind: str) -> None:
    from batchgen.embedded import free_port

    spec = make_spec(kind, f"http://127.0.0.1:{free_port()}")
    with pytest.raises(TransientProviderError) as caught:
        get_provider(spec).complete(request(spec, tools_body(), timeout_s=3))
    assert not caught.value.billed


@pytest.mark.parametrize("kind", KINDS)
def test_a_cancelled_stream_stops_between_chunks(base: str, kind: str) -> None:
    http_client.post(f"{base}/_sim/config", json={"latency_per_token_ms": 20}).raise_for_status()
    try:
        spec = make_spec(kind, base)
        cancel = threading.Event()
        chunks: list[dict[str, Any]] = []

        def on_chunk(chunk: dict[str, Any]) -> None:
            chunks.append(chunk)
            if len(chunks) == 3:
                cancel.set()

        body = {"messages": [{"role": "user", "content": "Describe a lamp."}], "max_tokens": 200}
        req = request(spec, body, stream=True, cancel=cancel)
        req = ProviderRequest(**{**req.__dict__, "on_chunk": on_chunk})
        with pytest.raises(CallCancelled) as caught:
            get_provider(spec).complete(req)
        assert caught.value.billed and len(chunks) < 20
    finally:
        http_client.post(f"{base}/_sim/config", json={"latency_per_token_ms": 0}).raise_for_status()


# -- doctor ------------------------------------------------------------------------


def test_doctor_probes_each_kind_with_its_credentials(base: str) -> None:
    from batchgen.monitoring.doctor import check_providers
    from batchgen.registry import OfflineRoute, Registry

    specs = {kind: make_spec(kind, base) for kind in KINDS}
    specs["bedrock"] = specs["bedrock"].model_copy(
        update={"offline": OfflineRoute(control_url=base)}
    )
    # A Vertex AI deployment whose key file is missing: no token, said so.
    broken = make_spec("vertex", base + "/d/none").model_copy(
        update={"api_key_env": "BATCHGEN_TEST_MISSING_KEY_FILE", "name": "vertex-broken"}
    )
    os.environ["BATCHGEN_TEST_MISSING_KEY_FILE"] = "/nonexistent/key.json"
    try:
        checks = check_providers(Registry({s.name: s for s in [*specs.values(), broken]}))
    finally:
        os.environ.pop("BATCHGEN_TEST_MISSING_KEY_FILE")
    assert len(checks) == 4  # one per endpoint and kind
    ok = [c for c in checks if c.ok]
    assert len(ok) == 3 and all("answers (HTTP 200)" in c.found for c in ok), checks
    (failed,) = [c for c in checks if not c.ok]
    assert failed.name == f"provider {base}/d/none"
    assert "no Vertex AI access token" in failed.found
    assert failed.fix is not None and "BATCHGEN_TEST_MISSING_KEY_FILE" in failed.fix


# -- flex --------------------------------------------------------------------------


def test_a_gemini_flex_call_asks_the_tier_and_a_shed_one_is_flex_unavailable(base: str) -> None:
    body = {"messages": [{"role": "user", "content": "Describe a lamp."}], "max_tokens": 8}
    spec = make_spec("gemini", base)
    req = request(spec, {**body, "service_tier": "flex"})
    get_provider(spec).complete(req)
    assert sim_entry(base, req.item_id)["service_tier"] == "flex"
    sent = http_client.get(f"{base}/_sim/last_request", params={"api": "gemini"}).json()
    assert sent["serviceTier"] == "flex"
    vertex = make_spec("vertex", base)  # Vertex AI's flex is not taken: a standard call
    req = request(vertex, {**body, "service_tier": "flex"})
    get_provider(vertex).complete(req)
    assert sim_entry(base, req.item_id)["service_tier"] is None
    http_client.post(f"{base}/_sim/config", json={"flex_refusal_rate": 1.0}).raise_for_status()
    try:
        with pytest.raises(FlexUnavailable) as caught:
            get_provider(spec).complete(request(spec, {**body, "service_tier": "flex"}))
        assert caught.value.status == 503 and not caught.value.billed
        get_provider(spec).complete(request(spec, body))  # a standard call is not shed
    finally:
        http_client.post(f"{base}/_sim/config", json={"flex_refusal_rate": 0.0}).raise_for_status()


# -- embeddings ----------------------------------------------------------------------


def test_gemini_embeddings_come_back_as_an_openai_list_counted_by_count_tokens(
    base: str,
) -> None:
    from batchgen.domain.formats.endpoints import EMBEDDINGS

    spec = make_spec("gemini", base).model_copy(
        update={"endpoints": (EMBEDDINGS,), "dimensions": 768, "max_output_tokens": None}
    )
    texts = ["a red chair", "a walnut table with six legs"]
    req = ProviderRequest(
        spec=spec,
        body={"model": spec.name, "input": texts, "dimensions": 16},
        timeout_s=10,
        item_id=next(_items),
        endpoint=EMBEDDINGS,
    )
    response = get_provider(spec).complete(req)
    body = response.body
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
    assert all(len(d["embedding"]) == 16 for d in body["data"])
    counted = http_client.post(
        f"{base}/v1beta/models/{spec.name}:countTokens",
        json={"contents": [{"role": "user", "parts": [{"text": t} for t in texts]}]},
    ).json()["totalTokens"]
    assert response.prompt_tokens == body["usage"]["prompt_tokens"] == counted > 0
    assert response.completion_tokens == 0
    tokens = ProviderRequest(**{**req.__dict__, "body": {"model": spec.name, "input": [1, 2]}})
    with pytest.raises(PermanentProviderError, match="body.input"):
        get_provider(spec).complete(tokens)
