"""Gemini, Vertex AI and Bedrock models through the whole of batchgen: a batch of OpenAI
chat lines (tools, images, a JSON schema, tool results) submitted with the OpenAI SDK
runs on a real worker, which calls the simulator with the official SDKs
(``google-genai``, ``boto3``); the output file carries the answers whole in OpenAI's
format, the ledger the simulator's own token counts at the registry's prices; a
streamed sync call relays chunk by chunk; what a kind cannot carry is refused at
submit, naming the line and field."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import select

from batchgen.domain.billing.cost import cost_usd
from batchgen.domain.formats.admission import canonical_text
from batchgen.providers import get_provider
from batchgen.providers.base import ProviderRequest
from batchgen.registry import get_registry
from batchgen.store import db
from batchgen.store.schema import UsageLedger
from tests import http_client
from tests.env_vars import environment
from tests.helpers import make_tenant
from tests.integration.test_providers_native import schema_body, tools_body
from tests.native_setup import (
    AWS_ENV,
    VERTEX_KEY_ENV,
    model_toml,
    service_account_file,
)
from tests.waiting import wait_until

NATIVE = ("gemini-sim", "vertex-sim", "bedrock-sim")
SIM = "${BATCHGEN_SIMULATOR_URL}"
# A Bedrock model pooled over two regions, each deployment its own endpoint (a
# simulated deployment) and limits: 300 tokens a minute each, so ten calls need both.
POOL = "bedrock-pool"
EMBED = "gemini-embedding-sim"
# Set on each deployment, not the model.
LIMITS = ("max_output_tokens", "tokens_per_min", "requests_per_min", "max_concurrency")
POOL_DEPLOYMENT = """
[models."bedrock-pool".deployments.{name}]
base_url = "${{BATCHGEN_SIMULATOR_URL}}/d/{lane}"
region = "{region}"
budget_key = "bedrock-{name}"
tokens_per_min = 300
requests_per_min = 1000
max_concurrency = 2
"""
MODELS = (
    "".join(
        model_toml(name, name.removesuffix("-sim"), base_url=SIM, group="native") for name in NATIVE
    )
    + model_toml(POOL, "bedrock", base_url=SIM, group="native", **dict.fromkeys(LIMITS[1:]))
    + model_toml(
        EMBED,
        "gemini",
        base_url=SIM,
        group="native",
        endpoints=["/v1/embeddings"],
        dimensions=768,
        max_output_tokens=None,
    )
    + POOL_DEPLOYMENT.format(name="us-east", lane="east", region="us-east-1")
    + POOL_DEPLOYMENT.format(name="eu-west", lane="west", region="eu-west-1")
)
VOLATILE = ("id", "created")


@pytest.fixture(scope="module")
def native_env(simulator, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The registry of the three kinds at the simulator, dummy AWS credentials and a
    service-account key whose token endpoint is the simulator's, in this process's
    environment (the API and worker processes inherit it)."""
    folder = Path(tmp_path_factory.mktemp("native"))
    (folder / "models.toml").write_text(MODELS)
    env = {
        "BATCHGEN_MODELS_FILE": str(folder / "models.toml"),
        VERTEX_KEY_ENV: str(service_account_file(folder, f"{simulator.base_url}/token")),
        **AWS_ENV,
    }
    with environment(env):
        yield env


@pytest.fixture(scope="module")
def stack(native_env: dict[str, str], module_api_server, module_workers) -> str:
    worker = module_workers(concurrency=4, wait=False, env=native_env)
    base_url = module_api_server(env=native_env)
    worker.wait_ready()
    return base_url


@pytest.fixture
def oai(clean_db, stack: str) -> Iterator[openai.OpenAI]:
    key = make_tenant("native")
    with openai.OpenAI(base_url=f"{stack}/v1", api_key=key, max_retries=0) as client:
        yield client


def _line(custom_id: str, model: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, **body},
    }


def _same(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in VOLATILE}


def _direct(model: str, body: dict[str, Any]) -> dict[str, Any]:
    """The adapter's answer to the same request, called from this process (the body as
    batchgen stores it: its keys sorted, which the provider's token count can tell)."""
    spec = get_registry()[model]
    stored = json.loads(canonical_text({"model": model, **body}))
    request = ProviderRequest(spec=spec, body=stored, timeout_s=30)
    return get_provider(spec).complete(request).body


def _poll(client: openai.OpenAI, batch_id: str, timeout_s: float = 120.0) -> Any:
    def ended() -> Any:
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "failed", "expired", "cancelled") else None

    return wait_until(ended, timeout_s, lambda: f"batch {batch_id} to end", poll_s=0.2)


def _sim_entry(simulator, item_id: int) -> dict[str, Any]:
    entries = http_client.get(
        f"{simulator.base_url}/_sim/log", params={"item": str(item_id)}
    ).json()
    done = [e for e in entries if e["status"] == 200 and e["completed"]]
    assert len(done) == 1, entries
    entry: dict[str, Any] = done[0]
    return entry


def test_a_batch_reaches_each_kind_and_comes_back_whole(oai: openai.OpenAI, simulator) -> None:
    bodies = {"tools": tools_body(), "schema": schema_body()}
    lines = [
        _line(f"{model}/{case}", model, body)
        for model in NATIVE
        for case, body in sorted(bodies.items())
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = oai.files.create(file=("native.jsonl", content), purpose="batch")
    batch = oai.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = _poll(oai, batch.id)
    assert done.status == "completed" and done.output_file_id, done
    assert done.request_counts.completed == len(lines) and not done.error_file_id
    rows = {
        row["custom_id"]: row
        for row in map(json.loads, oai.files.content(done.output_file_id).text.splitlines())
    }
    assert sorted(rows) == sorted(line["custom_id"] for line in lines)
    for custom_id, row in rows.items():
        model, case = custom_id.split("/")
        answer = row["response"]["body"]
        assert row["response"]["status_code"] == 200
        assert answer["object"] == "chat.completion"
        expected = _direct(model, bodies[case])
        assert _same(answer) == _same(expected), custom_id
        (choice,) = answer["choices"]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "find_product"

    # The ledger: the simulator's own counts of each call, at the model's prices.
    with db.session_scope() as session:
        ledger = session.execute(
            select(
                UsageLedger.item_id,
                UsageLedger.model,
                UsageLedger.prompt_tokens,
                UsageLedger.completion_tokens,
                UsageLedger.cost_usd,
                UsageLedger.usage_source,
            )
        ).all()
    assert len(ledger) == len(lines)
    registry = get_registry()
    for item_id, model, prompt, completion, cost, source in ledger:
        entry = _sim_entry(simulator, item_id)
        assert entry["model"] == model
        assert (prompt, completion) == (entry["prompt_tokens"], entry["completion_tokens"])
        assert source == "provider"
        assert cost == cost_usd(prompt, completion, registry[model])
        assert cost > 0


@pytest.mark.parametrize("model", NATIVE)
def test_a_streamed_sync_call_relays_chunk_by_chunk(
    oai: openai.OpenAI, simulator, model: str
) -> None:
    http_client.post(f"{simulator.base_url}/_sim/config", json={"latency_per_token_ms": 2})
    try:
        body = {
            "messages": [{"role": "user", "content": "Describe a lamp in a few words."}],
            "max_tokens": 400,
        }
        plain = oai.chat.completions.create(model=model, **body)
        arrivals: list[float] = []
        texts: list[str] = []
        with oai.chat.completions.stream(
            model=model, stream_options={"include_usage": True}, **body
        ) as stream:
            for event in stream:
                if event.type == "content.delta":
                    arrivals.append(time.monotonic())
                    texts.append(event.delta)
            final = stream.get_final_completion()
        assert len(texts) > 2  # relayed as they came, not as one answer
        assert (
            "".join(texts) == plain.choices[0].message.content == final.choices[0].message.content
        )
        assert final.choices[0].finish_reason == plain.choices[0].finish_reason == "stop"
        assert final.usage is not None and plain.usage is not None
        assert final.usage.completion_tokens == plain.usage.completion_tokens > 0
        assert final.usage.prompt_tokens == plain.usage.prompt_tokens
    finally:
        http_client.post(f"{simulator.base_url}/_sim/config", json={"latency_per_token_ms": 0.5})


@pytest.mark.parametrize(
    ("model", "extra", "param"),
    [
        ("gemini-sim", {"logprobs": True}, "body.logprobs"),
        ("bedrock-sim", {"n": 2}, "body.n"),
        ("vertex-sim", {"tools": [{"type": "web_search"}]}, "body.tools[0].type"),
    ],
)
def test_what_a_kind_cannot_carry_is_refused_at_submit(
    oai: openai.OpenAI, model: str, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 10, **extra}
    lines = [_line("fine", model, {"messages": body["messages"]}), _line("bad", model, body)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    with pytest.raises(openai.BadRequestError) as caught:  # the upload validates its lines
        oai.files.create(file=("refused.jsonl", content), purpose="batch")
    error = caught.value.body
    assert isinstance(error, dict)
    assert error.get("param") == param and error.get("line") == 2, error
    assert param in str(error.get("message")), error
    with pytest.raises(openai.BadRequestError) as sync:
        oai.chat.completions.create(model=model, **body)
    assert isinstance(sync.value.body, dict) and sync.value.body.get("param") == param


def test_a_bedrock_pool_over_two_regions_keeps_each_deployments_limit(
    oai: openai.OpenAI, simulator
) -> None:
    lanes = {"east": {"tokens_per_min": 300}, "west": {"tokens_per_min": 300}}
    http_client.post(f"{simulator.base_url}/_sim/deployments", json=lanes).raise_for_status()
    body = {"messages": [{"role": "user", "content": "Name a lamp."}], "max_tokens": 12}
    lines = [_line(f"p{i}", POOL, body) for i in range(10)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = oai.files.create(file=("pool.jsonl", content), purpose="batch")
    batch = oai.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = _poll(oai, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 10, done
    stats = http_client.get(f"{simulator.base_url}/_sim/stats").json()["deployments"]
    for lane in ("east", "west"):
        seen = stats[lane]
        assert seen["succeeded"] > 0, stats  # both regions served
        assert seen["rate_limited"] == 0, stats  # neither was sent past its limit
        tokens = seen["bound"]["tokens"]
        assert tokens["limit"] == 300 and tokens["max_in_any_window"] <= 300, stats
    with db.session_scope() as session:
        served = session.execute(select(UsageLedger.deployment)).scalars().all()
    assert sorted(set(served)) == ["eu-west", "us-east"]


def test_gemini_embeddings_answer_and_token_ids_are_refused_at_submit(
    oai: openai.OpenAI,
) -> None:
    answer = oai.embeddings.create(model=EMBED, input=["a red chair", "a lamp"], dimensions=8)
    assert [len(d.embedding) for d in answer.data] == [8, 8]
    assert answer.usage.prompt_tokens > 0
    with pytest.raises(openai.BadRequestError) as caught:
        oai.embeddings.create(model=EMBED, input=[[1, 2, 3]])
    error = caught.value.body
    assert isinstance(error, dict) and error.get("param") == "body.input", error
