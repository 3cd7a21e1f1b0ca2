"""Offloaded work that comes back online (app/worker/offload_jobs.py): jobs that expire,
fail in part, pass their cutoff, or leave a remainder under the provider's minimum."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select

from batchgen.config import get_settings
from batchgen.registry import get_registry, load_registry
from batchgen.store import db
from batchgen.store.schema import Item, UsageLedger
from tests.helpers import (
    assert_daily_usage_matches_ledger,
    assert_ledger_is_results_plus_waste,
    make_tenant,
    sim_config,
)
from tests.integration.offload.support import (
    BEDROCK,
    MODELS,
    finished,
    jobs_of,
    late_items,
    ledger_by_route,
    provider_jobs_at_simulator,
    statuses,
    submit,
    ticks_until,
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
