"""The setup of the offload tests (app/worker/offload_jobs.py), on real PostgreSQL and the
simulator's batch APIs over HTTP: the models' offline routes, S3 (moto's server) and
Cloud Storage (gcp-storage-emulator) for Bedrock's and Vertex AI's jobs, and helpers.

Ticks run in the test's process (one after another, as the beat would send them),
online fallbacks on a real worker; the crash test SIGKILLs a real dispatcher whose
beat runs the tick, while the provider holds the create's answer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anthropic
import openai
import pytest
from google import genai
from sqlalchemy import func, select

from batchgen import python_api as client
from batchgen.config import DEFAULT_MODELS_FILE, get_settings
from batchgen.registry import get_registry, load_registry
from batchgen.store import db
from batchgen.store.schema import Item, ProviderJob, UsageLedger
from batchgen.worker.offload_jobs import TickReport, tick
from tests import http_client
from tests.helpers import (
    chat_line,
    make_tenant,
    sim_config,
)
from tests.native_setup import AWS_ENV, VERTEX_KEY_ENV, model_toml, service_account_file
from tests.waiting import wait_until

MODELS = ["sim-small", "sim-claude", "sim-gemini", "anthropic.claude-sim", "sim-vertex"]
VERTEX_BUCKET = "batchgen-vertex"
# Gemini on Vertex AI at the simulator (its token endpoint signs the service account
# in), batch prediction's Cloud Storage at gcp-storage-emulator's server.
VERTEX_MODEL = model_toml("sim-vertex", "vertex")
VERTEX_ROUTE = """storage_uri = "gs://{bucket}/jobs"
storage_endpoint = "{gcs}"
"""
BEDROCK = "anthropic.claude-sim"
BUCKET = "batchgen-jobs"
# Bedrock's control plane and runtime at the simulator, its S3 at moto's server.
BEDROCK_MODEL = model_toml(BEDROCK, "bedrock", budget_key="sim-bedrock-account")
BEDROCK_ROUTE = """storage_uri = "s3://{bucket}/batchgen"
role_arn = "arn:aws:iam::123456789012:role/batchgen-batch"
storage_endpoint = "{s3}"
control_url = "{sim}"
min_requests = {min_requests}
"""
# A Gemini model at the simulator (Gemini Batch Mode, inline requests).
GEMINI_MODEL = model_toml("sim-gemini", "gemini")
# The registry's offline route in these tests: a job is expected within a minute, and
# 10 s are kept back to run a late job online.
OFFLINE = """
[models."{model}".offline]
turnaround_s = 60
fallback_s = 10
max_requests = {max_requests}
{extra}
"""
OFFLOAD_ENV = {
    # The test's own ticks run the jobs; a worker's beat sends none (but the crash test's).
    "BATCHGEN_OFFLOAD_INTERVAL_S": "3600",
    "BATCHGEN_OFFLOAD_POLL_FIRST_S": "0.2",
    "BATCHGEN_OFFLOAD_POLL_MAX_S": "0.5",
}


def offload_models(
    path: Path, max_requests: int = 1000, extra: str = "", bedrock: str = "", vertex: str = ""
) -> Path:
    """The shipped registry, ``sim-gemini``, ``sim-vertex`` and a Claude model on
    Bedrock, all of :data:`MODELS` offloading (``bedrock``, ``vertex``: their routes'
    own fields)."""
    text = DEFAULT_MODELS_FILE.read_text() + GEMINI_MODEL + BEDROCK_MODEL + VERTEX_MODEL
    for model in MODELS:
        header = f'[models."{model}"]\n'
        text = text.replace(header, header + "offload = true\n")
        own = extra + {BEDROCK: "\n" + bedrock, "sim-vertex": "\n" + vertex}.get(model, "")
        text += OFFLINE.format(model=model, max_requests=max_requests, extra=own)
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    """moto's S3 server (a real HTTP server, in a thread) with the jobs' bucket."""
    import boto3
    from moto.server import ThreadedMotoServer

    from batchgen.embedded import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    s3 = boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"],
    )
    s3.create_bucket(Bucket=BUCKET)
    yield url
    server.stop()


@pytest.fixture(scope="module")
def gcs_server(simulator, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """gcp-storage-emulator's Cloud Storage server (real HTTP, in a thread) with the jobs'
    bucket; and a service-account key file whose token endpoint is the simulator's."""
    from gcp_storage_emulator.server import create_server

    from batchgen.embedded import free_port

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    created = http_client.post(
        f"{url}/storage/v1/b", params={"project": "sim-project"}, json={"name": VERTEX_BUCKET}
    )
    created.raise_for_status()
    token_uri = f"{simulator.base_url}/token"
    key_file = service_account_file(tmp_path_factory.mktemp("vertex"), token_uri)
    os.environ[VERTEX_KEY_ENV] = str(key_file)
    yield url
    os.environ.pop(VERTEX_KEY_ENV, None)
    server.stop()


@pytest.fixture
def offloading(
    simulator, s3_server: str, gcs_server: str, clean_db, tmp_path: Path
) -> Iterator[Callable[..., dict[str, str]]]:
    """Point this process at a registry whose models offload; returns the environment
    a worker needs for the same (call again to change the route's bounds)."""
    saved = dict(os.environ)
    sim_config(
        simulator.base_url,
        batch_turnaround_s=1.0,
        s3_endpoint_url=s3_server,
        gcs_endpoint_url=gcs_server,
    )

    def use(max_requests: int = 1000, extra: str = "", min_requests: int = 1) -> dict[str, str]:
        bedrock = BEDROCK_ROUTE.format(
            bucket=BUCKET, s3=s3_server, sim=simulator.base_url, min_requests=min_requests
        )
        vertex = VERTEX_ROUTE.format(bucket=VERTEX_BUCKET, gcs=gcs_server)
        models = offload_models(tmp_path / "models.toml", max_requests, extra, bedrock, vertex)
        env = {
            "BATCHGEN_MODELS_FILE": str(models),
            VERTEX_KEY_ENV: os.environ[VERTEX_KEY_ENV],
            **OFFLOAD_ENV,
            **AWS_ENV,
        }
        os.environ.update(env)
        get_settings.cache_clear()
        load_registry.cache_clear()
        return env

    yield use
    os.environ.clear()
    os.environ.update(saved)
    get_settings.cache_clear()
    load_registry.cache_clear()
    sim_config(
        simulator.base_url,
        batch_turnaround_s=2.0,
        batch_row_error_rate=0.0,
        batch_expire=False,
        batch_fail=False,
        batch_enqueued_tokens_limit=None,
        batch_create_delay_s=0.0,
        batch_min_records=1,
    )


def ticks_until(done: Callable[[], bool], timeout_s: float = 30.0) -> list[TickReport]:
    """Run offload ticks until ``done()``; returns their reports."""
    reports = []

    def ticked() -> bool:
        if done():
            return True
        reports.append(tick(get_registry(), get_settings()))
        return False

    wait_until(ticked, timeout_s, "the offloaded work to finish", poll_s=0.2)
    return reports


def statuses(batch_id: str) -> dict[str, int]:
    with db.session_scope() as session:
        rows = session.execute(
            select(Item.status, func.count()).where(Item.batch_id == batch_id).group_by(Item.status)
        )
        return {status: n for status, n in rows}


def finished(batch_id: str) -> bool:
    return client.get_batch(batch_id, tenant="admin-offload")["status"] in (
        "completed",
        "cancelled",
        "expired",
    )


def ledger_by_route(batch_id: str) -> dict[tuple[str, bool], int]:
    """Ledger rows of the batch by (route, waste)."""
    with db.session_scope() as session:
        rows = session.execute(
            select(UsageLedger.route, UsageLedger.waste_reason.is_not(None), func.count())
            .where(UsageLedger.batch_id == batch_id)
            .group_by(UsageLedger.route, UsageLedger.waste_reason.is_not(None))
        )
        return {(route, waste): n for route, waste, n in rows}


def late_items(batch_id: str) -> int:
    """Items of the batch that finished after their deadline."""
    with db.session_scope() as session:
        return int(
            session.scalar(
                select(func.count())
                .select_from(Item)
                .where(Item.batch_id == batch_id, Item.finished_at > Item.deadline_at)
            )
            or 0
        )


def jobs_of(batch_id: str) -> list[ProviderJob]:
    with db.session_scope() as session:
        jobs = list(
            session.scalars(
                select(ProviderJob).where(ProviderJob.batch_id == batch_id).order_by(ProviderJob.id)
            )
        )
        session.expunge_all()
        return jobs


def provider_jobs_at_simulator(simulator: Any, model: str) -> list[Any]:
    """Every job the simulator holds for ``model``'s API, through the official SDK."""
    spec = get_registry()[model]
    if spec.provider == "bedrock":
        import boto3

        control = boto3.client("bedrock", endpoint_url=simulator.base_url, region_name="us-east-1")
        named = {"Stopped": "cancelled", "Completed": "completed"}
        return [
            SimpleNamespace(id=job["jobArn"], status=named.get(job["status"], job["status"]))
            for job in control.list_model_invocation_jobs()["invocationJobSummaries"]
        ]
    if spec.provider == "vertex":
        from batchgen.providers.gemini import vertex_credentials

        sdk_vertex = genai.Client(
            vertexai=True,
            project=spec.project,
            location=spec.region,
            credentials=vertex_credentials(spec),
            http_options={"base_url": simulator.base_url, "api_version": "v1beta1"},
        )
        named = {"JOB_STATE_CANCELLED": "cancelled", "JOB_STATE_SUCCEEDED": "completed"}
        return [
            SimpleNamespace(id=job.name, status=named.get(job.state.value, job.state.value))
            for job in sdk_vertex.batches.list(config={"page_size": 100})
        ]
    if spec.provider == "gemini":
        sdk_gemini = genai.Client(
            api_key=spec.api_key(),
            http_options={"base_url": simulator.base_url, "api_version": "v1beta"},
        )
        states = {"JOB_STATE_CANCELLED": "cancelled", "JOB_STATE_SUCCEEDED": "completed"}
        return [
            SimpleNamespace(id=job.name, status=states.get(job.state.value, job.state.value))
            for job in sdk_gemini.batches.list(config={"page_size": 100})
        ]
    if spec.provider == "anthropic":
        sdk = anthropic.Anthropic(base_url=simulator.base_url, api_key=spec.api_key())
        return list(sdk.messages.batches.list(limit=100).data)
    sdk_openai = openai.OpenAI(base_url=f"{simulator.base_url}/v1", api_key=spec.api_key())
    return list(sdk_openai.batches.list(limit=100).data)


def submit(tenant: str, n: int, model: str, **kw: Any) -> str:
    lines = kw.pop("lines", None) or [chat_line(f"{tenant}-{i}", model=model) for i in range(n)]
    kw.setdefault("priority", "bulk")
    kw.setdefault("completion_window", "1h")
    return str(client.submit_batch(lines, tenant=tenant, **kw)["id"])


@pytest.fixture(autouse=True)
def _admin(clean_db) -> None:
    make_tenant("admin-offload", is_admin=True)
