"""Offloading bulk work to the providers' own Batch APIs (app/worker/offload_jobs.py), on
real PostgreSQL and the simulator's OpenAI and Anthropic batch APIs over HTTP.

Ticks run in the test's process (one after another, as the beat would send them),
online fallbacks on a real worker; the crash test SIGKILLs a real dispatcher whose
beat runs the tick, while the provider holds the create's answer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import openai
import pytest
from google import genai
from sqlalchemy import func, select

from batchgen import python_api as client
from batchgen.config import DEFAULT_MODELS_FILE, get_settings
from batchgen.registry import get_registry, load_registry
from batchgen.store import db
from batchgen.store.schema import Item, ProviderJob, Result, UsageLedger
from batchgen.worker.offload_jobs import TickReport, tick
from tests.helpers import (
    assert_daily_usage_matches_ledger,
    assert_ledger_is_results_plus_waste,
    chat_line,
    make_tenant,
    sim_config,
    wait_batches,
)
from tests.native_setup import AWS_ENV, VERTEX_KEY_ENV, model_toml, service_account_file
from tests.waiting import hold, wait_until

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
    import httpx
    from gcp_storage_emulator.server import create_server

    from batchgen.embedded import free_port

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    created = httpx.post(
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


@pytest.mark.parametrize("model", MODELS)
def test_a_bulk_batch_is_offloaded_and_recorded_at_the_batch_price(offloading, simulator, model):
    offloading()
    tenant = f"offload-all-{model}"
    make_tenant(tenant)
    batch_id = submit(tenant, 6, model)
    assert statuses(batch_id) == {"offloaded": 6}
    ticks_until(lambda: finished(batch_id))

    assert statuses(batch_id) == {"succeeded": 6}
    assert ledger_by_route(batch_id) == {("offline", False): 6}
    (job,) = jobs_of(batch_id)
    assert (job.status, job.item_count, job.provider_job_id is not None) == ("ended", 6, True)
    assert len(provider_jobs_at_simulator(simulator, model)) >= 1
    spec = get_registry()[model]
    batch_prices = spec.offline_prices()
    with db.session_scope() as session:
        rows = session.execute(
            select(
                UsageLedger.prompt_tokens,
                UsageLedger.completion_tokens,
                UsageLedger.cost_usd,
                UsageLedger.online_cost_usd,
            ).where(UsageLedger.batch_id == batch_id)
        ).all()
        result_cost = session.scalar(
            select(func.sum(Result.cost_usd)).where(Result.batch_id == batch_id)
        )
    million = Decimal(1_000_000)
    for prompt, completion, cost, online_cost in rows:
        assert prompt > 0 and completion > 0
        expected = (
            prompt * Decimal(str(batch_prices.input_usd_per_1m))
            + completion * Decimal(str(batch_prices.output_usd_per_1m))
        ) / million
        assert cost == expected
        assert online_cost == 2 * cost  # the shipped route: half the online prices
    assert result_cost == sum(r[2] for r in rows)
    assert_ledger_is_results_plus_waste()
    assert_daily_usage_matches_ledger()
    # The results read as any batch's, in the OpenAI output format.
    results = list(client.iter_results(batch_id, tenant=tenant))
    assert [r["response"]["status_code"] for r in results] == [200] * 6


def test_a_gemini_job_over_the_inline_bound_goes_as_a_file(offloading, simulator):
    offloading(extra="inline_max_bytes = 1")  # every job is "large": a file
    tenant = "offload-gemini-file"
    make_tenant(tenant)
    batch_id = submit(tenant, 3, "sim-gemini")
    ticks_until(lambda: finished(batch_id))
    assert statuses(batch_id) == {"succeeded": 3}
    assert ledger_by_route(batch_id) == {("offline", False): 3}
    sent = httpx.get(f"{simulator.base_url}/_sim/last_request", params={"api": "gemini_batch"})
    source = sent.json()["batch"]["inputConfig"]
    assert source["fileName"].startswith("files/") and "requests" not in source
    with db.session_scope() as session:
        costs = session.execute(
            select(UsageLedger.cost_usd, UsageLedger.online_cost_usd).where(
                UsageLedger.batch_id == batch_id
            )
        ).all()
    assert len(costs) == 3 and all(cost > 0 and online == 2 * cost for cost, online in costs)
    results = list(client.iter_results(batch_id, tenant=tenant))
    assert [r["response"]["body"]["object"] for r in results] == ["chat.completion"] * 3


@pytest.mark.slow
def test_near_deadlines_run_online_and_the_rest_offline(offloading, simulator, workers):
    env = offloading()
    tenant = "offload-mixed"
    make_tenant(tenant)
    lines = [chat_line(f"far-{i}") for i in range(4)]
    # A per-item deadline of 30 s leaves no room for a job expected within 60 s.
    lines += [{**chat_line(f"near-{i}"), "timeout": "30s"} for i in range(3)]
    batch_id = submit(tenant, 0, "sim-small", lines=lines)
    assert statuses(batch_id) == {"offloaded": 4, "pending": 3}
    # An interactive batch and one that says never stay online whatever their window.
    interactive = submit(tenant, 2, "sim-small", priority="interactive")
    never = submit(tenant, 2, "sim-small", offload="never")
    assert statuses(interactive) == {"pending": 2} and statuses(never) == {"pending": 2}
    workers(env=env, beat=True)
    wait_batches([interactive, never], timeout_s=60)
    ticks_until(lambda: finished(batch_id))

    assert statuses(batch_id) == {"succeeded": 7}
    assert ledger_by_route(batch_id) == {("offline", False): 4, ("online", False): 3}
    with db.session_scope() as session:
        offline_ids = set(
            session.scalars(
                select(Item.custom_id).where(Item.batch_id == batch_id, Item.job_id.is_not(None))
            )
        )
    assert offline_ids == {f"far-{i}" for i in range(4)}
    assert ledger_by_route(interactive) == {("online", False): 2}
    assert_ledger_is_results_plus_waste()


def test_always_needs_a_model_that_offloads(offloading):
    offloading()
    tenant = "offload-always-bad"
    make_tenant(tenant)
    from batchgen.errors import ValidationFailed

    with pytest.raises(ValidationFailed, match="'sim-large' has no offline route"):
        submit(tenant, 2, "sim-large", offload="always")
    with pytest.raises(ValidationFailed, match="offload must be one of"):
        submit(tenant, 2, "sim-small", offload="sometimes")
    with db.session_scope() as session:
        assert not session.scalar(
            select(func.count()).select_from(Item).where(Item.custom_id.like(f"{tenant}-%"))
        )


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_an_expired_job_falls_back_online_within_the_deadline(
    offloading, simulator, workers, model
):
    env = offloading()
    sim_config(simulator.base_url, batch_expire=True, batch_turnaround_s=0.5)
    tenant = f"offload-expired-{model}"
    make_tenant(tenant)
    batch_id = submit(tenant, 5, model)
    workers(env=env)
    ticks_until(lambda: finished(batch_id), timeout_s=60)

    assert statuses(batch_id) == {"succeeded": 5}
    assert ledger_by_route(batch_id) == {("online", False): 5}
    (job,) = jobs_of(batch_id)
    assert job.status == "ended"
    assert late_items(batch_id) == 0
    assert_ledger_is_results_plus_waste()


@pytest.mark.slow
def test_a_partly_failed_job_runs_its_errored_rows_online(offloading, simulator, workers):
    env = offloading()
    sim_config(simulator.base_url, batch_row_error_rate=0.4)
    tenant = "offload-partial"
    make_tenant(tenant)
    batch_id = submit(tenant, 10, "sim-small")
    workers(env=env)
    ticks_until(lambda: finished(batch_id), timeout_s=60)

    assert statuses(batch_id) == {"succeeded": 10}
    by_route = ledger_by_route(batch_id)
    offline, online = by_route.get(("offline", False), 0), by_route.get(("online", False), 0)
    assert offline + online == 10 and online > 0 and offline > 0
    with db.session_scope() as session:
        codes = set(
            session.scalars(
                select(Item.error_code).where(Item.batch_id == batch_id, Item.attempts > 1)
            )
        )
    assert codes <= {None}  # succeeded items carry no error code
    assert_ledger_is_results_plus_waste()
    assert_daily_usage_matches_ledger()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["sim-small", "sim-gemini", BEDROCK, "sim-vertex"])
def test_a_job_past_its_cutoff_is_cancelled_there_and_run_online(
    offloading, simulator, workers, model
):
    env = offloading()
    sim_config(simulator.base_url, batch_turnaround_s=600)  # far later than the deadline
    tenant = "offload-late"
    make_tenant(tenant)
    # always: offloaded whenever more than fallback_s (10 s) is left; cut off 10 s
    # (plus the drain time) before the 40 s deadline: a loaded machine has 25 s to create the job.
    batch_id = submit(tenant, 4, model, offload="always", completion_window="40s")
    assert statuses(batch_id) == {"offloaded": 4}
    # The job is created before the workers start (a worker's start on a loaded machine
    # must not eat the time to the cutoff); they run the rows online once it is cut off.
    reports = ticks_until(lambda: bool(jobs_of(batch_id)), timeout_s=20)
    workers(env=env)
    reports += ticks_until(lambda: finished(batch_id), timeout_s=60)

    assert statuses(batch_id) == {"succeeded": 4}
    assert sum(r.cut_off for r in reports) == 1
    (job,) = jobs_of(batch_id)
    assert job.cancel_reason == "cutoff"
    at_provider = [j for j in provider_jobs_at_simulator(simulator, model)]
    assert any(j.id == job.provider_job_id and j.status == "cancelled" for j in at_provider)
    assert ledger_by_route(batch_id) == {("online", False): 4}
    assert late_items(batch_id) == 0


def test_a_remainder_under_bedrocks_minimum_records_runs_online(offloading, simulator, workers):
    """Bedrock takes jobs of its minimum records or more (100; 3 here, and the simulator
    refuses fewer): of 4 items in jobs of 3, the one left over runs online."""
    env = offloading(max_requests=3, min_requests=3)
    sim_config(simulator.base_url, batch_min_records=3)
    tenant = "offload-bedrock-minimum"
    make_tenant(tenant)
    batch_id = submit(tenant, 4, BEDROCK)
    workers(env=env)
    ticks_until(lambda: finished(batch_id), timeout_s=60)

    assert statuses(batch_id) == {"succeeded": 4}
    assert ledger_by_route(batch_id) == {("offline", False): 3, ("online", False): 1}
    (job,) = jobs_of(batch_id)
    assert (job.status, job.item_count) == ("ended", 3)
    assert_ledger_is_results_plus_waste()


@pytest.mark.parametrize("model", MODELS)
def test_cancel_mid_job_cancels_it_at_the_provider_and_keeps_its_finished_rows(
    offloading, simulator, model
):
    offloading()
    # Rows finish one every 6 s: cancelled after 7 s (and before 30 s, however loaded
    # the machine), at least one is done and at least one is not.
    sim_config(simulator.base_url, batch_turnaround_s=30.0)
    tenant = f"offload-cancel-{model}"
    make_tenant(tenant)
    batch_id = submit(tenant, 5, model)
    report = tick(get_registry(), get_settings())
    assert report.created == 1
    hold(7, "a row of the job done at the provider, not all")
    client.cancel_batch(batch_id, tenant=tenant)
    ticks_until(lambda: finished(batch_id))

    counts = statuses(batch_id)
    assert counts.get("succeeded", 0) >= 1 and counts.get("cancelled", 0) >= 1
    assert counts.get("succeeded", 0) + counts.get("cancelled", 0) == 5
    assert client.get_batch(batch_id, tenant=tenant)["status"] == "cancelled"
    (job,) = jobs_of(batch_id)
    assert job.cancel_reason == "batch_cancelled" and job.status == "ended"
    assert ledger_by_route(batch_id) == {("offline", False): counts["succeeded"]}
    assert_ledger_is_results_plus_waste()


def test_the_enqueued_token_limit_is_respected(offloading, simulator):
    # Three items per job; the provider (and our registry) allow one job's tokens at a time.
    env = offloading(max_requests=3)
    tenant = "offload-enqueued"
    make_tenant(tenant)
    batch_id = submit(tenant, 9, "sim-small")
    with db.session_scope() as session:
        per_item = session.scalar(
            select(func.max(Item.prompt_tokens_est + Item.max_tokens)).where(
                Item.batch_id == batch_id
            )
        )
    limit = int(per_item * 3.5)  # room for one job of three at a time
    sim_config(simulator.base_url, batch_enqueued_tokens_limit=limit, batch_turnaround_s=0.5)
    offloading(max_requests=3, extra=f"enqueued_tokens = {limit}")
    del env
    reports = ticks_until(lambda: finished(batch_id))

    assert statuses(batch_id) == {"succeeded": 9}
    jobs = jobs_of(batch_id)
    assert [j.status for j in jobs] == ["ended"] * 3
    assert max(r.created for r in reports) == 1  # never two jobs in one tick
    assert all(j.enqueued_tokens <= limit for j in jobs)
    # The provider refused none: never more than the limit enqueued at once.
    at_provider = provider_jobs_at_simulator(simulator, "sim-small")
    ours = [j for j in at_provider if j.id in {job.provider_job_id for job in jobs}]
    assert len(ours) == 3 and all(j.status == "completed" for j in ours)
    spans = sorted((j.created_at, j.completed_at) for j in ours)
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:], strict=False))


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_a_dispatcher_killed_while_the_provider_creates_a_job_leaves_one_job(
    offloading, simulator, workers, model
):
    env = offloading()
    env = {**env, "BATCHGEN_OFFLOAD_INTERVAL_S": "0.3"}
    sim_config(simulator.base_url, batch_create_delay_s=3.0, batch_turnaround_s=1.0)
    tenant = f"offload-crash-{model}"
    make_tenant(tenant)
    before = {j.id for j in provider_jobs_at_simulator(simulator, model)}
    batch_id = submit(tenant, 6, model)
    dispatcher = workers(queues=["batchgen.control"], env=env, beat=True, name="dispatcher-a")
    wait_until(
        lambda: [j for j in provider_jobs_at_simulator(simulator, model) if j.id not in before],
        30,
        "the provider to get the job",
        poll_s=0.05,
    )
    dispatcher.kill()  # the provider has the job; its answer is still on the way
    (recorded,) = jobs_of(batch_id)
    assert recorded.status == "creating" and recorded.provider_job_id is None
    sim_config(simulator.base_url, batch_create_delay_s=0.0)
    workers(env=env, beat=True, name="dispatcher-b")
    wait_batches([batch_id], timeout_s=90)

    new = [j for j in provider_jobs_at_simulator(simulator, model) if j.id not in before]
    assert len(new) == 1  # exactly one job at the provider
    (job,) = jobs_of(batch_id)
    assert job.provider_job_id == new[0].id
    assert statuses(batch_id) == {"succeeded": 6}
    with db.session_scope() as session:
        results = session.scalar(
            select(func.count()).select_from(Result).where(Result.batch_id == batch_id)
        )
    assert results == 6
    assert ledger_by_route(batch_id) == {("offline", False): 6}
    assert_ledger_is_results_plus_waste()


def test_status_metrics_and_usage_show_routes_jobs_and_savings(offloading, simulator):
    from batchgen.limits.backend import get_redis
    from batchgen.monitoring.metrics import StateCollector, render
    from batchgen.monitoring.snapshot import snapshot

    offloading()
    sim_config(simulator.base_url, batch_turnaround_s=1.5)
    tenant = "offload-visible"
    make_tenant(tenant)
    batch_id = submit(tenant, 4, "sim-small")
    tick(get_registry(), get_settings())
    with db.session_scope() as session:
        during = snapshot(session, get_redis(), get_registry(), get_settings())
    (small,) = [m for m in during["models"] if m["model"] == "sim-small"]
    assert small["offloaded"] == 4 and small["pending"] == 0
    assert [(j["model"], j["open"], j["items"]) for j in during["provider_jobs"]] == [
        ("sim-small", 1, 4)
    ]
    assert during["provider_jobs"][0]["oldest_age_s"] >= 0
    collector = StateCollector(db.session_scope, get_redis(), get_registry(), get_settings())
    text = render(collector).decode()
    assert 'batchgen_provider_jobs_open{model="sim-small"} 1.0' in text
    assert 'batchgen_items{model="sim-small",status="offloaded"} 4.0' in text
    ticks_until(lambda: finished(batch_id))

    with db.session_scope() as session:
        after = snapshot(session, get_redis(), get_registry(), get_settings())
        online_cost, cost = session.execute(
            select(func.sum(UsageLedger.online_cost_usd), func.sum(UsageLedger.cost_usd)).where(
                UsageLedger.batch_id == batch_id
            )
        ).one()
    assert after["provider_jobs"] == []
    assert after["routes_today"]["offline"]["requests"] == 4
    assert after["routes_today"]["online"]["requests"] == 0
    assert Decimal(after["saved_today_usd"]) == online_cost - cost > 0
    (row,) = client.usage(tenant=tenant)
    assert (row["requests"], row["offline_requests"]) == (4, 4)
    assert Decimal(row["saved_usd"]) == online_cost - cost
    assert Decimal(row["offline_cost_usd"]) == Decimal(row["cost_usd"]) == cost
    text = render(collector).decode()
    assert 'batchgen_route_requests_total{route="offline"} 4.0' in text
    assert f"batchgen_offline_saved_usd_total {float(online_cost - cost)}" in text


def test_a_nightly_job_offloads_by_default(offloading, tmp_path):
    import datetime as dt

    from batchgen.nightly.jobs import Job
    from batchgen.nightly.runs import submit_job

    offloading()
    make_tenant("shop")
    catalog = tmp_path / "catalog.csv"
    catalog.write_text("id,name\n" + "".join(f"p{i},Product {i}\n" for i in range(5)))

    def run(**kw: Any) -> str:
        name = f"descriptions-{len(kw)}"
        job = Job(
            name=name,
            tenant="shop",
            model="sim-small",
            catalog=catalog,
            output=tmp_path / f"{name}.jsonl",
            **kw,
        )
        assert job.offload.value == kw.get("offload", "auto")
        (batch_id,), _ = submit_job(job, dt.date(2026, 12, 1))
        return batch_id

    assert statuses(run()) == {"offloaded": 5}  # bulk, a 24 h window: offloaded
    assert statuses(run(offload="never")) == {"pending": 5}


def test_the_http_api_takes_offload_and_offloaded_work_is_not_the_online_backlog(offloading):
    from batchgen.api import create_app
    from tests.helpers import jsonl

    offloading()
    # A backlog bound of ~200 tokens for sim-small: six items are over it online.
    os.environ["BATCHGEN_MAX_BACKLOG_MIN"] = "0.0001"
    get_settings.cache_clear()
    key = make_tenant("offload-http")
    api = create_app().test_client()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/jsonl"}
    body = jsonl([chat_line(f"h-{i}") for i in range(6)])

    online = api.post("/v1/batches?priority=bulk&offload=never", data=body, headers=headers)
    assert online.status_code == 413, online.get_json()
    offline = api.post("/v1/batches?priority=bulk", data=body, headers=headers)
    assert offline.status_code == 200, offline.get_json()
    described = offline.get_json()
    assert described["offload"] == "auto" and described["request_counts"]["offloaded"] == 6
    bad = api.post("/v1/batches?priority=bulk&offload=half", data=body, headers=headers)
    assert bad.status_code == 400 and "offload must be one of" in bad.get_json()["error"]["message"]
    anthropic_body = {
        "requests": [
            {
                "custom_id": "m-1",
                "params": {
                    "model": "sim-claude",
                    "max_tokens": 20,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            }
        ],
        "priority": "bulk",
        "offload": "never",
    }
    created = api.post(
        "/v1/messages/batches", json=anthropic_body, headers={"Authorization": f"Bearer {key}"}
    )
    assert created.status_code == 200, created.get_json()
    assert statuses(client.get_batch(created.get_json()["id"], tenant="offload-http")["id"]) == {
        "pending": 1
    }


def test_offloaded_items_count_toward_the_tenants_open_items(offloading):
    from batchgen.errors import OverQuota

    offloading()
    make_tenant("offload-quota", max_pending_items=4)
    submit("offload-quota", 3, "sim-small")
    with pytest.raises(OverQuota, match="would have 6 open items"):
        submit("offload-quota", 3, "sim-small")


def test_items_waiting_on_a_model_that_stops_offloading_go_online(offloading):
    offloading()
    make_tenant("offload-off")
    batch_id = submit("offload-off", 3, "sim-small")
    assert statuses(batch_id) == {"offloaded": 3}
    os.environ.pop("BATCHGEN_MODELS_FILE")  # the shipped registry: nothing offloads
    get_settings.cache_clear()
    load_registry.cache_clear()
    report = tick(get_registry(), get_settings())

    assert report.returned == 3 and report.created == 0
    assert statuses(batch_id) == {"pending": 3}
    with db.session_scope() as session:
        codes = set(session.scalars(select(Item.error_code).where(Item.batch_id == batch_id)))
    assert codes == {"offload_turned_off"}
    assert jobs_of(batch_id) == []


LONG_SYSTEM = " ".join(f"Rule {i}: write plainly about the product." for i in range(300))


def test_an_anthropic_job_reads_the_prompt_cache_at_the_batch_price(offloading, simulator):
    """Rows sharing a long system prompt go to Anthropic's Batch API with a breakpoint;
    the provider's cache reads and writes reach the ledger, priced at the batch tier (the
    two discounts stack), for less than the same rows without the cache."""
    from batchgen.domain.billing.cost import TokenUsage, price_usage
    from batchgen.registry import Tier

    offloading()
    tenant = "offload-cached"
    make_tenant(tenant)
    lines = [
        chat_line(f"{tenant}-{i}", model="sim-claude")
        | {
            "body": {
                "model": "sim-claude",
                "max_tokens": 30,
                "messages": [
                    {"role": "system", "content": LONG_SYSTEM},
                    {"role": "user", "content": f"Describe product {i}."},
                ],
            }
        }
        for i in range(4)
    ]
    batch_id = submit(tenant, 4, "sim-claude", lines=lines)
    assert statuses(batch_id) == {"offloaded": 4}
    ticks_until(lambda: finished(batch_id))
    assert ledger_by_route(batch_id) == {("offline", False): 4}
    spec = get_registry()["sim-claude"]
    with db.session_scope() as session:
        rows = session.execute(
            select(
                UsageLedger.prompt_tokens,
                UsageLedger.completion_tokens,
                UsageLedger.cached_tokens,
                UsageLedger.cache_write_tokens,
                UsageLedger.cost_usd,
            ).where(UsageLedger.batch_id == batch_id)
        ).all()
    assert sum(r.cache_write_tokens for r in rows) >= 1024  # the first row wrote it
    assert sum(1 for r in rows if r.cached_tokens >= 1024) == 3  # the others read it
    for prompt, completion, cached, written, cost in rows:
        usage = TokenUsage(prompt, completion, cached, written)
        assert cost == price_usage(usage, spec, Tier.BATCH)
    uncached = sum(
        price_usage(TokenUsage(r.prompt_tokens, r.completion_tokens), spec, Tier.BATCH)
        for r in rows
    )
    assert sum(r.cost_usd for r in rows) < Decimal("0.5") * uncached
    assert_ledger_is_results_plus_waste()


FLEX_TABLE = """
[models."sim-small".flex]
latency_s = 1
timeout_s = 10
fallback_s = 5
"""


def test_items_back_from_an_expired_job_run_flex_where_the_model_offers_it(
    offloading, simulator, workers
):
    """A model with both the Batch API and flex: its job expires, and its items, back
    online with an hour left, run flex at the batch prices, not standard at twice them."""
    env = offloading()
    models = Path(env["BATCHGEN_MODELS_FILE"])
    models.write_text(models.read_text() + FLEX_TABLE)
    get_settings.cache_clear()
    load_registry.cache_clear()
    assert get_registry()["sim-small"].flex is not None
    sim_config(simulator.base_url, batch_expire=True, batch_turnaround_s=0.5)
    tenant = "offload-expired-flex"
    make_tenant(tenant)
    batch_id = submit(tenant, 5, "sim-small")
    assert statuses(batch_id) == {"offloaded": 5}
    workers(env=env)
    ticks_until(lambda: finished(batch_id), timeout_s=60)

    assert statuses(batch_id) == {"succeeded": 5}
    with db.session_scope() as session:
        tiers = session.execute(
            select(UsageLedger.route, UsageLedger.tier, func.count())
            .where(UsageLedger.batch_id == batch_id, UsageLedger.waste_reason.is_(None))
            .group_by(UsageLedger.route, UsageLedger.tier)
        ).all()
    assert [tuple(t) for t in tiers] == [("online", "flex", 5)]
    assert late_items(batch_id) == 0
    assert_ledger_is_results_plus_waste()


def test_a_job_reserves_its_rows_and_one_that_would_overspend_is_not_created(offloading, simulator):
    from batchgen import tenant_admin
    from batchgen.domain.billing import budget_maths as rules
    from batchgen.limits.backend import get_redis
    from batchgen.limits.money_budgets import MoneyBudgets
    from batchgen.limits.redis_keys import money as money_key
    from batchgen.store import budget_rows as money_store
    from batchgen.store import tenants

    offloading()
    for name, limit in (("money-rich", "10"), ("money-poor", "0.000001")):
        make_tenant(name)
        tenant_admin.set_budget(name, limit_usd=limit, period="total")
    rich, poor = submit("money-rich", 3, "sim-small"), submit("money-poor", 3, "sim-small")
    ticks_until(lambda: finished(rich) and "offloaded" not in statuses(poor))
    assert statuses(rich) == {"succeeded": 3}
    assert statuses(poor) == {"pending": 3}  # back online, where its budget holds them
    assert [j.status for j in jobs_of(poor)] == ["failed"]  # never created at the provider
    with db.session_scope() as session:
        tenant_id = tenants.find(session, "money-rich").id
        (budget,) = money_store.budgets_of(session, [tenant_id])[tenant_id]
        spent = session.scalar(
            select(func.sum(UsageLedger.cost_usd)).where(UsageLedger.batch_id == rich)
        )
    level = MoneyBudgets(get_redis()).level(money_key(tenant_id, budget.id, "total"))
    assert level is not None and level.reserved_micros == 0  # each row settled as recorded
    assert 0 <= level.used_micros - rules.to_micros(spent) < 3  # each row rounded up
