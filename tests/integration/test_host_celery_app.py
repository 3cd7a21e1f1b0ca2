"""batchgen's Celery app is never a host's current or default app (issue #33, case 1).

A host that creates its own Celery app (Celery's "First steps with Django": the app made
in ``proj/celery.py``, its ``@shared_task`` tasks bound through ``current_app``) and
then imports batchgen, in any order, keeps its own app: otherwise its ``.delay()``
publishes to batchgen's broker and its tasks are dropped there as unregistered. Each
case runs in a fresh interpreter, since Celery's current and default apps are process
state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Runs in a fresh interpreter. ORDER: "host-first" creates the host's app, then imports
# every batchgen module; "batchgen-first" the other way round. Prints what it found.
PROBE = r"""
import importlib, json, os, pkgutil, sys, threading

import django
from celery import Celery, _state, current_app, shared_task

APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.messages",
    "django.contrib.sessions",
    "batchgen.integrations.django",
]


def import_batchgen():
    import batchgen

    from django.conf import settings

    if "DJANGO_SETTINGS_MODULE" not in os.environ:
        settings.configure(SECRET_KEY="x", INSTALLED_APPS=APPS)
    django.setup()
    for module in pkgutil.walk_packages(batchgen.__path__, "batchgen."):
        if not module.name.endswith("__main__"):  # those run a command
            importlib.import_module(module.name)
    # Modules that make or use a Celery app, named in case the walk ever misses them.
    for name in ("batchgen.tasks", "batchgen.worker.publish", "batchgen.worker.notify"):
        importlib.import_module(name)
    from batchgen.worker.notify import callback_app

    callback_app("redis://127.0.0.1:1/0")  # the notifier's publishing app, made here too


@shared_task(name="shop.tasks.before")
def before():
    pass


if sys.argv[1] == "batchgen-first":
    import_batchgen()
host = Celery("proj")  # what proj/celery.py does (set_as_current by default)
if sys.argv[1] == "host-first":
    import_batchgen()


@shared_task(name="shop.tasks.after")
def after():
    pass


from batchgen.worker.publish import celery_app


def seen():
    return {
        "current": current_app._get_current_object().main,
        "before": before.app.main,
        "after": after.app.main,
    }


in_thread = {}
thread = threading.Thread(target=lambda: in_thread.update(seen()))
thread.start()
thread.join()
default = _state.default_app
print(json.dumps({
    "main_thread": seen(),
    "other_thread": in_thread,
    "default": default.main if default is not None else None,
    "ours": celery_app.main,
}))
"""


APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.messages",
    "django.contrib.sessions",
    "batchgen.integrations.django",
]
NOWHERE_REDIS = "redis://127.0.0.1:1/0"
NOWHERE_DB = "postgresql+psycopg://nobody@127.0.0.1:1/nothing"


def _probe(order: str, tmp_path: Path, django_settings: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    # Settings read at import only; nothing here connects (port 1: nobody's server).
    env.update(REDIS_URL=NOWHERE_REDIS, DATABASE_URL=NOWHERE_DB)
    if django_settings:
        # A Django host's processes carry it; Celery then installs its Django fix-up on
        # every app it makes, and that fix-up takes the default app if none is set yet.
        (tmp_path / "host_settings.py").write_text(f"SECRET_KEY = 'x'\nINSTALLED_APPS = {APPS}\n")
        env["DJANGO_SETTINGS_MODULE"] = "host_settings"
        env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, order],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("order", ["host-first", "batchgen-first"])
def test_a_django_hosts_app_stays_current_and_default(order, tmp_path):
    found = _probe(order, tmp_path, django_settings=True)
    assert found["ours"] == "batchgen"
    host = {"current": "proj", "before": "proj", "after": "proj"}
    # Every thread (a web server's request threads too) sees the host's app, so its
    # shared tasks publish to its own broker.
    assert found["main_thread"] == host, found
    assert found["other_thread"] == host, found
    assert found["default"] == "proj", found


def test_a_plain_hosts_app_stays_current(tmp_path):
    found = _probe("host-first", tmp_path, django_settings=False)
    assert found["main_thread"] == {"current": "proj", "before": "proj", "after": "proj"}
    assert found["default"] not in ("batchgen", "batchgen-callbacks"), found
