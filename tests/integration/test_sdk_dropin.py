"""The official SDKs, unchanged, against a live batchgen API process (``batchgen api``).

Only ``base_url`` and the key change: what the SDK sends and parses is what a team's
code already does against the provider.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import anthropic
import openai
import pytest
from anthropic.types import ModelInfo
from openai.types import Model

from batchgen.registry import get_registry
from tests.helpers import make_tenant

pytestmark = pytest.mark.integration


@pytest.fixture
def oai(clean_db, api_server: Callable[..., str]) -> Iterator[openai.OpenAI]:
    base_url = api_server()
    key = make_tenant("sdk")
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0) as client:
        yield client


def _no_extra_fields(obj: openai.BaseModel | anthropic.BaseModel) -> bool:
    return not (obj.model_extra or {})


def test_models_list_and_retrieve(oai: openai.OpenAI):
    """``client.models.list()`` pages through the registry's models as the SDK's
    ``Model`` objects, ``retrieve`` reads one, and an unknown one is ``NotFoundError``."""
    models = list(oai.models.list())  # the SDK's auto-pagination
    assert [m.id for m in models] == [spec.name for spec in get_registry()]
    assert all(isinstance(m, Model) and _no_extra_fields(m) for m in models)
    assert {m.owned_by for m in models} <= {"openai", "anthropic"}
    assert all(m.object == "model" and m.created > 0 for m in models)
    one = oai.models.retrieve("sim-small")
    assert (one.id, one.owned_by) == ("sim-small", "openai") and _no_extra_fields(one)
    with pytest.raises(openai.NotFoundError) as raised:
        oai.models.retrieve("no-such-model")
    assert raised.value.code == "not_found"
    assert raised.value.body == {  # OpenAI's shape: the error object, our code in it
        "code": "not_found",
        "message": "model 'no-such-model' is not in the registry",
        "param": "model",
    }


def test_a_wrong_key_is_the_sdk_authentication_error(oai: openai.OpenAI):
    stranger = oai.with_options(api_key="bg-not-a-key")
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()


@pytest.fixture
def claude(clean_db, api_server: Callable[..., str]) -> Iterator[anthropic.Anthropic]:
    base_url = api_server()
    key = make_tenant("sdk-anthropic")
    with anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0) as client:
        yield client


def test_anthropic_models_list_pages_and_retrieve(claude: anthropic.Anthropic):
    """The Anthropic SDK (``x-api-key``, ``anthropic-version``) gets its own shape from
    the same routes: ``ModelInfo`` objects, paged by id with ``limit`` and cursors."""
    names = [spec.name for spec in get_registry()]
    assert len(names) >= 3  # enough for a page of 2 to have a second page
    page = claude.models.list(limit=2)
    assert [m.id for m in page.data] == names[:2] and page.has_more
    everything = list(claude.models.list(limit=2))  # the SDK follows after_id
    assert [m.id for m in everything] == names
    assert all(isinstance(m, ModelInfo) and _no_extra_fields(m) for m in everything)
    spec = get_registry()[names[0]]
    first = claude.models.retrieve(names[0])
    assert (first.max_input_tokens, first.max_tokens) == (
        spec.context_window,
        spec.max_output_tokens,
    )
    assert first.lifecycle == "active" and first.created_at.year >= 2020
    before = claude.models.list(before_id=names[2], limit=1)
    assert [m.id for m in before.data] == [names[1]] and before.has_more
    with pytest.raises(anthropic.NotFoundError):
        claude.models.retrieve("no-such-model")
    with pytest.raises(anthropic.BadRequestError):
        claude.models.list(after_id="no-such-model")


def test_anthropic_errors_come_in_its_shape(claude: anthropic.Anthropic):
    """An error answered to the Anthropic SDK is ``{"type": "error", "error": {type,
    message}}`` with our code beside them; the SDK raises its typed exception."""
    with pytest.raises(anthropic.NotFoundError) as raised:
        claude.models.retrieve("no-such-model")
    body = raised.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error" and body["error"]["code"] == "not_found"
    assert "no-such-model" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.models.list(limit=0)
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError) as denied:
        claude.with_options(api_key="bg-not-a-key").models.list()
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
