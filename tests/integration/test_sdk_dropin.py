"""The official SDKs, unchanged, against a live batchgen API process (``batchgen api``).

Only ``base_url`` and the key change: what the SDK sends and parses is what a team's
code already does against the provider.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import openai
import pytest
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


def _no_extra_fields(obj: openai.BaseModel) -> bool:
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


def test_a_wrong_key_is_the_sdk_authentication_error(oai: openai.OpenAI):
    stranger = oai.with_options(api_key="bg-not-a-key")
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
