"""The dashboard's pages through Flask's test client, over the real database (and real
workers where a batch must run): namespacing in a host app, the admin's view of every
tenant's batches, progress bars by status, the batch page and the charts."""

from __future__ import annotations

import re

import pytest
from flask import Blueprint, Flask, render_template
from sqlalchemy import func, select, update

from batchgen import python_api as client
from batchgen.api import create_app
from batchgen.integrations.flask import BatchGen
from batchgen.store import db
from batchgen.store.schema import Item, Result
from tests.helpers import chat_line, dashboard_sign_in, make_tenant, wait_batches

pytestmark = pytest.mark.integration
MONEY = re.compile(r"^(\$\d[\d,]*\.\d\d|\$0\.00\d\d|<\$0\.0001)$")


def _signed_in(app: Flask, key: str, prefix: str = ""):  # type: ignore[no-untyped-def]
    web = app.test_client()
    assert dashboard_sign_in(web, key, prefix).status_code == 302
    return web


def _bar(page: str, batch_id: str) -> list[str]:
    """The statuses of the segments of the batch's progress bar on the page."""
    row = re.search(rf'<tr data-batch="{batch_id}">(.*?)</tr>', page, re.S)
    assert row, f"no row of {batch_id}"
    return re.findall(r'class="seg seg-(\w+)"', row.group(1))


def test_a_host_apps_dashboard_template_and_blueprint_leave_batchgens_alone(clean_db, tmp_path):
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "dashboard.html").write_text("<p>the host's own dashboard</p>")
    host = Flask("host", root_path=str(tmp_path))
    own = Blueprint("dashboard", "host")

    @own.get("/dashboard")
    def host_dashboard() -> str:
        return render_template("dashboard.html")

    host.register_blueprint(own)
    BatchGen(host)  # raised "The name 'dashboard' is already registered"
    key = make_tenant("acme")

    web = _signed_in(host, key, prefix="/batchgen")
    assert web.get("/dashboard").text == "<p>the host's own dashboard</p>"
    page = web.get("/batchgen/dashboard")
    assert page.status_code == 200
    assert 'id="batches"' in page.text and "host's own" not in page.text
    assert 'action="/batchgen/dashboard/submit"' in page.text  # batchgen's own url_for
    signed_out = host.test_client().get("/batchgen/dashboard")
    assert 'id="sign-in"' in signed_out.text and "host's own" not in signed_out.text
    assert {"batchgen_api", "batchgen_dashboard", "dashboard"} <= set(host.blueprints)


def test_the_admins_table_lists_every_tenants_batches(clean_db):
    make_tenant("acme")
    make_tenant("globex")
    admin = make_tenant("ops", is_admin=True)
    acme = client.submit_batch([chat_line(f"a{i}") for i in range(5)], tenant="acme")
    globex = client.submit_batch([chat_line(f"g{i}") for i in range(3)], tenant="globex")

    page = _signed_in(create_app(), admin).get("/dashboard").text
    assert "no batches yet" not in page  # it listed only the admin tenant's own
    for batch, tenant, n in ((acme, "acme", 5), (globex, "globex", 3)):
        row = re.search(rf'<tr data-batch="{batch["id"]}">(.*?)</tr>', page, re.S)
        assert row and f'<td class="tenant">{tenant}</td>' in row.group(1)
        assert f"pending {n}" in row.group(1)
        assert 'class="cancel"' not in row.group(1)  # an admin cancels only its own
    assert _bar(page, acme["id"]) == ["pending"]
    # A tenant still sees its own only.
    own = _signed_in(create_app(), make_tenant("initech")).get("/dashboard").text
    assert "no batches yet" in own and acme["id"] not in own


@pytest.mark.slow
def test_batch_page_bars_and_charts(clean_db, simulator, workers):
    key = make_tenant("acme")
    other = make_tenant("globex")
    admin = make_tenant("ops", is_admin=True)
    cancelled = client.submit_batch([chat_line(f"c{i}") for i in range(4)], tenant="acme")
    client.cancel_batch(cancelled["id"], tenant="acme")  # no worker yet: none of it ran
    workers(concurrency=2)
    done = client.submit_batch([chat_line(f"d{i}") for i in range(6)], tenant="acme")
    wait_batches([done["id"], cancelled["id"]])
    app = create_app()

    page = _signed_in(app, key).get("/dashboard").text
    # A cancelled batch's bar is not a completed one's.
    assert _bar(page, done["id"]) == ["succeeded"]
    assert _bar(page, cancelled["id"]) == ["cancelled"]
    assert ".seg-cancelled {" in page and ".seg-succeeded {" in page

    web = _signed_in(app, key)
    answer = web.get(f"/dashboard/batches/{done['id']}")
    assert answer.status_code == 200
    html = answer.text
    with db.session_scope() as session:
        tokens_in, tokens_out = session.execute(
            select(func.sum(Result.prompt_tokens), func.sum(Result.completion_tokens)).where(
                Result.batch_id == done["id"]
            )
        ).one()
    assert tokens_in > 0 and tokens_out > 0
    assert f'<span class="prompt-tokens">{tokens_in}</span>' in html
    assert f'<span class="completion-tokens">{tokens_out}</span>' in html
    cost = re.search(r'<dd id="cost">(.*?)</dd>', html)
    assert cost and MONEY.match(cost.group(1)), cost
    rate = re.search(r'<dd id="rate">([\d.]+) items/min \(last 5 min\)</dd>', html)
    assert rate and float(rate.group(1)) > 6 / 5  # 6 items, over the batch's age (< 5 min)
    assert '<dd id="time-left">ended</dd>' in html
    assert '<span class="done">6</span>/<span class="total">6</span>' in html
    assert re.search(r'<path class="line c0" data-series="sim-small" d="M[\d.,]+ L', html)

    stopped = web.get(f"/dashboard/batches/{cancelled['id']}").text
    assert re.findall(r'class="seg seg-(\w+)"', stopped) == ["cancelled"]
    assert '<td><code>cancelled</code></td><td class="num">4</td>' in stopped

    # Another tenant's batch is not there for a tenant; an admin sees any.
    missing = _signed_in(app, other).get(f"/dashboard/batches/{done['id']}")
    assert missing.status_code == 404 and done["id"] in missing.text
    assert _signed_in(app, key).get("/dashboard/batches/batch_nope").status_code == 404
    seen = _signed_in(app, admin).get(f"/dashboard/batches/{done['id']}")
    assert seen.status_code == 200 and '<dd id="tenant">acme</dd>' in seen.text
    assert 'id="sign-in"' in app.test_client().get(f"/dashboard/batches/{done['id']}").text

    # The admin's charts: throughput, tokens against the model's limit, cost per tenant.
    charts = _signed_in(app, admin).get("/dashboard").text
    assert 'data-chart="Tokens per minute: sim-small"' in charts
    assert re.search(r'<line class="limit" [^>]*y1="[\d.]+"', charts)
    bars = re.findall(r"<title>(\w+): (.*?)</title>", charts)
    assert [name for name, _ in bars] == ["acme"] and MONEY.match(bars[0][1])
    cost_cell = re.search(r'<td class="num cost">(.*?)</td>', charts)
    assert cost_cell and MONEY.match(cost_cell.group(1))


def _series(page: str, chart: str) -> set[str]:
    """The names of the lines a line chart of the page draws."""
    figure = re.search(
        rf'<figure class="chart" data-chart="{re.escape(chart)}">(.*?)</figure>', page, re.S
    )
    assert figure, f"no chart {chart!r}"
    return set(re.findall(r'<path class="line c\d" data-series="([^"]+)"', figure.group(1)))


def test_the_charts_draw_items_and_errors_per_minute(clean_db):
    """Items that ended lately, per model, and the failed or expired ones per error code:
    a tenant's charts count its own items, an admin's every tenant's."""
    key = make_tenant("acme")
    make_tenant("globex")
    admin = make_tenant("ops", is_admin=True)
    ended = {  # custom id -> (status, error code), as the worker leaves them
        "a0": ("succeeded", None),
        "a1": ("failed", "server_error"),
        "a2": ("expired", None),
        "g0": ("failed", "rate_limited"),
    }
    acme = client.submit_batch([chat_line(f"a{i}") for i in range(4)], tenant="acme")
    globex = client.submit_batch([chat_line("g0", model="sim-large")], tenant="globex")
    with db.session_scope() as session:
        for custom_id, (status, code) in ended.items():
            session.execute(
                update(Item)
                .where(Item.batch_id.in_([acme["id"], globex["id"]]), Item.custom_id == custom_id)
                .values(status=status, error_code=code, finished_at=func.now())
            )
    app = create_app()
    errors = "Errors per minute (failed, expired)"

    own = _signed_in(app, key).get("/dashboard").text
    assert _series(own, "Items finished per minute") == {"sim-small"}
    assert _series(own, errors) == {"server_error", "expired"}

    every = _signed_in(app, admin).get("/dashboard").text
    assert _series(every, "Items finished per minute") == {"sim-small", "sim-large"}
    assert _series(every, errors) == {"server_error", "expired", "rate_limited"}


def _csrf(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, "no form token on the page"
    return found.group(1)


def _status(batch_id: str) -> str:
    return client.get_batch(batch_id, tenant="acme")["status"]


def test_cancel_asks_first_and_a_cancelled_batch_reads_as_not_run(clean_db):
    """The table's Cancel opens a confirmation page (no script needed); only its form,
    with ``confirm=yes``, cancels; a post without it gets the question again. Then the
    batch reads 0 done of 4, cancelled 4, not 4/4."""
    key = make_tenant("acme")
    batch = client.submit_batch([chat_line(f"c{i}") for i in range(4)], tenant="acme")
    web = _signed_in(create_app(), key)
    page = web.get("/dashboard").text
    row = re.search(rf'<tr data-batch="{batch["id"]}">(.*?)</tr>', page, re.S)
    assert row, page
    ask = f"/dashboard/batches/{batch['id']}/cancel"
    assert f'method="get" action="{ask}"' in row.group(1)  # the button asks, it cancels nothing

    question = web.get(ask)
    assert question.status_code == 200 and _status(batch["id"]) == "in_progress"
    assert f"Cancel batch <code>{batch['id']}</code>?" in question.text
    assert '<input type="hidden" name="confirm" value="yes">' in question.text
    token = _csrf(question.text)

    unconfirmed = web.post(ask, data={"csrf": token})
    assert unconfirmed.status_code == 200 and 'id="confirm-cancel"' in unconfirmed.text
    assert _status(batch["id"]) == "in_progress"
    assert web.post(ask, data={"csrf": "forged", "confirm": "yes"}).status_code == 401
    assert _status(batch["id"]) == "in_progress"

    done = web.post(ask, data={"csrf": token, "confirm": "yes"})
    assert done.status_code == 302 and _status(batch["id"]) == "cancelled"

    progress = (
        '<span class="done">0</span>/<span class="total">4</span> · '
        '<span class="unrun unrun-cancelled">cancelled 4</span>'
    )
    assert progress in web.get("/dashboard").text
    assert progress in web.get(f"/dashboard/batches/{batch['id']}").text
    assert '<span class="done">4</span>' not in web.get("/dashboard").text
