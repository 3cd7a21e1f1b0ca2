"""Offloaded jobs cancelled mid-way and a dispatcher killed while the provider creates a
job (app/worker/offload_jobs.py): nothing is created twice, finished rows are kept."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from batchgen import python_api as client
from batchgen.config import get_settings
from batchgen.registry import get_registry
from batchgen.store import db
from batchgen.store.schema import Result
from batchgen.worker.offload_jobs import tick
from tests.helpers import assert_ledger_is_results_plus_waste, make_tenant, sim_config, wait_batches
from tests.integration.offload.support import (
    MODELS,
    finished,
    jobs_of,
    ledger_by_route,
    provider_jobs_at_simulator,
    statuses,
    submit,
    ticks_until,
)
from tests.waiting import hold, wait_until


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
