"""``batchgen doctor``: is this deployment able to run, and if not, what to do.

Each check is independent and says what it found and, when something is wrong,
the one thing to do next: the configuration and the model registry load, the
database answers and is migrated to the head revision, Redis and the broker answer
(on RabbitMQ: its queues are quorum queues), every queue has a worker, and every
provider endpoint of the registry answers (Gemini, Vertex AI and Bedrock with their
own credentials).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from batchgen.config import Settings
from batchgen.registry import ModelSpec, ProviderKind, Registry

PROVIDER_TIMEOUT_S = 3.0
AMQP_NOT_FOUND = 404  # the reply code of a passive declare of a missing queue


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    found: str
    fix: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _guard(name: str, run: Callable[[], Check], fix: str) -> Check:
    """A check that raised is failed, its error's class and first line as the finding."""
    try:
        return run()
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return Check(name, False, f"{type(exc).__name__}: {first}", fix)


def check_database(settings: Settings) -> Check:
    def run() -> Check:
        from alembic.runtime.migration import MigrationContext
        from alembic.script import ScriptDirectory

        from batchgen.store import db

        head = ScriptDirectory.from_config(db.alembic_config()).get_current_head()
        with db.get_engine().connect() as connection:
            current = MigrationContext.configure(connection).get_current_revision()
        if current != head:
            return Check(
                "database",
                False,
                f"schema at revision {current or 'none'}, the code needs {head}",
                "run `batchgen db upgrade`",
            )
        return Check("database", True, f"answers, schema at the head revision {head}")

    return _guard("database", run, "check DATABASE_URL (or BATCHGEN_DATABASE_URL) and the server")


def check_redis(settings: Settings) -> Check:
    def run() -> Check:
        from batchgen.limits.backend import get_redis

        get_redis().ping()
        return Check("redis", True, "answers")

    return _guard("redis", run, "check REDIS_URL (or BATCHGEN_REDIS_URL) and the server")


def check_broker(settings: Settings, registry: Registry | None = None) -> Check:
    """The broker answers; on RabbitMQ, also every queue of ``registry`` that the broker
    already has takes the quorum queue's arguments (a classic queue of the same name
    makes every worker fail at its start with PRECONDITION_FAILED)."""

    def run() -> Check:
        from kombu import Connection

        from batchgen.celeryconfig import is_amqp

        with Connection(settings.broker_url, connect_timeout=PROVIDER_TIMEOUT_S) as connection:
            connection.ensure_connection(max_retries=1)
            if is_amqp(settings.broker_url) and registry is not None:
                return _check_amqp_queues(connection, settings.broker_url, registry)
        return Check("broker", True, f"answers ({connection.transport_cls})")

    return _guard("broker", run, "check CELERY_BROKER_URL and the broker")


def _check_amqp_queues(connection: Any, url: str, registry: Registry) -> Check:
    """A passive declare per queue (a missing one is fine: the workers declare it),
    then, for one that exists, a declare with the arguments the workers use: the
    broker refuses it (406) when the existing queue differs. Nothing is created."""
    from batchgen.celeryconfig import broker_queue
    from batchgen.worker.names import CONTROL_QUEUE

    names = [CONTROL_QUEUE, *registry.queues]
    present, different = [], []
    channel: Any = None
    for name in names:
        queue = broker_queue(name, url)
        refused, channel = _declare(connection, channel, queue, passive=True)
        if refused == AMQP_NOT_FOUND:
            continue
        if refused is not None:
            raise RuntimeError(f"the broker refused a passive declare of {name} ({refused})")
        present.append(name)
        refused, channel = _declare(connection, channel, queue, passive=False)
        if refused is not None:
            different.append(name)
    if channel is not None:
        with contextlib.suppress(Exception):
            channel.close()
    if different:
        return Check(
            "broker",
            False,
            f"queue {', '.join(different)} exists with other arguments than a quorum queue",
            "stop the workers, let the queue drain, delete it (rabbitmqctl delete_queue) "
            "and start the workers again: they declare it as a quorum queue",
        )
    return Check(
        "broker",
        True,
        f"answers (amqp, publisher confirms); {len(present)} of {len(names)} queues "
        "present, all quorum queues (the workers declare the others)",
    )


def _declare(connection: Any, channel: Any, queue: Any, passive: bool) -> tuple[int | None, Any]:
    """Declare ``queue``: the reply code of the broker's refusal (None: accepted) and
    the channel to go on with (a refusal closes the channel)."""
    channel = channel or connection.channel()
    try:
        queue.bind(channel).queue_declare(passive=passive)
    except connection.channel_errors as exc:
        return int(getattr(exc, "reply_code", 0) or 0), None
    return None, channel


def check_workers(registry: Registry, settings: Settings) -> Check:
    def run() -> Check:
        from batchgen.monitoring.queues import consumers
        from batchgen.worker.names import CONTROL_QUEUE, NOTIFY_QUEUE

        served = consumers()
        groups = {spec.queue: spec.group for spec in registry}
        queues = [*registry.queues, CONTROL_QUEUE, NOTIFY_QUEUE]
        missing = [q for q in queues if not served.get(q)]
        if not missing:
            return Check("workers", True, f"every queue has a worker ({len(served)} queues)")
        starts = [
            f"`batchgen worker --group {groups[q]}`"
            if q in groups
            else "`batchgen worker`"
            if q == NOTIFY_QUEUE
            else "`batchgen dispatcher`"
            for q in missing
        ]
        return Check(
            "workers",
            False,
            f"no worker consumes {', '.join(missing)}",
            "start " + ", ".join(starts),
        )

    return _guard("workers", run, "check CELERY_BROKER_URL and that workers run")


# The kinds whose endpoints answer in their own formats (probed by their SDKs' auth).
NATIVE_KINDS = (ProviderKind.GEMINI, ProviderKind.VERTEX, ProviderKind.BEDROCK)


def _native_probe(spec: ModelSpec) -> tuple[str, dict[str, str]] | Check:
    """The models listing of a Gemini or Vertex AI endpoint and the headers that
    authenticate it, or the check's failure when the credentials cannot be had."""
    from batchgen.providers import gemini

    name = f"provider {spec.base_url}"
    version = spec.api_version or gemini.DEFAULT_API_VERSION[spec.provider]
    base = spec.base_url.rstrip("/")
    if spec.provider is ProviderKind.GEMINI:
        return f"{base}/{version}/models", {"x-goog-api-key": spec.api_key()}
    try:
        import google.auth.transport.requests

        credentials = gemini.vertex_credentials(spec)
        credentials.refresh(google.auth.transport.requests.Request())
    except Exception as exc:  # noqa: BLE001 - any failure to get a token is the finding
        return Check(
            name,
            False,
            f"no Vertex AI access token ({type(exc).__name__})",
            f"check the service-account key file named by {spec.api_key_env}, or ADC",
        )
    where = f"projects/{spec.project}/locations/{spec.region}/publishers/google/models"
    return f"{base}/{version}/{where}", {"Authorization": f"Bearer {credentials.token}"}


def _bedrock_check(spec: ModelSpec, models: list[str]) -> Check:
    """Bedrock: AWS credentials resolve and its control plane answers (a signed
    ``ListFoundationModels``)."""
    import boto3
    import botocore.config
    import botocore.exceptions

    name = f"provider {spec.base_url}"
    session = boto3.session.Session()
    if session.get_credentials() is None:
        return Check(name, False, "no AWS credentials", "set AWS_PROFILE or AWS_ACCESS_KEY_ID")
    control = session.client(
        "bedrock",
        region_name=spec.region,
        endpoint_url=spec.offline.control_url,
        config=botocore.config.Config(
            retries={"total_max_attempts": 1},
            connect_timeout=PROVIDER_TIMEOUT_S,
            read_timeout=PROVIDER_TIMEOUT_S,
        ),
    )
    try:
        control.list_foundation_models()
    except botocore.exceptions.ClientError as exc:
        status = (exc.response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if status in (401, 403):
            return Check(name, False, f"refuses the credentials (HTTP {status})", "check IAM")
        return Check(name, True, f"answers (HTTP {status}) for {', '.join(models)}")
    except botocore.exceptions.BotoCoreError as exc:
        return Check(
            name, False, f"unreachable ({type(exc).__name__})", "check region and base_url"
        )
    return Check(name, True, f"answers (HTTP 200) for {', '.join(models)}")


def check_providers(registry: Registry) -> list[Check]:
    """Every distinct endpoint of the registry answers its models listing (any HTTP
    answer is reachable; 401 or 403 says the key is refused). Gemini's and Vertex AI's
    are called with their API key or an access token from the service account;
    Bedrock's credentials are resolved and its control plane called, signed."""
    checks = []
    endpoints: dict[tuple[str, ProviderKind], list[str]] = {}
    for spec in registry:
        endpoints.setdefault((spec.base_url, spec.provider), []).append(spec.name)
    for (base_url, kind), models in sorted(endpoints.items()):
        spec = next(s for s in registry if s.name == models[0])
        name = f"provider {base_url}"
        if kind is ProviderKind.BEDROCK:
            checks.append(_bedrock_check(spec, models))
            continue
        if kind in NATIVE_KINDS:
            probe = _native_probe(spec)
            if isinstance(probe, Check):
                checks.append(probe)
                continue
            url, headers = probe
        elif kind is ProviderKind.ANTHROPIC:
            url = base_url.rstrip("/") + "/v1/models"
            headers = {"x-api-key": spec.api_key(), "anthropic-version": "2023-06-01"}
        else:
            url = base_url.rstrip("/") + "/models"
            headers = {"Authorization": f"Bearer {spec.api_key()}"}
        try:
            status = httpx.get(url, headers=headers, timeout=PROVIDER_TIMEOUT_S).status_code
        except httpx.HTTPError as exc:
            checks.append(
                Check(
                    name,
                    False,
                    f"unreachable ({type(exc).__name__})",
                    "check base_url in the registry",
                )
            )
            continue
        if status in (401, 403):
            checks.append(
                Check(name, False, f"refuses the key (HTTP {status})", f"check {spec.api_key_env}")
            )
        else:
            checks.append(Check(name, True, f"answers (HTTP {status}) for {', '.join(models)}"))
    return checks


def run_checks(settings: Settings, registry_loader: Callable[[], Registry]) -> list[Check]:
    """Every check, in order; the registry is loaded once (a broken one is a check too)."""
    checks = [Check("configuration", True, f"models file {settings.paths.models_file}")]
    registry: Registry | None = None
    with contextlib.suppress(Exception):
        registry = registry_loader()
    if registry is None:
        loaded = _guard(
            "registry",
            lambda: Check("registry", True, str(registry_loader())),
            "fix the models file",
        )
        checks.append(loaded)
    else:
        checks.append(Check("registry", True, f"{len(registry.models)} models"))
    checks += [check_database(settings), check_redis(settings), check_broker(settings, registry)]
    if registry is not None:
        checks.append(check_workers(registry, settings))
        checks += check_providers(registry)
    return checks
