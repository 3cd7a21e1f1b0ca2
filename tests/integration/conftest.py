"""Integration fixtures: the provider simulator and real Celery worker processes.

Every test collected under this folder carries the ``integration`` marker, and the
tests listed in :data:`SLOW` the ``slow`` marker too (``pytestmark`` in a conftest.py
marks nothing, so :func:`pytest_collection_modifyitems` does it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from batchgen.worker.procs import WorkerProcess, start_worker, stop_all
from tests.waiting import poll_until

HERE = Path(__file__).resolve().parent
CONTROL_QUEUE = "batchgen.control"
NOTIFY_QUEUE = "batchgen.notify"

# Tests that take more than a few seconds: 7 s or more (setup, call and teardown) in a
# run of `pytest --durations=0 tests/integration` on a 2-core machine. A module's file
# name marks all its tests; "file::test" marks one test (every parameter of it).
SLOW = frozenset(
    {
        # Fault suites whose every test holds a fault or restarts a process.
        "test_faults_api.py",
        "test_faults_postgres.py",
        "test_faults_redis.py",
        "test_faults_redis_ha.py",
        "test_postgres_failover.py",
        "test_faults_workers.py",
        # Three hosts as network namespaces, six worker processes.
        "test_multihost.py",
        # A fresh venv and a host project; a second pytest run.
        "test_host_project.py",
        "test_embedded_isolation.py",
        # A pytest session of its own per test, failed or interrupted.
        "test_hygiene.py",
        "test_beat.py::test_dispatcher_kill_9_takes_its_beat_along",
        "test_beat.py::test_two_dispatchers_one_schedule",
        "test_dashboard.py",
        "test_dashboard_pages.py::test_batch_page_bars_and_charts",
        "test_call_shares.py::test_a_flood_of_calls_leaves_another_tenant_its_share",
        "test_call_reserve.py::test_a_call_behind_a_full_backlog_passes_the_gate_at_its_first_try",
        "test_deadlines_cancel.py::test_cancel_holds_across_a_worker_restart",
        "test_faults.py::test_flushed_redis_loses_no_item",
        "test_faults.py::test_sigkill_worker_mid_call_loses_nothing",
        "test_gate_rebuild.py",
        "test_flower.py::test_flower_shows_tasks_with_ids_only_behind_basic_auth",
        "test_notifications.py::test_a_dripping_receiver_is_cut_at_the_deadline_and_stalls_nobody",
        "test_notifications.py::test_a_host_celery_task_on_its_own_broker_is_called_once",
        "test_notifications.py::"
        "test_a_webhook_follows_standard_webhooks_and_is_delivered_once_past_two_failures",
        "test_flower.py::test_batchgen_flower_puts_metrics_behind_its_basic_auth",
        "test_nightly.py::test_beat_fires_twice_one_batch_500_descriptions_and_report",
        "test_nightly.py::test_incremental_runs_call_only_changed_and_failed_products",
        "test_offload.py::test_a_dispatcher_killed_while_the_provider_creates_a_job_leaves_one_job",
        "test_offload.py::test_a_job_past_its_cutoff_is_cancelled_there_and_run_online",
        "test_offload.py::test_a_partly_failed_job_runs_its_errored_rows_online",
        "test_offload.py::test_an_expired_job_falls_back_online_within_the_deadline",
        "test_offload.py::test_near_deadlines_run_online_and_the_rest_offline",
        "test_observability.py::test_metrics_match_the_database_across_two_workers",
        # A worker exporting OTLP to a receiver in the test; a synchronous call's trace.
        "test_tracing.py",
        "test_packs.py::test_a_pack_that_meets_the_budget_waits_with_its_rest",
        "test_packs.py::test_a_worker_killed_mid_pack_loses_nothing",
        "test_pgbouncer.py::test_a_batch_runs_through_pgbouncer_in_transaction_mode",
        "test_pgbouncer.py::test_worker_and_api_processes_keep_to_their_connection_budget",
        "test_pipeline.py::test_three_tenants_two_models_200_items",
        "test_pools.py::test_calls_fail_over_to_azure_within_the_deadline_using_no_attempt",
        "test_unsendable.py::test_items_whose_requests_cannot_leave_end_failed_with_the_reason",
        "test_estimates.py",
        "test_first_call.py::test_an_unmigrated_database_says_batchgen_db_upgrade",
        "test_first_call.py::test_creating_the_app_loads_the_provider_sdks",
        "test_first_call.py::test_a_sync_call_with_redis_down_is_a_503",
        # The README's demo, quick start and production processes, as real processes.
        "test_readme.py::test_the_two_commands",
        "test_readme.py::test_quick_start",
        "test_readme.py::test_production_processes",
        "test_rabbitmq.py::test_batch_runs_on_quorum_queues_with_countdown_retries",
        "test_rabbitmq.py::test_broker_connections_closed_then_unreachable_mid_run",
        "test_rabbitmq.py::test_sigkill_worker_mid_call_redelivers_and_loses_nothing",
        "test_rate_limits.py::test_budget_starvation_fails_nothing_and_work_resumes",
        "test_rate_limits.py::test_four_workers_stay_within_the_provider_limits",
        "test_routes.py::test_flex_calls_cost_half_and_a_busy_tier_falls_back_to_standard_in_time",
        "test_totals.py::test_the_scans_use_their_indexes_on_a_large_history",
        "test_sdk_dropin.py::test_openai_files_and_batches_flow",
        "test_sdk_dropin.py::test_openai_batch_cancel_and_file_errors",
        "test_sdk_dropin.py::test_anthropic_message_batches_flow",
        "test_sdk_dropin.py::test_anthropic_message_batch_errors",
        "test_sdk_dropin.py::test_chat_completions_through_the_scheduler",
        "test_sdk_dropin.py::test_messages_create_through_the_scheduler",
        "test_sdk_dropin.py::test_a_call_that_cannot_start_in_time_is_refused_at_once",
        "test_sdk_dropin.py::test_a_caller_that_goes_away_cancels_its_call",
        "test_sdk_dropin.py::test_a_call_past_its_deadline_is_a_504",
        "test_sdk_dropin.py::test_a_tenant_over_its_quota_is_the_sdks_rate_limit_error",
        "test_sdk_dropin.py::test_a_call_is_answered_when_the_listening_connection_is_lost",
        "test_worker_faults.py::test_killed_worker_sent_calls_are_ledgered",
        "test_worker_faults.py::test_paid_answer_survives_database_outage",
    }
)


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect anything
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of this folder ``integration`` (and the :data:`SLOW` ones ``slow``).

    A conftest's hook sees every collected item, so it picks this folder's by path."""
    for item in items:
        path = Path(item.path).resolve()
        if not path.is_relative_to(HERE):
            continue
        item.add_marker(pytest.mark.integration)
        test = f"{path.name}::{getattr(item, 'originalname', item.name)}"
        if path.name in SLOW or test in SLOW:
            item.add_marker(pytest.mark.slow)
    unknown = {entry for entry in SLOW if not (HERE / entry.partition("::")[0]).is_file()}
    assert not unknown, f"SLOW names files that are not in {HERE}: {sorted(unknown)}"


@pytest.fixture(scope="module")
def simulator() -> Iterator[object]:
    """The provider simulator over real HTTP (latency 50 ms + 0.5 ms per output token)."""
    from batchgen.config import get_settings
    from batchgen.registry import load_registry
    from batchgen.simulator import SimulatorConfig, SimulatorThread

    config = SimulatorConfig(latency_base_ms=50, latency_per_token_ms=0.5, seed=1)
    with SimulatorThread(config) as sim:
        os.environ["BATCHGEN_SIMULATOR_URL"] = sim.base_url
        get_settings.cache_clear()
        load_registry.cache_clear()  # its base URLs expand BATCHGEN_SIMULATOR_URL
        yield sim
        os.environ.pop("BATCHGEN_SIMULATOR_URL", None)
        load_registry.cache_clear()


@contextlib.contextmanager
def worker_processes(log_dir: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start worker processes on demand (logs in ``log_dir``); all are stopped (or
    killed) at the end of the block."""
    started: list[WorkerProcess] = []

    def start(
        queues: list[str] | None = None,
        *,
        concurrency: int = 8,
        beat: bool = True,
        env: dict[str, str] | None = None,
        name: str | None = None,
        wait: bool = True,
        gossip: bool = False,
    ) -> WorkerProcess:
        from batchgen.registry import get_registry

        qs = queues or [*get_registry().queues, CONTROL_QUEUE, NOTIFY_QUEUE]
        w = start_worker(
            qs,
            log_dir=log_dir,
            concurrency=concurrency,
            beat=beat,
            env=env,
            name=name,
            gossip=gossip,
        )
        started.append(w)
        return w.wait_ready() if wait else w

    try:
        yield start
    finally:
        stop_all(started)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """:func:`worker_processes` for one test."""
    with worker_processes(tmp_path / "logs") as start:
        yield start


@pytest.fixture(scope="module")
def module_workers(
    services: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., WorkerProcess]]:
    """:func:`worker_processes` for a module's tests. They outlive each test's
    ``clean_db``, which keeps the broker's bindings for them."""
    with worker_processes(tmp_path_factory.mktemp("workers") / "logs") as start:
        yield start


@pytest.fixture
def restore_env() -> Iterator[None]:
    """Put ``os.environ`` back as it was after the test and forget the cached settings
    (for tests whose host-app config exports ``BATCHGEN_*`` variables)."""
    from batchgen.config import get_settings

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    get_settings.cache_clear()


@contextlib.contextmanager
def api_servers(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start ``batchgen api`` as a real server process on a free port (environment
    overrides per call); returns its base URL. Every one started is stopped at the end."""
    import subprocess
    import sys

    import httpx

    from batchgen.embedded import free_port

    started: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str] | None = None, timeout_s: float = 60.0) -> str:
        port = free_port()
        log_dir = tmp_path / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "batchgen.cli", "api"]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        with open(log_dir / f"api-{port}.log", "wb") as log:
            process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                # One gunicorn worker unless a test asks for more: half the start-up
                # (each worker loads the SDKs and encodings) on a busy test machine.
                env={**os.environ, "BATCHGEN_API_WORKERS": "1", **(env or {})},
                start_new_session=True,
            )
        started.append(process)
        base_url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            if process.poll() is not None:
                log_text = (log_dir / f"api-{port}.log").read_text()
                raise RuntimeError(f"API server exited: {log_text}")
            try:
                return httpx.get(f"{base_url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        if not poll_until(healthy, timeout_s):
            raise RuntimeError(f"API server not up after {timeout_s}s")
        return base_url

    try:
        yield start
    finally:
        _stop_servers(started)


def _stop_servers(started: list[Any]) -> None:
    import signal
    import subprocess

    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@pytest.fixture
def api_server(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """:func:`api_servers` for one test."""
    with api_servers(tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def module_api_server(
    services: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., str]]:
    """:func:`api_servers` for a module's tests (the servers outlive each test's
    ``clean_db``: they keep no state of their own)."""
    with api_servers(tmp_path_factory.mktemp("api")) as start:
        yield start
