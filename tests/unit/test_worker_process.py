"""Which processes skip the interpreter's teardown once their worker has shut down."""

from __future__ import annotations

import pytest

from batchgen.worker.lifecycle import is_worker_command


@pytest.mark.parametrize(
    "argv",
    [
        ["/venv/bin/celery", "-A", "batchgen.tasks", "worker", "-Q", "llm.sim"],
        ["/venv/lib/python3.11/site-packages/celery/__main__.py", "-A", "x", "worker"],
        ["/venv/bin/batchgen", "worker", "--group", "sim"],
        ["/venv/bin/batchgen", "dispatcher"],
        ["/src/app/cli/__main__.py", "worker"],
    ],
)
def test_a_worker_command_line(argv: list[str]) -> None:
    assert is_worker_command(argv)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["/venv/bin/pytest", "-k", "worker"],  # a program that may run a worker inside it
        ["/venv/bin/celery", "-A", "batchgen.tasks", "beat"],
        ["/venv/bin/batchgen", "api"],
        ["/srv/manage.py", "runserver", "worker"],
        ["-c"],
    ],
)
def test_not_a_worker_command_line(argv: list[str]) -> None:
    assert not is_worker_command(argv)
