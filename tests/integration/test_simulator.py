"""The provider simulator over real HTTP, driven by the official SDKs and raw httpx."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import anthropic
import httpx
import openai
import pytest

from batchgen.domain.formats.tokens import count_messages, count_text
from batchgen.simulator import SimulatorConfig, SimulatorThread, completion_text, request_digest
from batchgen.simulator.text import anthropic_prompt_messages, split_chunks
from tests import http_client
from tests.helpers import settled_entry
from tests.waiting import hold, wait_until

MODEL = "sim-gpt"
CLAUDE = "sim-claude"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]
DEFAULTS: dict[str, Any] = {
    "tokens_per_min": 1_000_000,
    "requests_per_min": 10_000,
    "charge_mode": "reserve",
    "latency_base_ms": 5.0,
    "latency_per_token_ms": 0.0,
    "latency_jitter_ms": 0.0,
    "fault_rate": 0.0,
    "context_window": None,
    "hang_s": 5.0,
}
OPENAI_RL = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-requests",
    "x-ratelimit-reset-tokens",
)
GO_DURATION = re.compile(r"^(\d+h)?(\d+m)?(\d+(\.\d+)?s|\d+ms)$")


@pytest.fixture(scope="module")
def sim() -> Iterator[SimulatorThread]:
    with SimulatorThread(SimulatorConfig(seed=1)) as server:
        yield server


@pytest.fixture
def base(sim: SimulatorThread) -> str:
    """Base URL of a freshly reset simulator with the default test settings."""
    http_client.post(sim.base_url + "/_sim/reset").raise_for_status()
    http_client.post(sim.base_url + "/_sim/config", json=DEFAULTS).raise_for_status()
    return sim.base_url


@pytest.fixture
def oai(base: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0) as client:
        yield client


@pytest.fixture
def claude(base: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=base, api_key="ak-test", max_retries=0) as client:
        yield client


def sim_log(base: str, item: str) -> list[dict[str, Any]]:
    return http_client.get(base + "/_sim/log", params={"item": item}).json()


def test_openai_plain(base: str, oai: openai.OpenAI) -> None:
    raw = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=500, extra_headers={"x-batchgen-item": "i1"}
    )
    completion = raw.parse()
    text = completion.choices[0].message.content
    assert text is not None and text.startswith(f"[{request_digest(MESSAGES)}] ")
    assert completion.object == "chat.completion" and completion.model == MODEL
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == count_messages(MESSAGES, "cl100k_base")
    assert completion.usage.completion_tokens == count_text(text, "cl100k_base")
    assert completion.usage.total_tokens == (
        completion.usage.prompt_tokens + completion.usage.completion_tokens
    )
    assert (text, completion.usage.completion_tokens, "stop") == completion_text(MESSAGES, 500)
    assert raw.headers["x-request-id"] == completion.id
    for name in OPENAI_RL:
        assert name in raw.headers
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) == (
        1_000_000 - completion.usage.prompt_tokens - 500
    )
    assert GO_DURATION.match(raw.headers["x-ratelimit-reset-tokens"])
    again = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=500)
    assert again.choices[0].message.content == text and again.id != completion.id
    (entry,) = sim_log(base, "i1")
    assert entry["api"] == "openai" and entry["status"] == 200 and entry["completed"]
    assert entry["completion_tokens"] == completion.usage.completion_tokens
    assert entry["start_ts"] <= entry["end_ts"]
    assert entry["peer"] == "127.0.0.1"  # who called: the client's address


def test_openai_truncation_and_models(base: str, oai: openai.OpenAI) -> None:
    completion = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=12
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 12
    assert MODEL in [m.id for m in oai.models.list()]


def test_openai_stream_with_usage(base: str, oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=500,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finishes, usage = [], [], None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finishes.append(choice.finish_reason)
    text, tokens, _ = completion_text(MESSAGES, 500)
    assert "".join(pieces) == text
    assert len([p for p in pieces if p]) >= 3
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert usage is not None and usage.completion_tokens == tokens
    assert usage.prompt_tokens == count_messages(MESSAGES, "cl100k_base")
    with http_client.stream(
        "POST",
        base + "/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "stream": True},
    ) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_anthropic_plain(base: str, claude: anthropic.Anthropic) -> None:
    user = MESSAGES[1:]
    raw = claude.messages.with_raw_response.create(
        model=CLAUDE, max_tokens=400, system="You are terse.", messages=user
    )
    message = raw.parse()
    prompt_messages = anthropic_prompt_messages("You are terse.", user)
    text, tokens, _ = completion_text(prompt_messages, 400)
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text == text
    assert text.startswith(f"[{request_digest(prompt_messages)}] ")
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens == count_messages(prompt_messages, "cl100k_base")
    assert message.usage.output_tokens == tokens == count_text(text, "cl100k_base")
    assert raw.headers["request-id"] == message.id
    for what in ("requests", "tokens"):
        assert raw.headers[f"anthropic-ratelimit-{what}-limit"]
        assert raw.headers[f"anthropic-ratelimit-{what}-remaining"]
        assert re.match(
            r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$", raw.headers[f"anthropic-ratelimit-{what}-reset"]
        )
    short = claude.messages.create(model=CLAUDE, max_tokens=10, messages=user)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens <= 10


def test_anthropic_stream(base: str, claude: anthropic.Anthropic) -> None:
    user = MESSAGES[1:]
    kinds = []
    with claude.messages.stream(
        model=CLAUDE, max_tokens=400, system="You are terse.", messages=user
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    text, tokens, _ = completion_text(anthropic_prompt_messages("You are terse.", user), 400)
    assert final.content[0].type == "text" and final.content[0].text == text
    assert final.usage.output_tokens == tokens and final.stop_reason == "end_turn"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds or "text" in kinds


def test_bad_requests(base: str, oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=[], max_tokens=5)
    assert err.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as aerr:
        claude.messages.create(model=CLAUDE, max_tokens=0, messages=MESSAGES[1:])
    assert aerr.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    resp = http_client.post(base + "/v1/chat/completions", content=b"{not json")
    assert resp.status_code == 400 and "x-request-id" in resp.headers
    resp = http_client.post(base + "/v1/chat/completions", content=b'{"model": "m", "messages": 3}')
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    http_client.post(base + "/_sim/config", json={"context_window": 10}).raise_for_status()
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    assert err.value.code == "context_length_exceeded"
    assert http_client.post(base + "/_sim/config", json={"fault_rate": 7}).status_code == 400
    assert http_client.post(base + "/_sim/config", json={"seed": 7}).status_code == 400
    stats = http_client.get(base + "/_sim/stats").json()
    assert stats["bad_requests"] == 5 and stats["admitted"] == 0


@pytest.mark.parametrize(
    ("fault", "exc"),
    [
        ("5xx", openai.InternalServerError),
        ("hang", openai.APITimeoutError),
        ("reset", openai.APIConnectionError),
        ("malformed", json.JSONDecodeError),
        ("429", openai.RateLimitError),
    ],
)
def test_openai_faults(base: str, oai: openai.OpenAI, fault: str, exc: type[Exception]) -> None:
    item = f"fault-{fault}"
    with pytest.raises(exc):
        oai.with_options(timeout=0.5).chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=50,
            extra_headers={"x-sim-fault": fault, "x-batchgen-item": item},
        )
    entry = settled_entry(base, item)
    assert entry["fault"] == fault
    assert entry["completed"] is (fault not in ("hang", "reset"))
    assert (
        entry["status"]
        == {"5xx": entry["status"], "hang": None, "reset": None, "malformed": 200, "429": 429}[
            fault
        ]
    )
    if fault == "5xx":
        assert entry["status"] in (500, 503)
    if fault == "hang":  # the server noticed the client leaving long before hang_s
        assert entry["end_ts"] - entry["start_ts"] < DEFAULTS["hang_s"]


@pytest.mark.parametrize(
    ("fault", "exc"),
    [
        ("5xx", anthropic.InternalServerError),
        ("hang", anthropic.APITimeoutError),
        ("reset", anthropic.APIConnectionError),
        ("malformed", json.JSONDecodeError),
        ("429", anthropic.RateLimitError),
    ],
)
def test_anthropic_faults(
    base: str, claude: anthropic.Anthropic, fault: str, exc: type[Exception]
) -> None:
    with pytest.raises(exc):
        claude.with_options(timeout=0.5).messages.create(
            model=CLAUDE, messages=MESSAGES[1:], max_tokens=50, extra_headers={"x-sim-fault": fault}
        )


def test_random_faults_are_seeded_and_counted(base: str) -> None:
    http_client.post(
        base + "/_sim/config", json={"fault_rate": 0.5, "fault_kinds": ["5xx", "malformed"]}
    ).raise_for_status()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20}
    with httpx.Client(base_url=base) as client:
        statuses = [client.post("/v1/chat/completions", json=body).status_code for _ in range(40)]
    stats = http_client.get(base + "/_sim/stats").json()
    faults = stats["faults"]
    assert faults.get("5xx", 0) + faults.get("malformed", 0) == stats["errors"] > 0
    assert statuses.count(200) == 40 - faults.get("5xx", 0)
    # A reset reseeds the fault RNG: the same sequence again.
    with httpx.Client(base_url=base) as client:
        client.post("/_sim/reset").raise_for_status()
        again = [client.post("/v1/chat/completions", json=body).status_code for _ in range(40)]
    assert again == statuses


def test_stream_cancel_is_logged_incomplete(base: str, oai: openai.OpenAI) -> None:
    http_client.post(base + "/_sim/config", json={"latency_per_token_ms": 40}).raise_for_status()
    _, tokens, _ = completion_text(MESSAGES, 500)
    full_s = 0.005 + 0.040 * tokens  # >= 0.8 s since the natural length is >= 20 tokens
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=500,
        stream=True,
        extra_headers={"x-batchgen-item": "cancel-me"},
    )
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    stream.close()
    entry = settled_entry(base, "cancel-me")
    assert entry["completed"] is False and entry["status"] == 200 and entry["stream"]
    assert entry["end_ts"] - entry["start_ts"] < full_s
    assert 0 < entry["completion_tokens"] < tokens


def test_a_paced_stream_gathers_its_chunks_and_sends_none_early(base: str) -> None:
    """With a per-token latency, the chunks go out at most every STREAM_PACE_S, each
    write carrying the chunks due by then: all of them, in order, in fewer writes than
    chunks, and none before its time."""
    per_token_ms = 0.5
    config = {"latency_per_token_ms": per_token_ms}
    http_client.post(base + "/_sim/config", json=config).raise_for_status()
    text, tokens, _ = completion_text(MESSAGES, 500)
    chunks = len(split_chunks(text))
    assert chunks >= 20  # about 2 ms of latency each: several in every 10 ms write
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 500, "stream": True}
    headers = {"authorization": "Bearer sk-test", "x-batchgen-item": "paced"}
    reads, raw = 0, b""
    started = time.monotonic()
    with http_client.stream("POST", base + "/v1/chat/completions", json=body, headers=headers) as r:
        for piece in r.iter_raw():
            reads, raw = reads + 1, raw + piece
    took_s = time.monotonic() - started
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line[6:7] == "{"]
    said = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert said == text
    assert reads < chunks / 2  # one write a chunk made a read a chunk
    assert took_s >= per_token_ms * tokens / 1000  # the stream's own time, all of it
    assert settled_entry(base, "paced")["completion_tokens"] == tokens


def test_actual_charge_mode_refunds_unused_tokens(base: str, oai: openai.OpenAI) -> None:
    http_client.post(base + "/_sim/config", json={"charge_mode": "actual"}).raise_for_status()
    completion = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2000, extra_headers={"x-batchgen-item": "a"}
    )
    assert completion.usage is not None
    entry = settled_entry(base, "a")
    assert entry["charged_tokens"] == completion.usage.total_tokens
    assert (
        http_client.get(base + "/_sim/stats").json()["tokens_admitted"] == entry["charged_tokens"]
    )


def test_rpm_limit(base: str, oai: openai.OpenAI) -> None:
    http_client.post(base + "/_sim/config", json={"requests_per_min": 3}).raise_for_status()
    for _ in range(3):
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    with pytest.raises(openai.RateLimitError) as err:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    assert err.value.body["type"] == "requests"  # type: ignore[index]
    assert err.value.code == "rate_limit_exceeded"
    headers = err.value.response.headers
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert 55 <= int(headers["retry-after"]) <= 60
    # Another API key has its own budget.
    with openai.OpenAI(base_url=base + "/v1", api_key="sk-other", max_retries=0) as other:
        other.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)


def test_no_text_in_server_logs(
    base: str, oai: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="batchgen.simulator")
    secret = [{"role": "user", "content": "zebra-quokka-secret"}]
    completion = oai.chat.completions.create(model=MODEL, messages=secret, max_tokens=50)
    # The server thread logs the call after answering it.
    wait_until(lambda: "sim " in caplog.text, 5, lambda: caplog.text, 0.01)
    assert "zebra-quokka-secret" not in caplog.text
    assert (completion.choices[0].message.content or "")[20:] not in caplog.text


def test_tpm_hammer_never_exceeds_the_window() -> None:
    config = SimulatorConfig(
        tokens_per_min=6000, requests_per_min=100_000, window_s=60.0, latency_base_ms=20, seed=3
    )

    async def hammer(url: str) -> list[httpx.Response]:
        out: list[httpx.Response] = []
        stop = time.monotonic() + 3.0
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200}

        async def worker(client: httpx.AsyncClient, n: int) -> None:
            while time.monotonic() < stop:
                out.append(
                    await client.post(
                        "/v1/chat/completions",
                        json=body,
                        headers={"authorization": "Bearer sk-hammer", "x-batchgen-item": f"h{n}"},
                    )
                )

        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
            await asyncio.gather(*(worker(client, n) for n in range(20)))
        return out

    with SimulatorThread(config) as server:
        responses = asyncio.run(hammer(server.base_url))
        stats = http_client.get(server.base_url + "/_sim/stats").json()
    ok = [r for r in responses if r.status_code == 200]
    limited = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(limited) == len(responses)
    assert limited and ok
    per_request = count_messages(MESSAGES, "cl100k_base") + 200
    assert len(ok) == 6000 // per_request
    assert stats["rate_limited"] == len(limited) and stats["admitted"] == len(ok)
    assert stats["max_tokens_in_any_window"] <= 6000
    assert stats["max_tokens_in_any_window_per_model"][MODEL] <= 6000
    assert stats["tokens_admitted"] == len(ok) * per_request
    for resp in ok + limited:
        assert resp.headers["x-request-id"]
        for name in OPENAI_RL:
            assert name in resp.headers
        assert resp.headers["x-ratelimit-limit-tokens"] == "6000"
    for resp in limited:
        retry = int(resp.headers["retry-after"])
        retry_ms = int(resp.headers["retry-after-ms"])
        assert 1 <= retry <= 60 and 0 < retry_ms <= 60_000 and retry == -(-retry_ms // 1000)
        assert int(resp.headers["x-ratelimit-remaining-tokens"]) < per_request
        error = resp.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "tokens"


def test_300_concurrent_requests() -> None:
    config = SimulatorConfig(latency_base_ms=200, seed=4)

    async def burst(url: str) -> list[int]:
        connector = aiohttp.TCPConnector(limit=400)
        async with aiohttp.ClientSession(url, connector=connector) as session:

            async def one(i: int) -> int:
                body = {
                    "model": MODEL,
                    "max_tokens": 30,
                    "messages": [{"role": "user", "content": f"question {i}"}],
                }
                async with session.post("/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    return resp.status

            return await asyncio.gather(*(one(i) for i in range(300)))

    with SimulatorThread(config) as server:
        statuses = asyncio.run(burst(server.base_url))
        stats = http_client.get(server.base_url + "/_sim/stats").json()
    assert statuses == [200] * 300
    assert stats["admitted"] == 300 and stats["in_flight"] == 0
    assert stats["max_in_flight"] >= 50


# -- token-bucket mode ----------------------------------------------------------------------


def _post_raw(
    client: httpx.Client, path: str, body: dict[str, Any], **headers: str
) -> tuple[httpx.Response, int]:
    """POST ``body`` as exactly these bytes; returns (response, bytes sent)."""
    raw = json.dumps(body).encode()
    resp = client.post(path, content=raw, headers={"content-type": "application/json", **headers})
    return resp, len(raw)


def _charge(body_bytes: int, max_tokens: int) -> int:
    """The simulator's own count in bucket mode."""
    return -(-body_bytes // 4) + max_tokens


def test_bucket_own_count_headers_and_refill() -> None:
    capacity, window_s = 3000, 6.0  # refills 500 tokens per second
    config = SimulatorConfig(
        tokens_per_min=capacity,
        requests_per_min=1000,
        window_s=window_s,
        limiter="bucket",
        latency_base_ms=5,
        seed=5,
    )
    long_prompt = [{"role": "user", "content": "alpha " * 600}]  # ~600 tiktoken tokens
    with SimulatorThread(config) as server, httpx.Client(base_url=server.base_url) as client:
        auth = {"authorization": "Bearer sk-bucket"}
        # 1. A long prompt is charged ceil(bytes / 4) + max_tokens, not tiktoken's count.
        first_body = {"model": MODEL, "messages": long_prompt, "max_tokens": 1000}
        first, nbytes = _post_raw(client, "/v1/chat/completions", first_body, **auth)
        assert first.status_code == 200
        charge = _charge(nbytes, 1000)
        usage = first.json()["usage"]
        assert usage["prompt_tokens"] == count_messages(long_prompt, "cl100k_base")
        assert usage["prompt_tokens"] + 1000 < charge  # the own count is bigger here
        for name in OPENAI_RL:
            assert name in first.headers
        assert first.headers["x-ratelimit-limit-tokens"] == str(capacity)
        # The bucket started full: nothing has refilled yet at admission.
        assert int(first.headers["x-ratelimit-remaining-tokens"]) == capacity - charge
        assert GO_DURATION.match(first.headers["x-ratelimit-reset-tokens"])
        assert first.headers["x-ratelimit-reset-tokens"].endswith("s")
        assert first.headers["x-ratelimit-remaining-requests"] == "999"
        # 2. Drain it: ask for (nearly) all that is left.
        rest = int(first.headers["x-ratelimit-remaining-tokens"])
        drain_body = {"model": MODEL, "messages": MESSAGES, "max_tokens": rest}
        drain_body["max_tokens"] = rest - _charge(len(json.dumps(drain_body).encode()), 0)
        drain, drain_bytes = _post_raw(client, "/v1/chat/completions", drain_body, **auth)
        assert drain.status_code == 200
        drain_charge = _charge(drain_bytes, drain_body["max_tokens"])
        assert rest - 3 <= drain_charge <= rest
        # 3. A request that does not fit: 429 with the rate-limit headers and an exact wait.
        body = {"model": MODEL, "messages": long_prompt, "max_tokens": 200}
        denied, nbytes = _post_raw(client, "/v1/chat/completions", body, **auth)
        assert denied.status_code == 429
        need = _charge(nbytes, 200)
        for name in OPENAI_RL:
            assert name in denied.headers
        left = int(denied.headers["x-ratelimit-remaining-tokens"])
        assert left < need
        retry_ms = int(denied.headers["retry-after-ms"])
        assert int(denied.headers["retry-after"]) == max(1, -(-retry_ms // 1000))
        rate = capacity / window_s
        # The wait is what the missing tokens take to refill (remaining is rounded down).
        assert (need - left - 1) / rate * 1000 <= retry_ms <= (need - left) / rate * 1000 + 1
        error = denied.json()["error"]
        assert error["type"] == "tokens" and error["code"] == "rate_limit_exceeded"
        # 4. Refill: wait what the server said (polling by its retry-after), then it fits.
        started = time.monotonic()
        statuses = []
        while True:
            again, _ = _post_raw(client, "/v1/chat/completions", body, **auth)
            statuses.append(again.status_code)
            for name in OPENAI_RL:
                assert name in again.headers
            if again.status_code == 200:
                break
            assert time.monotonic() - started < 30, statuses
            hold(int(again.headers["retry-after-ms"]) / 1000, "the server's retry-after")
        assert statuses[0] == 429  # not before its time
        assert len(statuses) <= 3
        assert int(again.headers["x-ratelimit-remaining-tokens"]) < need
        stats = client.get("/_sim/stats").json()
    assert stats["limiter"] == "bucket"
    assert stats["admitted"] == 3 and stats["rate_limited"] == 1 + statuses.count(429)
    bound = stats["bound"]["tokens"]
    assert bound["admitted"] == stats["tokens_admitted"] == charge + drain_charge + need
    assert bound["capacity"] == capacity and bound["refill_per_s"] == pytest.approx(rate)
    assert bound["max_burst"] <= capacity and bound["respected"] is True
    assert stats["bound"]["requests"]["admitted"] == 3


def test_bucket_requests_limit_switched_on_at_run_time() -> None:
    with (
        SimulatorThread(SimulatorConfig(seed=6)) as server,
        httpx.Client(base_url=server.base_url) as client,
    ):
        assert client.get("/_sim/config").json()["limiter"] == "window"
        changes = {"limiter": "bucket", "requests_per_min": 3, "tokens_per_min": 100_000}
        assert client.post("/_sim/config", json=changes).json()["limiter"] == "bucket"
        window_s = client.get("/_sim/config").json()["window_s"]
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5}
        # window_s is 60 s: 3 requests per 60 s refill one every 20 s.
        for n in range(3):
            ok, _ = _post_raw(client, "/v1/chat/completions", body)
            assert ok.status_code == 200
            assert ok.headers["x-ratelimit-remaining-requests"] == str(2 - n)
        denied, _ = _post_raw(client, "/v1/chat/completions", body)
        assert denied.status_code == 429 and denied.json()["error"]["type"] == "requests"
        assert denied.headers["x-ratelimit-remaining-requests"] == "0"
        retry_ms = int(denied.headers["retry-after-ms"])
        assert 19_000 <= retry_ms <= window_s / 3 * 1000 + 1
        assert GO_DURATION.match(denied.headers["x-ratelimit-reset-requests"])
        # A faster refill through the admin route: 300 per 60 s, one every 0.2 s.
        client.post("/_sim/config", json={"requests_per_min": 300}).raise_for_status()
        started = time.monotonic()
        while True:
            again, _ = _post_raw(client, "/v1/chat/completions", body)
            if again.status_code == 200:
                break
            assert int(again.headers["retry-after-ms"]) <= 200
            assert time.monotonic() - started < 10
            hold(int(again.headers["retry-after-ms"]) / 1000, "the server's retry-after")
        assert again.headers["x-ratelimit-limit-requests"] == "300"


def test_bucket_anthropic_headers_and_own_count() -> None:
    capacity = 2000
    config = SimulatorConfig(
        tokens_per_min=capacity, requests_per_min=50, limiter="bucket", seed=7, window_s=60.0
    )
    with SimulatorThread(config) as server, httpx.Client(base_url=server.base_url) as client:
        headers = {"x-api-key": "ak-bucket", "anthropic-version": "2023-06-01"}
        body = {
            "model": CLAUDE,
            "max_tokens": 300,
            "system": "You are terse.",
            "messages": [{"role": "user", "content": "bravo " * 300}],
        }
        first, nbytes = _post_raw(client, "/v1/messages", body, **headers)
        assert first.status_code == 200
        charge = _charge(nbytes, 300)
        assert first.json()["usage"]["input_tokens"] == count_messages(
            anthropic_prompt_messages("You are terse.", body["messages"]), "cl100k_base"
        )
        assert first.headers["anthropic-ratelimit-tokens-limit"] == str(capacity)
        assert int(first.headers["anthropic-ratelimit-tokens-remaining"]) == capacity - charge
        assert first.headers["anthropic-ratelimit-requests-remaining"] == "49"
        body["max_tokens"] = capacity  # can never fit: ceil(bytes / 4) + capacity > capacity
        denied, _ = _post_raw(client, "/v1/messages", body, **headers)
        assert denied.status_code == 429
        assert denied.json()["error"]["type"] == "rate_limit_error"
        for what in ("requests", "tokens"):
            for part in ("limit", "remaining", "reset"):
                assert f"anthropic-ratelimit-{what}-{part}" in denied.headers
        assert re.match(
            r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$", denied.headers["anthropic-ratelimit-tokens-reset"]
        )
        assert int(denied.headers["anthropic-ratelimit-tokens-remaining"]) >= capacity - charge
        assert int(denied.headers["retry-after"]) >= 1 and "retry-after-ms" in denied.headers


def test_simulated_deployments_have_their_own_limits_and_faults(base: str) -> None:
    """Under /d/<name>/ each deployment limits and fails on its own; the log and stats
    say which deployment took each call, and what it asked of the limit."""
    lanes = {"small": {"tokens_per_min": 300}, "broken": {"fault_rate": 1.0}}
    assert http_client.post(base + "/_sim/deployments", json=lanes).status_code == 200
    body = {"model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}

    def call(prefix: str) -> int:
        return http_client.post(f"{base}{prefix}/v1/chat/completions", json=body).status_code

    assert [call("/d/small") for _ in range(4)] == [200, 200, 429, 429]  # ~110 tokens each
    assert call("") == 200  # the root's own limits: none here
    assert call("/d/broken") >= 500
    assert call("/d/nowhere") == 404
    log = http_client.get(base + "/_sim/log").json()
    assert [e["deployment"] for e in log] == ["small"] * 4 + [None, "broken"]
    assert all(e["requested_tokens"] > 100 for e in log[:4])
    stats = http_client.get(base + "/_sim/stats").json()["deployments"]
    small = stats["small"]
    assert (small["requests"], small["admitted"], small["rate_limited"]) == (4, 2, 2)
    assert small["bound"]["tokens"]["respected"] and small["bound"]["tokens"]["limit"] == 300
    assert stats["broken"]["errors"] == 1
    bad = http_client.post(base + "/_sim/deployments", json={"x": {"fault_rate": 3}})
    assert bad.status_code == 400 and "fault_rate" in bad.json()["error"]


@pytest.mark.parametrize("limiter", ["window", "bucket"])
@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_the_reset_headers_are_true_to_the_limiter(limiter: str, api: str) -> None:
    """What the budget learns its shape from (app/domain/scheduling/rate_limits.py shape_evidence):
    the window's reset is its newest charge's age-out, the bucket's the time to full."""
    from batchgen.domain.scheduling.rate_limits import shape_evidence
    from batchgen.providers.headers import rate_limits_of

    window_s = 30.0
    config = SimulatorConfig(
        tokens_per_min=20_000,
        requests_per_min=200,
        window_s=window_s,
        limiter=limiter,  # type: ignore[arg-type]
        latency_base_ms=5,
        seed=6,
    )
    body = {"model": MODEL, "max_tokens": 500, "messages": [{"role": "user", "content": "hi"}]}
    path = "/v1/chat/completions" if api == "openai" else "/v1/messages"
    with SimulatorThread(config) as server, httpx.Client(base_url=server.base_url) as client:
        seen = set()
        for _ in range(3):
            answer = client.post(path, json=body, headers={"authorization": "Bearer sk-shape"})
            assert answer.status_code == 200
            seen.add(shape_evidence(rate_limits_of(dict(answer.headers)), window_s))
    assert seen == {limiter}
