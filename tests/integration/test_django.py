"""The reusable Django app, through Django's test client (pytest-django): the batch API
under a URL include answers exactly as the Flask API does, a real worker processes what
Django submits, and the service function and management command submit too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import django
import pytest
from django.conf import settings

if not settings.configured:  # this module is the Django project of these tests
    settings.configure(
        SECRET_KEY="tests",
        ALLOWED_HOSTS=["testserver"],
        ROOT_URLCONF=__name__,
        INSTALLED_APPS=[
            "django.contrib.contenttypes",
            "django.contrib.auth",
            "django.contrib.sessions",
            "batchgen.integrations.django",
        ],
        MIDDLEWARE=[
            "django.middleware.security.SecurityMiddleware",
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.middleware.common.CommonMiddleware",
            "django.middleware.csrf.CsrfViewMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
        ],
        # The site's own database (its users and sessions); batchgen's is its PostgreSQL.
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        LOGIN_URL="/accounts/login/",
        USE_TZ=True,
        BATCHGEN_LOG_LEVEL="INFO",  # exported to the environment by the app's ready()
    )
    django.setup()

from django.core.management import CommandError, call_command
from django.http import HttpRequest, JsonResponse
from django.test import Client
from django.urls import include, path

from batchgen.api import create_app
from batchgen.integrations.django import services
from tests.helpers import chat_line, jsonl, make_tenant, message_request, wait_batches

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def describe(request: HttpRequest) -> JsonResponse:
    """A host view submitting through the service function."""
    batch = services.submit_batch([chat_line(f"view-{i}") for i in range(4)], tenant="acme")
    return JsonResponse(batch)


urlpatterns = [
    path("batchgen/", include("batchgen.integrations.django.urls")),
    path("describe", describe),
]


def _auth(key: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def test_settings_exported_by_the_app():
    assert os.environ["BATCHGEN_LOG_LEVEL"] == "INFO"


def test_django_api_equals_flask_api_and_worker_processes(clean_db, simulator, workers, client):
    worker = workers(concurrency=8, wait=False)
    key = make_tenant("acme")
    flask = create_app().test_client()
    flask_auth = {"Authorization": f"Bearer {key}"}
    csrf_client = Client(enforce_csrf_checks=True)  # bearer-key API: no CSRF token needed

    rows = [chat_line(f"dj-{i}", text=f"Product {i}: a chair.") for i in range(10)]
    res = csrf_client.post(
        "/batchgen/v1/batches?completion_window=2h",
        data=jsonl(rows),
        content_type="application/jsonl",
        headers={"Authorization": f"Bearer {key}", "Idempotency-Key": "dj-1"},
    )
    assert res.status_code == 200, res.content
    batch = res.json()
    assert batch["request_counts"]["total"] == 10 and batch["completion_window"] == "2h"
    again = client.post(  # the same request again (the key names it, parameters included)
        "/batchgen/v1/batches?completion_window=2h",
        data=jsonl(rows),
        content_type="application/jsonl",
        HTTP_IDEMPOTENCY_KEY="dj-1",
        **_auth(key),
    )
    assert again.json()["id"] == batch["id"] and again["Idempotent-Replayed"] == "true"
    via_view = client.get("/describe").json()

    worker.wait_ready()
    wait_batches([batch["id"], via_view["id"]], timeout_s=60)

    info = client.get(f"/batchgen/v1/batches/{batch['id']}", **_auth(key))
    assert info.status_code == 200 and info["Content-Type"] == "application/json"
    assert info.json() == flask.get(f"/v1/batches/{batch['id']}", headers=flask_auth).json
    assert info.json()["status"] == "completed"

    results = client.get(f"/batchgen/v1/batches/{batch['id']}/results", **_auth(key))
    assert results.status_code == 200 and results.streaming
    assert results["Content-Type"].startswith("application/jsonl")
    body = b"".join(results.streaming_content)
    results.close()
    assert body == flask.get(f"/v1/batches/{batch['id']}/results", headers=flask_auth).data
    lines = [json.loads(line) for line in body.splitlines()]
    assert [r["custom_id"] for r in lines] == [f"dj-{i}" for i in range(10)]
    assert all(r["error"] is None for r in lines)

    listed = client.get("/batchgen/v1/batches?limit=1", **_auth(key)).json()
    assert listed["has_more"] is True and len(listed["data"]) == 1
    assert services.get_batch(via_view["id"], tenant="acme")["request_counts"]["succeeded"] == 4
    assert len(list(services.iter_results(via_view["id"], tenant="acme"))) == 4

    # Errors: the same status, JSON and headers as the Flask API.
    cases = [
        ("get", "/v1/batches/batch_nope", None, _auth(key)),
        ("get", "/v1/batches", None, {}),
        ("get", "/v1/batches", None, _auth("bg_not_a_key")),
        ("post", "/v1/batches", b"{bad json\n", _auth(key)),
        ("post", "/v1/batches", jsonl([chat_line("a", model="gpt-nope")]), _auth(key)),
        ("get", "/v1/batches?limit=x", None, _auth(key)),
        ("post", f"/v1/batches/{batch['id']}/cancel", b"", _auth(key)),
        ("get", "/v1/nothing-here", None, _auth(key)),
    ]
    for method, url, data, headers in cases:
        kwargs = {"data": data, "content_type": "application/jsonl"} if method == "post" else {}
        ours = getattr(client, method)("/batchgen" + url, **kwargs, **headers)
        flask_headers = {"Authorization": headers["HTTP_AUTHORIZATION"]} if headers else {}
        theirs = getattr(flask, method)(url, data=data, headers=flask_headers)
        assert ours.status_code == theirs.status_code, url
        assert ours.content == theirs.data, url
        assert ours["Content-Type"] == theirs.headers["Content-Type"], url


def test_django_mount_answers_every_error_as_json(clean_db, client, monkeypatch):
    """Case 16 under Django: unknown paths, wrong methods and unexpected failures below
    the include answer the documented JSON error, not Django's or Flask's HTML."""
    from batchgen import python_api

    key = make_tenant("acme")
    missing = client.get("/batchgen/v1/nothing-here", **_auth(key))
    assert missing.status_code == 404 and missing["Content-Type"] == "application/json"
    assert missing.json()["error"]["code"] == "not_found"
    wrong = client.delete("/batchgen/v1/batches", **_auth(key))
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in wrong["Allow"]

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(python_api, "get_batch", broken)
    failed = client.get("/batchgen/v1/batches/batch_0", **_auth(key))
    assert failed.status_code == 500
    assert failed.json() == {"error": {"code": "internal", "message": "internal error"}}


def test_management_command_and_errors(clean_db, tmp_path, capsys):
    make_tenant("acme")
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(jsonl([chat_line(f"cmd-{i}") for i in range(3)]))
    call_command("batchgen_submit", str(requests), "--tenant", "acme", "--json")
    batch = json.loads(capsys.readouterr().out)
    assert batch["request_counts"]["total"] == 3 and batch["status"] == "in_progress"
    with pytest.raises(CommandError, match="no tenant named 'nobody'"):
        call_command("batchgen_submit", str(requests), "--tenant", "nobody")
    with pytest.raises(CommandError, match="no such file"):
        call_command("batchgen_submit", str(tmp_path / "missing.jsonl"), "--tenant", "acme")
    requests.write_bytes(jsonl([chat_line("ok")]) + b"{oops\n")
    with pytest.raises(CommandError, match="line 2"):
        call_command("batchgen_submit", str(requests), "--tenant", "acme")

    # The other commands: cancel, results (stdout or a file), usage.
    call_command("batchgen_cancel", batch["id"], "--tenant", "acme", "--json")
    assert json.loads(capsys.readouterr().out)["status"] == "cancelled"
    call_command("batchgen_results", batch["id"], "--tenant", "acme")
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["custom_id"] for r in rows] == ["cmd-0", "cmd-1", "cmd-2"]
    assert {r["error"]["code"] for r in rows} == {"cancelled"}
    out = tmp_path / "out" / "results.jsonl"
    call_command("batchgen_results", batch["id"], "--tenant", "acme", "-o", str(out))
    assert len(out.read_text().splitlines()) == 3
    with pytest.raises(CommandError, match="no batch"):
        call_command("batchgen_results", "batch_nope", "--tenant", "acme")
    with pytest.raises(CommandError, match="no batch"):
        call_command("batchgen_cancel", "batch_nope", "--tenant", "acme")
    call_command("batchgen_usage", "--tenant", "acme")
    assert json.loads(capsys.readouterr().out) == []  # nothing ran, nothing is billed
    with pytest.raises(CommandError):
        call_command("batchgen_usage", "--from", "yesterday")


def test_example_project_checks():
    """The example project passes `manage.py check` once batchgen has its servers'
    addresses (the checks connect to nothing), and fails naming them without."""
    project = ROOT / "examples" / "django_project"
    names = ("BATCHGEN_DATABASE_URL", "DATABASE_URL", "BATCHGEN_REDIS_URL", "REDIS_URL")
    bare = {k: v for k, v in os.environ.items() if k not in names}
    configured = {**bare, "DATABASE_URL": "postgresql://db/x", "REDIS_URL": "redis://r:6379/0"}
    done = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=project,
        capture_output=True,
        text=True,
        env=configured,
    )
    assert done.returncode == 0, done.stderr
    assert "no issues" in done.stdout
    missing = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=project,
        capture_output=True,
        text=True,
        env=bare,
    )
    assert missing.returncode == 1
    assert "batchgen.E001" in missing.stderr and "BATCHGEN_DATABASE_URL" in missing.stderr


def test_django_mount_serves_the_sdk_routes(clean_db, client):
    """Files, batches from a file and Message Batches answer under the include's prefix
    (the results_url too), as the standalone API answers them."""
    from django.core.files.uploadedfile import SimpleUploadedFile

    key = make_tenant("dj-sdk")
    content = jsonl([chat_line(f"f-{i}") for i in range(3)])
    res = client.post(
        "/batchgen/v1/files",
        {"file": SimpleUploadedFile("in.jsonl", content), "purpose": "batch"},
        **_auth(key),
    )
    assert res.status_code == 200, res.content
    upload = res.json()
    assert (upload["bytes"], upload["purpose"]) == (len(content), "batch")
    res = client.post(
        "/batchgen/v1/batches",
        data=json.dumps(
            {
                "input_file_id": upload["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            }
        ),
        content_type="application/json",
        **_auth(key),
    )
    assert res.status_code == 200, res.content
    assert res.json()["input_file_id"] == upload["id"]
    assert res.json()["request_counts"]["total"] == 3
    listed = client.get("/batchgen/v1/files", **_auth(key)).json()
    assert [f["id"] for f in listed["data"]] == [upload["id"]]
    content_res = client.get(f"/batchgen/v1/files/{upload['id']}/content", **_auth(key))
    assert b"".join(content_res.streaming_content) == content
    assert client.delete(f"/batchgen/v1/files/{upload['id']}", **_auth(key)).json()["deleted"]

    request = message_request("m")
    res = client.post(
        "/batchgen/v1/messages/batches",
        data=json.dumps({"requests": [request]}),
        content_type="application/json",
        HTTP_X_API_KEY=key,
        HTTP_ANTHROPIC_VERSION="2023-06-01",
    )
    assert res.status_code == 200, res.content
    batch = res.json()
    assert batch["type"] == "message_batch" and batch["request_counts"]["processing"] == 1
    client.post(f"/batchgen/v1/messages/batches/{batch['id']}/cancel", HTTP_X_API_KEY=key)
    ended = client.get(f"/batchgen/v1/messages/batches/{batch['id']}", HTTP_X_API_KEY=key).json()
    assert ended["processing_status"] == "ended"
    assert ended["results_url"] == (
        f"http://testserver/batchgen/v1/messages/batches/{batch['id']}/results"
    )


def test_manage_py_check_names_missing_settings(monkeypatch):
    """With no database or Redis address for batchgen, `manage.py check` fails and names
    the setting to add; with them, it passes."""
    from django.core.checks import run_checks

    monkeypatch.setenv("BATCHGEN_DATABASE_URL", "postgresql://db/x")  # checks connect to nothing
    monkeypatch.setenv("BATCHGEN_REDIS_URL", "redis://r:6379/0")
    assert not [e for e in run_checks() if e.id.startswith("batchgen.")]
    for name in ("BATCHGEN_DATABASE_URL", "DATABASE_URL", "BATCHGEN_REDIS_URL", "REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    found = {e.id: e for e in run_checks() if e.id.startswith("batchgen.")}
    assert set(found) == {"batchgen.E001", "batchgen.E002"}
    assert "BATCHGEN_DATABASE_URL" in (found["batchgen.E001"].hint or "")
    with pytest.raises(CommandError):
        call_command("check")


def test_the_batch_finished_signal_reaches_a_django_receiver_once(clean_db, capsys):
    """Only the site's own batches, once each, from ``manage.py batchgen_signals``; a
    Flask app's batch (another host app, same database) never reaches the site."""
    from django.dispatch import receiver
    from flask import Flask

    from batchgen.integrations.django.signals import app_id, batch_finished
    from batchgen.integrations.flask import BatchGen
    from batchgen.store.schema import Batch

    got: list[dict] = []

    @receiver(batch_finished)
    def on_finished(sender, **payload):  # type: ignore[no-untyped-def]
        got.append(payload)

    @receiver(batch_finished)
    def failing(sender, **payload):  # type: ignore[no-untyped-def]
        raise RuntimeError("another receiver fails")

    make_tenant("acme")
    batch = services.submit_batch([chat_line("sig")], tenant="acme")
    services.cancel_batch(batch["id"], tenant="acme")  # finished at once
    flask_app = Flask("flaskshop")
    flask_ext = BatchGen(flask_app)
    with flask_app.app_context():
        theirs = flask_ext.submit_batch([chat_line("flask")], tenant="acme")
    services.cancel_batch(theirs["id"], tenant="acme")
    call_command("batchgen_signals")
    call_command("batchgen_signals")
    batch_finished.disconnect(on_finished)
    batch_finished.disconnect(failing)

    out = capsys.readouterr().out
    assert "1 batch_finished signals sent" in out and "0 batch_finished signals sent" in out
    assert [(p["batch_id"], p["status"], p["request_counts"]["cancelled"]) for p in got] == [
        (batch["id"], "cancelled", 1)
    ]
    from batchgen.store import db

    with db.session_scope() as session:
        origin = session.get(Batch, batch["id"]).origin  # type: ignore[union-attr]
        assert origin == app_id() == "django"  # settings.configure(): no settings module
        assert session.get(Batch, theirs["id"]).origin == "flaskshop"  # type: ignore[union-attr]
    assert flask_ext.deliver_signals(flask_app) == 1  # the Flask app's, for the Flask app


def test_the_signal_command_follows(clean_db):
    """``--follow`` keeps polling (the stop hook ends this test's loop)."""
    from batchgen.integrations import run_signals

    rounds: list[int] = []
    sent = run_signals(
        lambda: rounds.append(1) or 2, follow=True, poll_s=0.01, stop=lambda: len(rounds) >= 3
    )
    assert (sent, len(rounds)) == (6, 3)


ADMIN_SCRIPT = """
import json, os
import django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
django.setup()
from django.contrib.admin.utils import quote
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from batchgen.integrations.django import services
from batchgen.integrations.django.signals import batch_finished, deliver_signals
from batchgen.store import db, tenants

call_command("migrate", verbosity=0)  # the shop's own tables (sqlite)
with db.session_scope() as session:
    tenants.create_tenant(session, "shop-a")
got = []
batch_finished.connect(lambda sender, **payload: got.append(payload), weak=False)
line = {"custom_id": "p1", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "sim-small", "messages": [{"role": "user", "content": "Describe p1"}]}}
done = services.submit_batch([line], tenant="shop-a")
services.cancel_batch(done["id"], tenant="shop-a")
other = services.submit_batch([line, {**line, "custom_id": "p2"}], tenant="shop-a")
sent = deliver_signals()
User.objects.create_superuser("admin", "admin@example.com", "pw")
client = Client()
client.force_login(User.objects.get(username="admin"))
listing = client.get("/admin/batchgen/batch/?status__exact=cancelled")
# The admin unquotes ids in its URLs ("_22" is '"'), so a link quotes them as it does.
detail = client.get(f"/admin/batchgen/batch/{quote(done['id'])}/change/")
items = client.get(f"/admin/batchgen/item/?batch__id__exact={done['id']}")
action = client.post(
    "/admin/batchgen/batch/",
    {"action": "cancel", "_selected_action": [other["id"]]},
    follow=True,
)
print(json.dumps({
    "signals": [[p["batch_id"], p["status"]] for p in got], "sent": sent,
    "done": done["id"], "other": other["id"],
    "listing": [listing.status_code, done["id"] in listing.content.decode(),
                other["id"] in listing.content.decode()],
    "detail": [detail.status_code, "batch__id__exact=" + done["id"] in detail.content.decode()],
    "items": [items.status_code, "p1" in items.content.decode(),
              "Describe p1" in items.content.decode()],
    "action": [action.status_code, "1 batches cancelled" in action.content.decode()],
    "other_after": services.get_batch(other["id"], tenant="shop-a")["status"],
}))
"""


def test_example_project_admin_shows_batches_and_receives_the_signal(clean_db, tmp_path):
    """A copy of the example project in a temporary folder, with the admin: it receives
    batch_finished, lists the batch, links it to its items, and cancels from an action."""
    import shutil

    project = tmp_path / "django_project"
    shutil.copytree(ROOT / "examples" / "django_project", project)
    (project / "admin_check.py").write_text(ADMIN_SCRIPT)
    done = subprocess.run(
        [sys.executable, "admin_check.py"],
        cwd=project,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(project)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["signals"] == [[seen["done"], "cancelled"]] and seen["sent"] == 1
    assert seen["listing"] == [200, True, False]  # filtered by status
    assert seen["detail"] == [200, True]  # the link to its items
    assert seen["items"] == [200, True, False]  # custom ids, never the prompt
    assert seen["action"] == [200, True]
    assert seen["other_after"] in ("cancelled", "cancelling")


def test_dry_run_is_the_test_mode_of_a_site(clean_db, monkeypatch):
    """BATCHGEN_DRY_RUN in the site's test settings: a submit is validated and described
    as usual, then nothing is kept, so nothing runs and nothing is billed."""
    from sqlalchemy import func, select

    from batchgen.config import get_settings
    from batchgen.errors import ValidationFailed
    from batchgen.integrations import apply_settings
    from batchgen.store import db
    from batchgen.store.schema import Batch, Item

    make_tenant("acme")
    monkeypatch.setenv("BATCHGEN_DRY_RUN", "false")  # restored after the test
    apply_settings({"BATCHGEN_DRY_RUN": True})
    try:
        batch = services.submit_batch([chat_line(f"t-{i}") for i in range(3)], tenant="acme")
        assert batch["dry_run"] is True and batch["request_counts"]["total"] == 3
        with pytest.raises(ValidationFailed, match="line 2"):
            services.submit_batch([chat_line("ok"), {"custom_id": "bad"}], tenant="acme")
    finally:
        get_settings.cache_clear()
    with db.session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Batch)) == 0
        assert session.scalar(select(func.count()).select_from(Item)) == 0


def test_a_missing_database_alias_fails_manage_py_check():
    """With batchgen's router (or the admin) in use, ``DATABASES`` must have the alias
    batchgen's models are read through; ``manage.py check`` names it and the setting."""
    from django.core.checks import run_checks
    from django.test import override_settings

    router = "batchgen.integrations.django.routers.BatchgenRouter"
    assert "batchgen.E003" not in {e.id for e in run_checks()}  # models unused: no error
    with override_settings(DATABASE_ROUTERS=[router]):
        found = {e.id: e for e in run_checks() if e.id.startswith("batchgen.")}
        assert "'batchgen'" in found["batchgen.E003"].msg
        assert 'DATABASES["batchgen"]' in found["batchgen.E003"].hint
        assert "BATCHGEN_DJANGO_DATABASE" in found["batchgen.E003"].hint
        with pytest.raises(CommandError, match="batchgen.E003"):
            call_command("check")
    with override_settings(DATABASE_ROUTERS=[router], BATCHGEN_DJANGO_DATABASE="default"):
        assert "batchgen.E003" not in {e.id for e in run_checks()}
    with override_settings(DATABASE_ROUTERS=[router], BATCHGEN_DJANGO_DATABASE="shop_b"):
        error = next(e for e in run_checks() if e.id == "batchgen.E003")
        assert "'shop_b'" in error.msg and "BATCHGEN_DJANGO_DATABASE" in error.msg


@pytest.mark.django_db
def test_the_dashboard_follows_the_sites_login(clean_db, client, django_user_model):
    """A staff user signed in with Django's auth sees the dashboard's operator view; an
    anonymous visitor is sent to LOGIN_URL; a user who is not staff signs in with a key;
    the API keeps its bearer keys."""
    key = make_tenant("acme")
    anonymous = client.get("/batchgen/dashboard")
    assert anonymous.status_code == 302
    assert anonymous["Location"] == "/accounts/login/?next=/batchgen/dashboard"
    # The operator identity comes from the bridge only, never from a request.
    forged = client.get("/batchgen/dashboard/fragment", HTTP_BATCHGEN_OPERATOR="root")
    assert forged.status_code == 302  # anonymous all the same

    staff = django_user_model.objects.create_user("ops", password="pw", is_staff=True)
    client.force_login(staff)
    page = client.get("/batchgen/dashboard")
    assert page.status_code == 200
    text = page.content.decode()
    assert "ops (operator)" in text and 'id="models"' in text and "sim-small" in text
    assert page["X-Frame-Options"] == "DENY"
    assert client.get("/batchgen/dashboard/fragment").status_code == 200
    # The API answers by its key, not by the Django session.
    assert client.get("/batchgen/v1/batches").status_code == 401
    assert client.get("/batchgen/v1/batches", **_auth(key)).status_code == 200

    clerk = django_user_model.objects.create_user("clerk", password="pw")
    client.force_login(clerk)
    form = client.get("/batchgen/dashboard")
    assert form.status_code == 200 and 'id="key"' in form.content.decode()
    import re

    token = re.search(r'name="csrf" value="([^"]+)"', form.content.decode())
    assert token is not None
    signed_in = client.post("/batchgen/dashboard/login", {"key": key, "csrf": token.group(1)})
    assert signed_in.status_code == 302, signed_in.content
    cookie = signed_in.cookies["batchgen_session"]
    assert cookie["path"] == "/batchgen" and cookie["httponly"] and cookie.value != key
    mine = client.get("/batchgen/dashboard").content.decode()
    assert 'id="batches"' in mine and "(operator)" not in mine


def test_the_staff_view_lists_every_tenants_batches(clean_db, client, django_user_model):
    """A staff user's operator view lists the batches of every tenant (read only: no
    cancel, and no submit form, as the operator is no tenant), not "no batches yet"."""
    from batchgen import python_api

    make_tenant("acme")
    make_tenant("globex")
    made = [
        python_api.submit_batch([chat_line(f"{name}-{i}") for i in range(2)], tenant=name)
        for name in ("acme", "acme", "acme", "globex", "globex")
    ]
    staff = django_user_model.objects.create_user("ops", password="pw", is_staff=True)
    client.force_login(staff)
    for url in ("/batchgen/dashboard", "/batchgen/dashboard/fragment"):
        text = client.get(url).content.decode()
        assert "no batches yet" not in text, url
        for batch in made:
            assert f'<tr data-batch="{batch["id"]}">' in text, (url, batch["id"])
        assert '<td class="tenant">globex</td>' in text
        assert 'class="cancel"' not in text and 'id="submit-form"' not in text


@pytest.mark.django_db
def test_staff_users_use_the_admin_api_behind_djangos_csrf_check(
    clean_db, client, django_user_model
):
    """A signed-in staff user reaches /admin/v1 below the mount (as ``django:<user>`` in
    the audit log); a change needs Django's CSRF token, as a cookie authenticates it; a
    user who is not staff, or anonymous, gets 401; a tenant key is judged alone (403)."""
    from batchgen import tenant_admin

    key = make_tenant("acme")
    assert client.get("/batchgen/admin/v1/tenants").status_code == 401
    clerk = django_user_model.objects.create_user("clerk", password="pw")
    client.force_login(clerk)
    assert client.get("/batchgen/admin/v1/tenants").status_code == 401

    staff = django_user_model.objects.create_user("ops", password="pw", is_staff=True)
    guarded = Client(enforce_csrf_checks=True)
    guarded.force_login(staff)
    listed = guarded.get("/batchgen/admin/v1/tenants")
    assert listed.status_code == 200 and [t["name"] for t in listed.json()["data"]] == ["acme"]
    forged = guarded.post(
        "/batchgen/admin/v1/tenants", data={"name": "evil"}, content_type="application/json"
    )
    assert forged.status_code == 403  # Django's CSRF refusal: nothing made
    assert [t["name"] for t in tenant_admin.list_tenants()] == ["acme"]
    token = "k" * 32
    guarded.cookies["csrftoken"] = token
    made = guarded.post(
        "/batchgen/admin/v1/tenants",
        data={"name": "globex", "weight": 3},
        content_type="application/json",
        headers={"X-CSRFToken": token},
    )
    assert made.status_code == 201, made.content
    assert made.json()["weight"] == 3 and made.json()["api_key"]["secret"].startswith("bg_")
    assert tenant_admin.audit_log(tenant="globex")[-1]["actor"] == "django:ops"
    # A request that carries a key is the key's, whoever is signed in.
    as_key = guarded.get("/batchgen/admin/v1/tenants", headers={"Authorization": f"Bearer {key}"})
    assert as_key.status_code == 403 and as_key.json()["error"]["code"] == "operator_key_required"


KEYS_ADMIN_SCRIPT = """
import json, os, re
import django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
django.setup()
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from batchgen import tenant_admin as admin
from batchgen.store import db
from batchgen.store.api_keys import authenticate

call_command("migrate", verbosity=0)
made = admin.create_tenant("shop-a", actor="python")
tenant_id, first = made["id"], made["api_key"]
spare = admin.create_key("shop-a", name="spare", scopes=["read"])
User.objects.create_superuser("admin", "admin@example.com", "pw")
client = Client()
client.force_login(User.objects.get(username="admin"))

def works(secret):
    try:
        with db.session_scope() as session:
            authenticate(session, secret)
        return True
    except Exception:
        return False

new_key = client.post(
    "/admin/batchgen/tenant/", {"action": "new_key", "_selected_action": [tenant_id]}
)
new_secret = re.search(r"<code>(bg_[^<]+)</code>", new_key.content.decode()).group(1)
new_works = works(new_secret)
listing = client.get("/admin/batchgen/apikey/")
rotated = client.post(
    "/admin/batchgen/apikey/", {"action": "rotate", "_selected_action": [first["id"]]}
)
rotated_secret = re.search(r"<code>(bg_[^<]+)</code>", rotated.content.decode()).group(1)
both_work = [works(rotated_secret), works(first["secret"])]
revoked = client.post(
    "/admin/batchgen/apikey/", {"action": "revoke", "_selected_action": [spare["id"]]}, follow=True
)
changed = client.post(
    f"/admin/batchgen/tenant/{tenant_id}/change/",
    {"weight": "7", "max_pending_items": "", "daily_token_quota": "5000", "tokens_per_min": "",
     "max_files": "", "max_file_bytes": "", "_save": "Save"},
)
suspended = client.post(
    "/admin/batchgen/tenant/", {"action": "suspend", "_selected_action": [tenant_id]}, follow=True
)
audit_page = client.get("/admin/batchgen/auditentry/")
shown = admin.get_tenant("shop-a")
log = admin.audit_log(tenant="shop-a")
print(json.dumps({
    "new_key": [new_key.status_code, new_key["Cache-Control"], new_works],
    "listing": [listing.status_code, first["prefix"] in listing.content.decode(),
                first["secret"] in listing.content.decode()],
    "rotated": [rotated.status_code, *both_work],
    "revoked": [revoked.status_code, works(spare["secret"])],
    "changed": [changed.status_code, shown["weight"], shown["daily_token_quota"]],
    "suspended": [suspended.status_code, shown["suspended"]],
    "audit_page": [audit_page.status_code, "key.rotate" in audit_page.content.decode()],
    "actions": [[e["action"], e["actor"]] for e in reversed(log)],
    "secrets_in_log": any(s in json.dumps(log) for s in (new_secret, rotated_secret)),
}))
"""


def test_the_django_admin_manages_tenants_and_keys_through_batchgen(clean_db, tmp_path):
    """In the example project's admin: a new key and a rotation show the secret once on
    their page, a revoke stops one key, the change form sets a tenant's weight and
    quota, an action suspends it; each change is in the audit log as django:<user>."""
    import shutil

    project = tmp_path / "django_project"
    shutil.copytree(ROOT / "examples" / "django_project", project)
    (project / "keys_admin_check.py").write_text(KEYS_ADMIN_SCRIPT)
    done = subprocess.run(
        [sys.executable, "keys_admin_check.py"],
        cwd=project,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(project)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["new_key"][0] == 200 and "no-store" in seen["new_key"][1], seen
    assert seen["new_key"][2] is True
    assert seen["listing"] == [200, True, False]  # the prefix, never the key
    assert seen["rotated"] == [200, True, True]  # both work during the overlap
    assert seen["revoked"] == [200, False]
    assert seen["changed"] == [302, 7, 5000]
    assert seen["suspended"] == [200, True]
    assert seen["audit_page"] == [200, True]
    assert seen["actions"] == [
        ["tenant.create", "python"],
        ["key.create", "python"],
        ["key.create", "python"],
        ["key.create", "django:admin"],
        ["key.rotate", "django:admin"],
        ["key.revoke", "django:admin"],
        ["tenant.update", "django:admin"],
        ["tenant.suspend", "django:admin"],
    ]
    assert seen["secrets_in_log"] is False
