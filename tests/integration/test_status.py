"""``GET /v1/status`` names the workers consuming each queue from what the live workers
announce in Redis (app/worker/presence.py), without a Celery broadcast: a stopped
worker is gone at once, a killed one once its announcement expires."""

from __future__ import annotations

from typing import Any

import pytest

from batchgen.api import create_app
from batchgen.registry import get_registry
from batchgen.worker.publish import celery_app
from tests.helpers import make_tenant
from tests.invariants import wait_until

# Renewals this often: a killed worker's announcement expires three of them after.
FAST_RENEWALS = {"BATCHGEN_HEARTBEAT_INTERVAL_S": "0.2"}


@pytest.fixture
def no_broadcast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any remote control of the workers (inspect, ping, ...) fails the test."""

    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the status view asked the workers by a broadcast")

    monkeypatch.setattr(celery_app.control, "inspect", refused)
    monkeypatch.setattr(celery_app.control, "broadcast", refused)


def _consumers(api: Any, admin: str) -> dict[str, list[str]]:
    found = api.get("/v1/status", headers={"Authorization": f"Bearer {admin}"})
    assert found.status_code == 200, found.json
    return {row["queue"]: row["workers"] for row in found.json["queues"]}


def _named(workers: list[str], name: str) -> bool:
    return any(w.startswith(f"{name}@") for w in workers)


def test_status_lists_the_live_workers_without_asking_them(clean_db, workers, no_broadcast):
    admin = make_tenant("ops", is_admin=True)
    api = create_app().test_client()
    small = get_registry()["sim-small"].queue
    large = get_registry()["sim-large"].queue
    assert small != large
    stopped = workers([small], beat=False, env=FAST_RENEWALS)
    killed = workers([large], beat=False, env=FAST_RENEWALS)

    found = wait_until(
        lambda: (
            (c := _consumers(api, admin))
            and _named(c[small], stopped.name)
            and _named(c[large], killed.name)
            and c
        ),
        timeout_s=30,
        what="both workers listed",
    )
    assert not _named(found[small], killed.name)
    assert not _named(found[large], stopped.name)

    stopped.stop()  # a warm shutdown withdraws its announcement
    assert not _named(_consumers(api, admin)[small], stopped.name)
    killed.kill()  # no shutdown: listed until its announcement expires
    wait_until(
        lambda: not _named(_consumers(api, admin)[large], killed.name),
        timeout_s=30,
        what="the killed worker's announcement to expire",
    )
