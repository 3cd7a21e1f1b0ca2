"""A request that can never fit the tokens-per-minute limit it runs under (the tenant's
own or the model's, whichever is smaller) is refused at submit, naming that limit and
its line, on every surface (OpenAI Files + Batches, Anthropic Message Batches, the
Python API, a sync call), instead of waiting for ever; nothing is stored."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from batchgen import python_api
from batchgen.config import get_settings
from batchgen.errors import ValidationFailed
from batchgen.registry import load_registry
from batchgen.store import db
from batchgen.store.schema import Batch, Item
from tests import http_client
from tests.helpers import chat_line, make_tenant

# No call is made: the provider's address is never reached.
MODEL_TOML = """
[models."{name}"]
provider = "openai"
base_url = "http://127.0.0.1:9/v1"
api_key_env = "BATCHGEN_SIMULATOR_KEY"
group = "fits"
budget_key = "{name}"
context_window = 32768
max_output_tokens = 8000
tokens_per_min = {tpm}
requests_per_min = 1000
max_concurrency = 4
input_usd_per_1m = 1.0
output_usd_per_1m = 2.0
"""
# The tenant's own limit, between the two models' limits.
TENANT_TPM = 5000
TENANT_BINDS = "the tenant's tokens_per_min of 5000"
MODEL_BINDS = "the tokens_per_min of tight of 3000"


@pytest.fixture(scope="module")
def models_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fits") / "models.toml"
    path.write_text(
        MODEL_TOML.format(name="roomy", tpm=100_000) + MODEL_TOML.format(name="tight", tpm=3000)
    )
    return path


@pytest.fixture(scope="module")
def api_url(module_api_server, models_file: Path) -> str:
    return module_api_server(env={"BATCHGEN_MODELS_FILE": str(models_file)})


@pytest.fixture
def key(clean_db, models_file: Path, monkeypatch) -> Iterator[str]:
    monkeypatch.setenv("BATCHGEN_MODELS_FILE", str(models_file))
    get_settings.cache_clear()
    load_registry.cache_clear()
    yield make_tenant("capped", tokens_per_min=TENANT_TPM)
    get_settings.cache_clear()


def _stored() -> tuple[int, int]:
    with db.session_scope() as s:
        return (
            s.scalar(select(func.count()).select_from(Batch)) or 0,
            s.scalar(select(func.count()).select_from(Item)) or 0,
        )


def _lines(model: str) -> list[dict]:
    """A line that fits, then one of 8 choices of 1000 tokens (over 5000 and 3000)."""
    return [
        chat_line("fits", model=model, max_tokens=100),
        chat_line("never", model=model, max_tokens=1000, n=8),
    ]


@pytest.mark.parametrize(("model", "binds"), [("roomy", TENANT_BINDS), ("tight", MODEL_BINDS)])
def test_openai_files_and_batches_refuse_a_line_that_can_never_fit(api_url, key, model, binds):
    auth = {"Authorization": f"Bearer {key}"}
    content = "\n".join(json.dumps(line) for line in _lines(model)).encode()
    uploaded = http_client.post(
        f"{api_url}/v1/files",
        headers=auth,
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", content)},
    )
    assert uploaded.status_code == 200, uploaded.text
    created = http_client.post(
        f"{api_url}/v1/batches",
        headers=auth,
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert created.status_code == 400, created.text
    error = created.json()["error"]
    assert error["line"] == 2 and error["param"] == "body.max_tokens", error
    assert binds in error["message"] and "can never fit" in error["message"], error
    assert _stored() == (0, 0)


@pytest.mark.parametrize(("model", "binds"), [("roomy", TENANT_BINDS), ("tight", MODEL_BINDS)])
def test_anthropic_message_batches_refuse_a_request_that_can_never_fit(api_url, key, model, binds):
    messages = [{"role": "user", "content": "hello"}]
    requests = [
        {"custom_id": "fits", "params": {"model": model, "max_tokens": 100, "messages": messages}},
        {
            "custom_id": "never",
            "params": {"model": model, "max_tokens": 6000, "messages": messages},
        },
    ]
    created = http_client.post(
        f"{api_url}/v1/messages/batches",
        headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
        json={"requests": requests},
    )
    assert created.status_code == 400, created.text
    message = created.json()["error"]["message"]
    assert binds in message and "can never fit" in message, message
    assert _stored() == (0, 0)


@pytest.mark.parametrize(("model", "binds"), [("roomy", TENANT_BINDS), ("tight", MODEL_BINDS)])
def test_the_python_api_refuses_a_line_that_can_never_fit(key, model, binds):
    with pytest.raises(ValidationFailed, match=f"^line 2, field 'body.max_tokens': .*{binds}"):
        python_api.submit_batch(_lines(model), tenant="capped")
    assert _stored() == (0, 0)


@pytest.mark.parametrize(("model", "binds"), [("roomy", TENANT_BINDS), ("tight", MODEL_BINDS)])
def test_a_sync_call_that_can_never_fit_is_a_400_naming_the_binding_limit(
    api_url, key, model, binds
):
    answer = http_client.post(
        f"{api_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={**_lines(model)[1]["body"], "model": model},
        timeout=60,
    )
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert binds in message and "can never fit" in message, message
    assert _stored() == (0, 0)
