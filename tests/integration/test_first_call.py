"""The first call after the API starts, and the calls that cannot be served: the SDKs
are loaded at start, a Redis that is down or silent is a 503 with Retry-After (not a
call that waits out its deadline), an unmigrated database is a 503 naming `batchgen db
upgrade` (and a log line at start), a wrong model name lists the available ones."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from batchgen import embedded
from batchgen.embedded import free_port
from tests import http_client
from tests.helpers import chat_line, make_tenant

pytestmark = pytest.mark.integration
UNMIGRATED = "batchgen_unmigrated"


@pytest.mark.slow
@pytest.mark.parametrize(("warm_up", "loaded"), [(None, ["1", "1"]), ("false", ["0", "0"])])
def test_creating_the_app_loads_the_provider_sdks(clean_db, warm_up, loaded):
    """By default (``BATCHGEN_WARM_UP`` unset); with it false, nothing is built."""
    env = {k: v for k, v in os.environ.items() if k != "BATCHGEN_WARM_UP"}
    if warm_up is not None:
        env["BATCHGEN_WARM_UP"] = warm_up
    probe = (
        "import sys\n"
        "from batchgen.api import create_app\n"
        "before = {'openai', 'anthropic'} & set(sys.modules)\n"
        "create_app()\n"
        "from batchgen.providers import anthropic, openai\n"
        "print(sorted(before), openai.sdk_client.cache_info().currsize,"
        " anthropic.sdk_client.cache_info().currsize)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=env,
    )
    # Not imported by loading the module, but by creating the app: clients built for
    # the registry's OpenAI models (one base URL) and its Anthropic one.
    assert out.stdout.split() == ["[]", *loaded], out.stderr


@pytest.fixture
def silent_redis() -> Iterator[str]:
    """A TCP port that accepts connections and never answers (a hung Redis)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    finally:
        listener.close()


def _call(base_url: str, key: str, model: str = "sim-small") -> httpx.Response:
    body = {**chat_line("c", model=model)["body"]}
    return http_client.post(
        f"{base_url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}", "X-Request-Timeout": "20"},
        timeout=120,
    )


@pytest.mark.slow
@pytest.mark.parametrize("redis_state", ["refused", "silent"])
def test_a_sync_call_with_redis_down_is_a_503(
    clean_db, simulator, api_server, redis_state, request
):
    key = make_tenant("no-redis")
    if redis_state == "refused":
        url = f"redis://127.0.0.1:{free_port()}/0"
    else:
        url = request.getfixturevalue("silent_redis")
    base_url = api_server(env={"REDIS_URL": url, "BATCHGEN_REDIS_SOCKET_TIMEOUT_S": "1"})
    answer = _call(base_url, key)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "redis_unavailable"
    assert int(answer.headers["Retry-After"]) >= 1


@pytest.mark.slow
def test_an_unmigrated_database_says_batchgen_db_upgrade(clean_db, api_server, tmp_path: Path):
    server_url = clean_db["server_url"]
    embedded.drop_database(server_url, UNMIGRATED)
    url = embedded.ensure_database(server_url, UNMIGRATED)  # empty: no migration applied
    base_url = api_server(env={"DATABASE_URL": url, "BATCHGEN_DATABASE_DIRECT_URL": url})
    answer = http_client.get(
        f"{base_url}/v1/batches", headers={"Authorization": "Bearer sk-any"}, timeout=30
    )
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "database_not_migrated"
    assert "batchgen db upgrade" in error["message"]
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("api-*.log"))
    assert "not migrated" in logs and "batchgen db upgrade" in logs


@pytest.fixture(autouse=True)
def _drop_unmigrated(clean_db) -> Iterator[None]:
    yield
    embedded.drop_database(clean_db["server_url"], UNMIGRATED)


def test_a_wrong_model_name_lists_the_available_ones(clean_db):
    from batchgen.api import create_app

    api = create_app().test_client()
    auth = {"Authorization": f"Bearer {make_tenant('typo')}"}
    body = {**chat_line("c")["body"], "model": "sim-smal"}
    answer = api.post("/v1/chat/completions", json=body, headers=auth)
    assert answer.status_code == 400
    message = answer.json["error"]["message"]
    assert "did you mean 'sim-small'" in message
    assert "available models: sim-claude, sim-large, sim-small" in message
    missing = api.get("/v1/models/gpt-nope", headers=auth)
    assert missing.status_code == 404
    assert "available models: sim-claude, sim-large, sim-small" in missing.json["error"]["message"]
