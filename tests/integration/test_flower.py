"""Flower as ``batchgen flower`` starts it, against the test broker: basic auth required,
task arguments are ids only, and the task list shows each task's batch and tenant."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest

from batchgen import python_api as client
from batchgen.embedded import free_port
from tests import http_client
from tests.helpers import chat_line, make_tenant, sim_config, wait_batches
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

SECRET = "Unreleased kettle with quantum boil"


def _healthy(url: str) -> bool:
    try:
        return http_client.get(f"{url}/healthcheck", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


def _items_of(tasks) -> set[int]:
    """The items the generate tasks among ``tasks`` (Flower's task records) carry: each
    task's own (its args) and those of its pack (``more``: ``[[id, {...}], ...]``)."""
    ids: set[int] = set()
    for t in tasks:
        if t["name"] == "batchgen.generate":
            ids.add(int(t["args"].strip("[]()")))
            more = t["kwargs"].partition("'more': ")[2]
            ids.update(int(i) for i in re.findall(r"\[(\d+), \{", more))
    return ids


@pytest.fixture
def flower(services, tmp_path):
    port = free_port()
    log = open(tmp_path / "flower.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchgen.cli",
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
            "--basic-auth=ops:s3cret",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ},
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: _healthy(url), 30, lambda: f"flower up: {(tmp_path / 'flower.log').read_text()}"
        )
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.mark.slow
def test_flower_shows_tasks_with_ids_only_behind_basic_auth(clean_db, simulator, workers, flower):
    make_tenant("watched")
    workers(concurrency=4)
    batch = client.submit_batch(
        [chat_line(f"f{i}", text=f"{SECRET} #{i}") for i in range(6)], tenant="watched"
    )
    wait_batches([batch["id"]])

    assert http_client.get(f"{flower}/api/tasks").status_code == 401
    assert http_client.get(f"{flower}/api/tasks", auth=("ops", "wrong")).status_code == 401

    def tasks_seen() -> tuple[dict, httpx.Response] | None:  # events arrive asynchronously
        res = http_client.get(f"{flower}/api/tasks", auth=("ops", "s3cret"))
        assert res.status_code == 200
        tasks = res.json()
        return (tasks, res) if len(_items_of(tasks.values())) >= 6 else None

    tasks, res = wait_until(tasks_seen, 10, "the six items' generate tasks in flower", 0.2)
    generate = [t for t in tasks.values() if t["name"] == "batchgen.generate"]
    assert len(_items_of(generate)) == 6
    assert SECRET not in res.text
    for t in generate:
        assert t["args"].strip("[]()").isdigit()  # the item id, nothing else
        assert "model" in t["kwargs"]
        # An operator finds a batch's or a tenant's tasks: ids and names, no text.
        assert batch["id"] in t["kwargs"] and "'tenant_name': 'watched'" in t["kwargs"]
    # The task list shows the kwargs column (Flower's default list leaves it out): an
    # operator sees each task's batch and tenant there, not only on its detail page.
    page = http_client.get(f"{flower}/tasks", auth=("ops", "s3cret")).text
    columns = re.findall(r'<th data-column="(\w+)"', page)
    assert columns[:4] == ["name", "uuid", "state", "kwargs"], columns

    def workers_seen() -> dict:  # each refresh asks the workers, and waits 1 s for answers
        return http_client.get(
            f"{flower}/api/workers", auth=("ops", "s3cret"), params={"refresh": "true"}
        ).json()

    wait_until(workers_seen, 30, "the workers to answer flower's inspect")
    # The ticks are no tasks of the list: dispatch and sweep send no task events.
    assert not [t for t in tasks.values() if t["name"] in ("batchgen.dispatch", "batchgen.sweep")]

    # An item that fails for good ends its task FAILURE, with its code and no text.
    sim_config(simulator.base_url, fault_rate=1.0, fault_kinds=["status:400"])
    try:
        doomed = client.submit_batch(
            [chat_line(f"x{i}", text=f"{SECRET} #{i}") for i in range(2)], tenant="watched"
        )
        wait_batches([doomed["id"]])
    finally:
        sim_config(simulator.base_url, fault_rate=0.0)

    def failures() -> tuple[list, httpx.Response] | None:
        res = http_client.get(
            f"{flower}/api/tasks", auth=("ops", "s3cret"), params={"state": "FAILURE"}
        )
        failed = [t for t in res.json().values() if t["name"] == "batchgen.generate"]
        return (failed, res) if len(_items_of(failed)) >= 2 else None

    failed, res = wait_until(failures, 10, "the two items' failed tasks in flower", 0.2)
    assert len(_items_of(failed)) == 2 and SECRET not in res.text
    # Each item that failed for good is named in its task's exception, with its code.
    said = " ".join(t["exception"] or "" for t in failed)
    assert sorted(re.findall(r"item (\d+) failed: permanent", said)) == sorted(
        str(i) for i in _items_of(failed)
    ), failed


@pytest.mark.slow
def test_batchgen_flower_puts_metrics_behind_its_basic_auth(services, tmp_path):
    """Issue 27 item 9: ``batchgen flower`` serves /metrics only with the credentials;
    /healthcheck stays open for probes and says nothing but OK."""
    port = free_port()
    log = open(tmp_path / "batchgen-flower.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchgen.cli", "flower", f"--port={port}"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={
            **os.environ,
            "BATCHGEN_FLOWER_USER": "ops",
            "BATCHGEN_FLOWER_PASSWORD": "s3cret",
        },
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert proc.poll() is None, (tmp_path / "batchgen-flower.log").read_text()
            return _healthy(url)

        wait_until(up, 30, lambda: (tmp_path / "batchgen-flower.log").read_text())
        health = http_client.get(f"{url}/healthcheck", timeout=5)
        assert health.text == "OK"  # a probe's answer, nothing about tasks or workers
        assert http_client.get(f"{url}/metrics").status_code == 401
        assert http_client.get(f"{url}/metrics", auth=("ops", "wrong")).status_code == 401
        assert http_client.get(f"{url}/metrics", auth=("nobody", "s3cret")).status_code == 401
        metrics = http_client.get(f"{url}/metrics", auth=("ops", "s3cret"))
        assert metrics.status_code == 200
        assert "flower_events_total" in metrics.text or "# HELP" in metrics.text
        assert http_client.get(f"{url}/api/workers").status_code == 401  # as before
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
