"""The Responses API and embeddings through batchgen (issue 28, item 4), with the official
``openai`` SDK against a live ``batchgen api`` process, a worker and the simulator.

What batchgen hands back is compared with what the simulator answers the same SDK
called directly: a Response equal but for its ``id`` and ``created_at`` (each call is a
new answer), an embeddings list equal. One batch per endpoint (an OpenAI batch holds one
endpoint's requests), synchronous calls of both (a Response streamed too), an
embeddings batch offloaded to the simulated provider's Batch API, and bad input: each
refused precisely, nothing stored.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select

from batchgen import python_api
from batchgen.config import DEFAULT_MODELS_FILE, get_settings
from batchgen.registry import get_registry, load_registry
from batchgen.store import db
from batchgen.store.schema import Batch, File, UsageLedger
from batchgen.worker.offload_jobs import tick
from batchgen.worker.procs import start_worker, stop_all
from tests import http_client
from tests.helpers import make_tenant, openai_batch_in, sim_config
from tests.integration.conftest import CONTROL_QUEUE, NOTIFY_QUEUE
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

TOOLS = [
    {
        "type": "function",
        "name": "find_product",
        "description": "Find a product in the catalog.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    }
]
RESPONSES_BODIES: dict[str, dict[str, Any]] = {
    "text": {"input": "Describe a chair.", "instructions": "Be brief.", "max_output_tokens": 60},
    "items-tools": {
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Find the red chair."}]}
        ],
        "tools": TOOLS,
    },
    "reasoning": {"input": "Compare two lamps.", "reasoning": {"effort": "low"}},
}
EMBEDDINGS_BODIES: dict[str, dict[str, Any]] = {
    "one": {"model": "text-embedding-3-small", "input": "A red oak chair."},
    "many": {
        "model": "text-embedding-3-small",
        "input": ["A lamp.", "A desk with drawers."],
        "encoding_format": "float",
    },
    "tokens-short": {
        "model": "text-embedding-3-large",
        "input": [[40, 2579], [1]],
        "dimensions": 8,
    },
    "base64": {"model": "text-embedding-3-small", "input": "A sofa.", "encoding_format": "base64"},
}
WORKER_ENV = {"BATCHGEN_OFFLOAD_INTERVAL_S": "3600"}  # the offload test ticks itself


@pytest.fixture(scope="module")
def runtime(services, simulator, module_api_server, tmp_path_factory) -> Iterator[str]:
    """An API process and a worker (with its beat: the dispatcher) on the simulator."""
    logs = tmp_path_factory.mktemp("endpoint-workers")
    queues = [*get_registry().queues, CONTROL_QUEUE, NOTIFY_QUEUE]
    worker = start_worker(queues, log_dir=logs, concurrency=4, beat=True, env=WORKER_ENV)
    try:
        base_url = module_api_server()
        worker.wait_ready()
        yield base_url
    finally:
        stop_all([worker])


@pytest.fixture(scope="module")
def tenant(runtime: str) -> str:
    return f"endpoints-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def oai(runtime: str, tenant: str) -> Iterator[openai.OpenAI]:
    key = make_tenant(tenant)
    with openai.OpenAI(base_url=f"{runtime}/v1", api_key=key, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def direct(simulator) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{simulator.base_url}/v1", api_key="k", max_retries=0) as c:
        yield c


def _name(model: str) -> str:
    return get_registry()[model].name


def _direct_response(client: openai.OpenAI, body: dict[str, Any]) -> dict[str, Any]:
    raw = client.responses.with_raw_response.create(model=_name("sim-small"), **body)
    return json.loads(raw.text)


def _direct_embeddings(client: openai.OpenAI, body: dict[str, Any]) -> dict[str, Any]:
    # Raw, as the request was written: the SDK would ask for base64 where it names none.
    sent = {**body, "model": _name(body["model"])}
    return dict(client.post("/embeddings", body=sent, cast_to=httpx.Response).json())


def _same(response: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in response.items() if k not in ("id", "created_at")}


def _last_request(simulator, api: str) -> dict[str, Any]:
    got = http_client.get(f"{simulator.base_url}/_sim/last_request", params={"api": api}).json()
    assert isinstance(got, dict)
    return got


def _lines(url: str, bodies: dict[str, dict[str, Any]], **extra: Any) -> bytes:
    rows = [
        {"custom_id": case, "method": "POST", "url": url, "body": {**extra, **body}}
        for case, body in sorted(bodies.items())
    ]
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def _output(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    assert file_id
    rows = [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in rows)
    return {r["custom_id"]: r["response"]["body"] for r in rows}


def _ledger(batch_id: str) -> list[UsageLedger]:
    with db.session_scope() as session:
        rows = list(session.scalars(select(UsageLedger).where(UsageLedger.batch_id == batch_id)))
        session.expunge_all()
        return rows


def test_a_batch_per_endpoint_comes_back_as_the_provider_answered(
    oai: openai.OpenAI, direct: openai.OpenAI
):
    """A /v1/responses batch and a /v1/embeddings batch, through Files and Batches: each
    output body equals what the simulator answers the same request; the ledger has the
    tokens it reported, priced from the registry (embeddings: input tokens only)."""
    made = {}
    for url, bodies, extra in (
        ("/v1/responses", RESPONSES_BODIES, {"model": "sim-small"}),
        ("/v1/embeddings", EMBEDDINGS_BODIES, {}),
    ):
        upload = oai.files.create(file=("in.jsonl", _lines(url, bodies, **extra)), purpose="batch")
        made[url] = oai.batches.create(
            input_file_id=upload.id,
            endpoint=url,  # type: ignore[arg-type]
            completion_window="24h",
        )
        assert made[url].endpoint == url
    responses = openai_batch_in(oai, made["/v1/responses"].id)
    embeddings = openai_batch_in(oai, made["/v1/embeddings"].id)

    got = _output(oai, responses.output_file_id)
    assert sorted(got) == sorted(RESPONSES_BODIES)
    for case, body in RESPONSES_BODIES.items():
        assert _same(got[case]) == _same(_direct_response(direct, body)), case
    assert got["items-tools"]["output"][0]["type"] == "function_call"
    assert got["reasoning"]["usage"]["output_tokens_details"]["reasoning_tokens"] > 0

    vectors = _output(oai, embeddings.output_file_id)
    assert vectors == {case: _direct_embeddings(direct, b) for case, b in EMBEDDINGS_BODIES.items()}
    assert len(vectors["many"]["data"][1]["embedding"]) == 1536
    assert len(vectors["tokens-short"]["data"][0]["embedding"]) == 8
    assert isinstance(vectors["base64"]["data"][0]["embedding"], str)

    registry = get_registry()
    for row in _ledger(embeddings.id):
        assert row.completion_tokens == 0 and row.prompt_tokens > 0
        price = Decimal(str(registry[row.model].input_usd_per_1m))
        assert row.cost_usd == row.prompt_tokens * price / 1_000_000
    by_tokens = sorted(r.prompt_tokens for r in _ledger(embeddings.id))
    assert by_tokens == sorted(v["usage"]["prompt_tokens"] for v in vectors.values())
    answered = sorted(r["usage"]["output_tokens"] for r in got.values())
    assert sorted(r.completion_tokens for r in _ledger(responses.id)) == answered


def test_sync_responses_and_embeddings_through_the_scheduler(
    oai: openai.OpenAI, direct: openai.OpenAI, simulator
):
    """``client.responses.create`` (plain and streamed) and ``client.embeddings.create``
    get the simulator's own answers; what reached it is what the caller sent."""
    body = RESPONSES_BODIES["items-tools"]
    expected = _direct_response(direct, body)
    sent_directly = _last_request(simulator, "responses")
    raw = oai.responses.with_raw_response.create(model="sim-small", **body)
    assert _same(json.loads(raw.text)) == _same(expected)
    assert _last_request(simulator, "responses") == sent_directly

    text_body = RESPONSES_BODIES["text"]
    want = direct.responses.parse(model=_name("sim-small"), **text_body)  # as a stream parses
    with oai.responses.stream(model="sim-small", **text_body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert sum(e.type == "response.output_text.delta" for e in events) > 2
    skip = {"id", "created_at"}
    assert final.model_dump(exclude=skip) == want.model_dump(exclude=skip)
    assert final.output_text == want.output_text != ""

    inputs = ["A walnut desk.", "A wool rug."]
    through = oai.embeddings.create(model="text-embedding-3-small", input=inputs)
    straight = direct.embeddings.create(model=_name("text-embedding-3-small"), input=inputs)
    assert through.model_dump() == straight.model_dump()  # the SDK asked both for base64
    assert _last_request(simulator, "embeddings")["encoding_format"] == "base64"
    assert len(through.data[0].embedding) == 1536

    # The simulator holds both endpoints to chat's limits and faults.
    for path, body in (("/v1/responses", text_body), ("/v1/embeddings", EMBEDDINGS_BODIES["one"])):
        for fault, status in (("429", 429), ("status:503", 503)):
            answer = http_client.post(
                f"{simulator.base_url}{path}",
                json={"model": "m", **body} if path == "/v1/responses" else body,
                headers={"x-sim-fault": fault},
            )
            assert answer.status_code == status, (path, fault)
            assert "error" in answer.json()


def _error(call: Any) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as raised:
        call()
    return raised.value


def _stored(tenant: str) -> tuple[int, int]:
    """The tenant's batches and files (calls included)."""
    with db.session_scope() as session:
        from batchgen.store.schema import Tenant

        owner = session.scalar(select(Tenant).where(Tenant.name == tenant))
        assert owner is not None
        batches = session.scalars(select(Batch.id).where(Batch.tenant_id == owner.id)).all()
        files = session.scalars(select(File.id).where(File.tenant_id == owner.id)).all()
        return len(batches), len(files)


def test_bad_lines_and_unknown_endpoints_are_refused_precisely(
    oai: openai.OpenAI, runtime: str, tenant: str
):
    """Each bad request is a 400 (404 for a path) naming the line and the field, and
    stores nothing."""
    before = _stored(tenant)
    good = {"model": "sim-small", "input": "Hello."}
    bad_files = {
        "responses without input": (
            [("/v1/responses", good), ("/v1/responses", {"model": "sim-small"})],
            (2, "body.input", "is required"),
        ),
        "a bad input item": (
            [("/v1/responses", {"model": "sim-small", "input": [{"role": "user"}]})],
            (1, "body.input[0].content", "content parts"),
        ),
        "two endpoints in one file": (
            [
                ("/v1/responses", good),
                ("/v1/embeddings", {"model": "text-embedding-3-small", "input": "x"}),
            ],
            (2, "url", "the requests of a batch all go to its endpoint"),
        ),
        "an embedding model on responses": (
            [("/v1/responses", {**good, "model": "text-embedding-3-small"})],
            (1, "body.model", "serves '/v1/embeddings'"),
        ),
        "a chat model on embeddings": (
            [("/v1/embeddings", {"model": "sim-small", "input": "x"})],
            (1, "body.model", "does not serve /v1/embeddings"),
        ),
        "an empty embedding input": (
            [("/v1/embeddings", {"model": "text-embedding-3-small", "input": ["a", ""]})],
            (1, "body.input[1]", "non-empty string"),
        ),
        "an unknown url": (
            [("/v1/completions", good)],
            (1, "url", "supported: '/v1/chat/completions', '/v1/responses', '/v1/embeddings'"),
        ),
    }
    for case, (lines, (line_no, field, words)) in bad_files.items():
        content = "".join(
            json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}) + "\n"
            for i, (url, body) in enumerate(lines)
        )
        error = _error(lambda c=content: oai.files.create(file=("f.jsonl", c), purpose="batch"))
        assert error.status_code == 400, case
        detail = error.body
        assert isinstance(detail, dict), case
        assert (detail["line"], detail["param"]) == (line_no, field), (case, detail)
        assert words in detail["message"], (case, detail["message"])

    embeddings_file = _lines("/v1/embeddings", {"e": EMBEDDINGS_BODIES["one"]})
    upload = oai.files.create(file=("e.jsonl", embeddings_file), purpose="batch")
    mismatch = _error(
        lambda: oai.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    )
    assert mismatch.status_code == 400 and "is not the batch's endpoint" in str(mismatch.body)
    unknown = _error(
        lambda: oai.batches.create(
            input_file_id=upload.id,
            endpoint="/v1/completions",  # type: ignore[arg-type]
            completion_window="24h",
        )
    )
    assert unknown.status_code == 400 and "supported" in str(unknown.body)
    own = http_client.post(  # our own submit: the JSONL as the body, the endpoint in the query
        f"{runtime}/v1/batches",
        params={"endpoint": "/v1/responses"},
        content=embeddings_file,
        headers={"Authorization": f"Bearer {oai.api_key}"},
    )
    assert own.status_code == 400
    assert (own.json()["error"]["line"], own.json()["error"]["param"]) == (1, "url")
    assert _stored(tenant) == (before[0], before[1] + 1)  # the good upload only

    no_model = _error(lambda: oai.embeddings.create(model="sim-small", input="x"))
    assert no_model.status_code == 400 and "does not serve /v1/embeddings" in str(no_model.body)
    answer = http_client.post(f"{runtime}/v1/completions", headers={"Authorization": "Bearer x"})
    assert answer.status_code == 404
    message = answer.json()["error"]["message"]
    assert "POST /v1/completions" in message
    assert "POST /v1/responses" in message and "POST /v1/embeddings" in message
    assert _stored(tenant) == (before[0], before[1] + 1)


OFFLINE = """
[models."text-embedding-3-small".offline]
turnaround_s = 60
fallback_s = 10
"""


@pytest.fixture
def offloading(simulator, tmp_path: Path) -> Iterator[None]:
    """This process's registry with ``text-embedding-3-small`` offloading (the module's
    worker keeps the shipped one and sends no offload tick)."""
    saved = dict(os.environ)
    text = DEFAULT_MODELS_FILE.read_text()
    header = '[models."text-embedding-3-small"]\n'
    models = tmp_path / "models.toml"
    models.write_text(text.replace(header, header + "offload = true\n") + OFFLINE)
    os.environ["BATCHGEN_MODELS_FILE"] = str(models)
    os.environ.update(
        {"BATCHGEN_OFFLOAD_POLL_FIRST_S": "0.2", "BATCHGEN_OFFLOAD_POLL_MAX_S": "0.5"}
    )
    get_settings.cache_clear()
    load_registry.cache_clear()
    sim_config(simulator.base_url, batch_turnaround_s=0.5)
    yield
    os.environ.clear()
    os.environ.update(saved)
    get_settings.cache_clear()
    load_registry.cache_clear()
    sim_config(simulator.base_url, batch_turnaround_s=2.0)


def test_an_offloaded_embeddings_batch_comes_back_whole(
    offloading, oai: openai.OpenAI, direct: openai.OpenAI, tenant: str
):
    """A bulk embeddings batch goes to the provider's Batch API as an /v1/embeddings job;
    its rows come back as the provider answered them, ledgered once at batch prices."""
    bodies = {k: v for k, v in EMBEDDINGS_BODIES.items() if v["model"] == "text-embedding-3-small"}
    lines = [
        {"custom_id": case, "method": "POST", "url": "/v1/embeddings", "body": body}
        for case, body in sorted(bodies.items())
    ]
    batch = python_api.submit_batch(lines, tenant=tenant, priority="bulk", completion_window="24h")
    assert batch["endpoint"] == "/v1/embeddings"

    def finished() -> bool:
        if python_api.get_batch(batch["id"], tenant=tenant)["status"] != "in_progress":
            return True
        tick(get_registry(), get_settings())
        return False

    wait_until(finished, 60, "the offloaded batch to finish", 0.2)
    rows = {r["custom_id"]: r for r in python_api.iter_results(batch["id"], tenant=tenant)}
    assert {k: r["response"]["body"] for k, r in rows.items()} == {
        k: _direct_embeddings(direct, b) for k, b in bodies.items()
    }
    ledger = _ledger(batch["id"])
    assert len(ledger) == len(bodies)
    assert {row.route for row in ledger} == {"offline"}
    spec = get_registry()["text-embedding-3-small"]
    for row in ledger:
        assert row.completion_tokens == 0
        assert row.cost_usd == row.prompt_tokens * Decimal(str(spec.input_usd_per_1m)) / 2 / 10**6
