"""Nightly description jobs: beat firing twice submits one batch per job and date, the
worker writes the descriptions (file and table) and the one-line report; incremental
runs call only the products whose request changed."""

from __future__ import annotations

import csv
import datetime as dt
import json
import os
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select, text

from batchgen import embedded
from batchgen.config import get_settings
from batchgen.errors import ConfigError, ValidationFailed
from batchgen.nightly import Job, PromptRenderer, load_jobs, output_table, submit_job
from batchgen.store import db
from batchgen.store.schema import Batch, Item, NightlyProduct, Result, UsageLedger
from batchgen.worker.beat import cron_schedule
from tests import http_client
from tests.helpers import make_tenant, sim_config, status_summary, wait_batches
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
DAY = "2030-01-02"
DAY1 = dt.date(2030, 1, 1)
# How long a run of 500 descriptions may take: a minute on a quiet machine is a few
# on one at a load of 30 or more (the worker, its beat and the simulator share it).
RUN_S = 240


@pytest.fixture
def catalog_db(services):
    """A database of its own on the same server: the shop's product table."""
    name = f"batchgen_shop_{os.getpid()}"
    embedded.drop_database(services["server_url"], name)
    url = embedded.ensure_database(services["server_url"], name)
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE products (sku text PRIMARY KEY, name text, colour text)"))
        conn.execute(
            text("INSERT INTO products VALUES (:sku, :name, :colour)"),
            [{"sku": f"t{i:02d}", "name": f"Table {i}", "colour": "oak"} for i in range(30)],
        )
    yield url, engine
    engine.dispose()
    embedded.drop_database(services["server_url"], name)


def _jobs_file(tmp_path: Path, products: int) -> Path:
    with open(tmp_path / "catalog.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", "name", "category", "price"])
        for i in range(products):
            writer.writerow([f"p{i:04d}", f"Lamp {i}", "lighting", f"{10 + i % 50}.00"])
    (tmp_path / "t.j2").write_text(
        "Write a {{ tone }} text in {{ locale }} about {{ product.name }} "
        "({{ product.category }}, {{ product.price }} EUR)."
    )
    path = tmp_path / "jobs.toml"
    path.write_text(
        """
[[jobs]]
name = "shop-en"
tenant = "acme"
model = "sim-small"
catalog = "catalog.csv"
template = "t.j2"
tone = "playful"
locale = "en-GB"
max_tokens = 8
output = "out/{job}-{date}.jsonl"
report = "out/{job}-{date}.report"

[[jobs]]
name = "shop-tables"
tenant = "acme"
model = "sim-small"
catalog = { table = "products", url_env = "SHOP_DATABASE_URL" }
id_column = "sku"
locale = "de-DE"
max_tokens = 8
output = { table = "product_descriptions", url_env = "SHOP_DATABASE_URL" }
"""
    )
    return path


def _wait_for(path: Path, timeout_s: float = RUN_S) -> str:
    wait_until(path.exists, timeout_s, lambda: f"{path.name} written: {status_summary()}", 0.2)
    return path.read_text()


@pytest.mark.slow
def test_beat_fires_twice_one_batch_500_descriptions_and_report(
    clean_db, simulator, workers, tmp_path, catalog_db, restore_env
):
    from batchgen.tasks.nightly import nightly

    shop_url, shop_engine = catalog_db
    jobs_file = _jobs_file(tmp_path, 500)
    os.environ.update(
        BATCHGEN_NIGHTLY_JOBS_FILE=str(jobs_file),
        BATCHGEN_NIGHTLY_POLL_S="0.3",
        SHOP_DATABASE_URL=shop_url,
    )
    get_settings.cache_clear()
    worker = workers(concurrency=16, wait=False)  # gets the environment above
    make_tenant("acme")

    first = nightly.apply(kwargs={"day": DAY}).get()
    second = nightly.apply(kwargs={"day": DAY}).get()  # beat firing twice
    assert first == second and set(first) == {"shop-en", "shop-tables"}
    worker.wait_ready(timeout_s=RUN_S)

    report = _wait_for(tmp_path / "out" / f"shop-en-{DAY}.report").strip()
    with db.session_scope() as s:
        batches = s.scalars(select(Batch).order_by(Batch.idempotency_key)).all()
        assert [(b.idempotency_key, b.total_items, b.priority) for b in batches] == [
            (f"nightly:shop-en:{DAY}:0", 500, "bulk"),
            (f"nightly:shop-tables:{DAY}:0", 30, "bulk"),
        ]
        en = batches[0]
        tokens = s.execute(
            select(
                func.sum(UsageLedger.prompt_tokens),
                func.sum(UsageLedger.completion_tokens),
                func.sum(UsageLedger.cost_usd),
            ).where(UsageLedger.batch_id == en.id)
        ).one()
        body = s.scalar(select(Item.body).where(Item.batch_id == en.id, Item.custom_id == "p0007"))
    assert report == (
        f"nightly job=shop-en date={DAY} products=500 written=500 succeeded=500 failed=0 "
        f"expired=0 cancelled=0 rejected=0 reused=0 prompt_tokens={tokens[0]} "
        f"completion_tokens={tokens[1]} "
        f"cost_usd={Decimal(tokens[2]):.6f} batches={en.id}"
    )
    assert body["messages"] == [
        {
            "role": "user",
            "content": "Write a playful text in en-GB about Lamp 7 (lighting, 17.00 EUR).",
        }
    ]
    assert body["max_tokens"] == 8 and body["model"] == "sim-small"

    out_text = (tmp_path / "out" / f"shop-en-{DAY}.jsonl").read_text()
    out = [json.loads(line) for line in out_text.splitlines()]
    assert len(out) == 500 and len({r["id"] for r in out}) == 500
    assert all(r["locale"] == "en-GB" and r["description"] for r in out)

    table = output_table("product_descriptions")

    def written() -> list | None:  # the table job's collect runs on the worker too
        with shop_engine.connect() as conn:
            if shop_engine.dialect.has_table(conn, "product_descriptions"):
                rows = conn.execute(select(table).order_by(table.c.product_id)).all()
                return list(rows) if len(rows) == 30 else None
        return None

    rows = wait_until(written, RUN_S, "the table output written", 0.2)
    assert {r.job for r in rows} == {"shop-tables"} and rows[0].run_date == dt.date(2030, 1, 2)
    assert rows[0].product_id == "t00" and rows[0].locale == "de-DE" and rows[0].description


def test_jobs_file_and_template_errors(clean_db, tmp_path):
    make_tenant("acme")
    bad = tmp_path / "bad.toml"
    bad.write_text('[[jobs]]\nname = "x"\ntenant = "acme"\nmodel = "m"\ncatalog = "c.txt"\n')
    with pytest.raises(ConfigError, match="job 'x'"):
        load_jobs(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_jobs(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="five cron fields"):
        cron_schedule("0 2 * *")
    assert cron_schedule("30 1 * * 1-5").hour == {1}

    (tmp_path / "c.jsonl").write_text(
        '{"id": "a", "name": "A"}\n{"id": "b"}\n\n{"id": "c", "name": null}\n[1]\n{"id": \n'
    )
    (tmp_path / "t.j2").write_text("About {{ product.name }}")
    job = Job(
        name="j",
        tenant="acme",
        model="sim-small",
        catalog=tmp_path / "c.jsonl",
        output=tmp_path / "o.csv",
        template=tmp_path / "t.j2",
    )
    ids, _ = submit_job(job, dt.date(2030, 1, 1))  # b and c have no name: left out
    with db.session_scope() as s:
        assert s.scalars(select(Item.custom_id).where(Item.batch_id.in_(ids))).all() == ["a"]
    rejects = (tmp_path / "o.rejects.jsonl").read_text().splitlines()
    assert [json.loads(r) for r in rejects] == [
        {"line": 2, "id": "b", "reason": "missing or empty column 'name'"},
        {"line": 4, "id": "c", "reason": "missing or empty column 'name'"},
        {"line": 5, "id": None, "reason": "not a JSON object"},
        {"line": 6, "id": None, "reason": "bad JSON"},
    ]
    (tmp_path / "none.jsonl").write_text('{"id": "x"}\n')
    with pytest.raises(ValidationFailed, match="1 rows rejected"):  # nothing to submit
        submit_job(job.model_copy(update={"catalog": tmp_path / "none.jsonl", "name": "k"}), DAY1)
    with db.session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Batch)) == 1
    default = PromptRenderer(job.model_copy(update={"template": None}))
    prompt = default.request({"id": "b", "colour": "red", "size": " "})["body"]["messages"][0]
    assert "Product: b" in prompt["content"] and "colour: red" in prompt["content"]
    assert "size" not in prompt["content"]


def _task_ended(log: str, task_id: str) -> str | None:
    """The worker's log line saying how task ``task_id`` ended, once there is one."""
    for line in log.splitlines():
        if f"[{task_id}]" in line and ("succeeded" in line or "raised" in line):
            return line
    return None


def test_nightly_collect_message_carries_no_file_path(
    clean_db, simulator, workers, tmp_path, restore_env
):
    """A collect message names a job and a date; the jobs file (and so every path
    written) comes from the worker's settings, never from the message."""
    from batchgen.tasks.celery_app import celery_app

    (tmp_path / "catalog.jsonl").write_text(
        "".join(json.dumps({"id": f"v{i}", "name": f"Vase {i}"}) + "\n" for i in range(3))
    )
    job = '[[jobs]]\nname = "vases"\ntenant = "acme"\nmodel = "sim-small"\nmax_tokens = 8\n'
    good = tmp_path / "jobs.toml"
    good.write_text(job + 'catalog = "catalog.jsonl"\noutput = "out/{job}-{date}.jsonl"\n')
    planted = tmp_path / "elsewhere" / "jobs.toml"
    planted.parent.mkdir()
    planted.write_text(
        job + f'catalog = "{tmp_path / "catalog.jsonl"}"\noutput = "written-here.jsonl"\n'
    )
    os.environ.update(BATCHGEN_NIGHTLY_JOBS_FILE=str(good), BATCHGEN_NIGHTLY_POLL_S="0.3")
    get_settings.cache_clear()
    worker = workers(concurrency=4)
    make_tenant("acme")
    (job_,) = load_jobs(good)
    ids, _ = submit_job(job_, dt.date.fromisoformat(DAY))
    wait_batches(ids)

    sent = celery_app.send_task(
        "batchgen.nightly_collect", args=["vases", DAY], kwargs={"jobs_file": str(planted)}
    )
    ended = wait_until(lambda: _task_ended(worker.log_tail(400), sent.id), 30, worker.log_tail)
    assert "succeeded" not in ended and "jobs_file" in ended, ended
    assert not (planted.parent / "written-here.jsonl").exists()
    assert not (tmp_path / "out" / f"vases-{DAY}.jsonl").exists()  # nor from the settings


def test_nightly_row_missing_a_column_goes_to_rejects(clean_db, tmp_path):
    """A catalog row without a value the template uses is not submitted (nor billed): it
    goes to the rejects file with its source line; the other rows run."""
    (tmp_path / "catalog.csv").write_text(
        "id,name,category,price\n"
        "p1,Lamp 1,lighting,10.00\n"
        "p2,Lamp 2,lighting\n"  # line 3: no price column
        "p3,Lamp 3,lighting,\n"  # line 4: empty price
        'p4,"Lamp\n4",lighting,12.00\n'  # lines 5-6: one row
        "p5,Lamp 5,  ,13.00\n"  # line 7: blank category
        "p6,Lamp 6,lighting,14.00,extra\n"  # line 8: more fields than the header
        "p7,Lamp 7,lighting,15.00\n"
    )
    (tmp_path / "t.j2").write_text(
        "About {{ product.name }} ({{ product.category }}, {{ product.price }} EUR)"
        "{% if product.colour %}, {{ product.colour }}{% endif %}."
    )
    job = Job(
        name="lamps",
        tenant="acme",
        model="sim-small",
        catalog=tmp_path / "catalog.csv",
        output=tmp_path / "out" / "{job}-{date}.jsonl",
        template=tmp_path / "t.j2",
    )
    make_tenant("acme")
    ids, created = submit_job(job, dt.date.fromisoformat(DAY))
    assert created and len(ids) == 1
    with db.session_scope() as s:
        items = s.execute(
            select(Item.custom_id, Item.body).where(Item.batch_id == ids[0]).order_by(Item.id)
        ).all()
    assert [i.custom_id for i in items] == ["p1", "p4", "p7"]
    prompts = [i.body["messages"][0]["content"] for i in items]
    assert prompts[0] == "About Lamp 1 (lighting, 10.00 EUR)."
    assert not any("None" in p for p in prompts)

    rejects = tmp_path / "out" / f"lamps-{DAY}.rejects.jsonl"
    rows = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert [(r["line"], r["id"]) for r in rows] == [(3, "p2"), (4, "p3"), (7, "p5"), (8, None)]
    assert "price" in rows[0]["reason"] and "price" in rows[1]["reason"]
    assert "category" in rows[2]["reason"] and "fields" in rows[3]["reason"]


def _write_catalog(path: Path, products: dict[str, tuple[str, str]]) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", "name", "price"])
        for product_id, (name, price) in products.items():
            writer.writerow([product_id, name, price])


def _incremental_jobs(tmp_path: Path) -> Path:
    (tmp_path / "t.j2").write_text("About {{ product.name }} ({{ product.price }} EUR).")
    common = (
        'tenant = "acme"\nmodel = "sim-small"\ncatalog = "catalog.csv"\ntemplate = "t.j2"\n'
        'max_tokens = 8\noutput = "out/{job}-{date}.jsonl"\nreport = "out/{job}-{date}.report"\n'
    )
    path = tmp_path / "jobs.toml"
    path.write_text(
        f'[[jobs]]\nname = "lamps"\n{common}\n'
        f'[[jobs]]\nname = "lamps-all"\nincremental = false\n{common}'
    )
    return path


def _sim_calls(sim) -> int:
    return len(http_client.get(f"{sim.base_url}/_sim/log", params={"limit": 100_000}).json())


def _day_run(tmp_path: Path, job: str, day: dt.date) -> tuple[dict[str, str], str, list[Item]]:
    """The run's output (id -> text), its report line, and the items it submitted."""
    report = _wait_for(tmp_path / "out" / f"{job}-{day}.report").strip()
    out = (tmp_path / "out" / f"{job}-{day}.jsonl").read_text().splitlines()
    texts = {row["id"]: row["description"] for row in map(json.loads, out)}
    assert len(texts) == len(out)
    with db.session_scope() as s:
        items = s.scalars(
            select(Item)
            .join(Batch, Batch.id == Item.batch_id)
            .where(Batch.idempotency_key.startswith(f"nightly:{job}:{day}:"))
            .order_by(Item.id)
        ).all()
        s.expunge_all()
    return texts, report, list(items)


def _answers(items: list[Item]) -> dict[str, str]:
    """What the provider answered for each item that succeeded."""
    with db.session_scope() as s:
        rows = s.execute(
            select(Item.custom_id, Result.response)
            .join(Result, Result.item_id == Item.id)
            .where(Item.id.in_([i.id for i in items]))
        ).all()
    return {r.custom_id: r.response["choices"][0]["message"]["content"] for r in rows}


def _cost(items: list[Item]) -> Decimal:
    with db.session_scope() as s:
        total = s.scalar(
            select(func.sum(UsageLedger.cost_usd)).where(
                UsageLedger.item_id.in_([i.id for i in items])
            )
        )
    return Decimal(total or 0)


@pytest.mark.slow
def test_incremental_runs_call_only_changed_and_failed_products(
    clean_db, simulator, workers, tmp_path, restore_env
):
    """Day by day: a product whose request did not change since its last description is
    served that text, not called; a changed, new or yesterday's failed product is
    called; an opt-out job calls everything; a day with nothing to call has no batch
    and still writes its output and report."""
    from batchgen.tasks.nightly import nightly, start_run

    products = {f"p{i}": (f"Lamp {i}", f"{10 + i}.00") for i in range(10)}
    _write_catalog(tmp_path / "catalog.csv", products)
    os.environ.update(
        BATCHGEN_NIGHTLY_JOBS_FILE=str(_incremental_jobs(tmp_path)), BATCHGEN_NIGHTLY_POLL_S="0.3"
    )
    get_settings.cache_clear()
    workers(concurrency=8)
    make_tenant("acme")
    days = [dt.date(2030, 2, d) for d in range(1, 6)]

    nightly.apply(kwargs={"day": days[0].isoformat()}).get()
    first, report, items = _day_run(tmp_path, "lamps", days[0])
    assert len(items) == 10 and set(first) == set(products)
    assert " products=10 written=10 succeeded=10 " in report and " reused=0 " in report

    # Day 2: two products changed (price, name), one removed, one added; fired twice.
    products["p1"] = ("Lamp 1", "99.00")
    products["p2"] = ("Desk lamp 2", "12.00")
    del products["p3"]
    products["p10"] = ("Lamp 10", "20.00")
    _write_catalog(tmp_path / "catalog.csv", products)
    calls_before = _sim_calls(simulator)
    assert (
        nightly.apply(kwargs={"day": days[1].isoformat()}).get()
        == nightly.apply(kwargs={"day": days[1].isoformat()}).get()
    )
    second, report, items = _day_run(tmp_path, "lamps", days[1])
    all_texts, _, all_items = _day_run(tmp_path, "lamps-all", days[1])
    assert [i.custom_id for i in items] == ["p1", "p2", "p10"]
    assert len(all_items) == 10 and set(all_texts) == set(products)  # the opt-out job: all
    assert _sim_calls(simulator) - calls_before == 3 + 10  # nothing else reached the provider
    # The calls' texts, then the reused ones in catalog order; p3 is forgotten.
    assert list(second) == ["p1", "p2", "p10", "p0", "p4", "p5", "p6", "p7", "p8", "p9"]
    with db.session_scope() as s:
        known = s.scalars(select(NightlyProduct.product_id).where(NightlyProduct.job == "lamps"))
        assert set(known) == set(products)
    unchanged = set(products) - {"p1", "p2", "p10"}
    assert {p: second[p] for p in unchanged} == {p: first[p] for p in unchanged}
    assert {p: second[p] for p in ("p1", "p2", "p10")} == _answers(items)
    cost = _cost(items)
    assert cost > 0
    assert " products=10 written=10 succeeded=3 failed=0 " in report
    assert " reused=7 " in report and f" cost_usd={cost:.6f} " in report
    with db.session_scope() as s:  # fired twice, submitted once
        keys = s.scalars(
            select(Batch.idempotency_key).where(Batch.idempotency_key.like(f"%:{days[1]}:%"))
        ).all()
    assert sorted(keys) == [f"nightly:lamps-all:{days[1]}:0", f"nightly:lamps:{days[1]}:0"]

    # Day 3: p5 changed, and its call fails: it is left out of the output.
    products["p5"] = ("Lamp 5", "55.00")
    _write_catalog(tmp_path / "catalog.csv", products)
    sim_config(simulator.base_url, fault_rate=1.0, fault_kinds=["status:400"])
    try:
        start_run(days[2], "lamps")
        third, report, items = _day_run(tmp_path, "lamps", days[2])
    finally:
        sim_config(simulator.base_url, fault_rate=0.0)
    assert [i.custom_id for i in items] == ["p5"] and set(third) == set(products) - {"p5"}
    assert " products=10 written=9 succeeded=0 failed=1 " in report and " reused=9 " in report

    # Day 4: nothing changed, but p5 has no description for its request: called again.
    start_run(days[3], "lamps")
    fourth, report, items = _day_run(tmp_path, "lamps", days[3])
    assert [i.custom_id for i in items] == ["p5"] and set(fourth) == set(products)
    assert fourth["p5"] == _answers(items)["p5"] and " reused=9 " in report

    # Day 5: nothing to call: no batch, the output and the report all the same.
    calls_before = _sim_calls(simulator)
    assert start_run(days[4], "lamps") == {"lamps": []}
    fifth, report, items = _day_run(tmp_path, "lamps", days[4])
    assert items == [] and fifth == fourth and _sim_calls(simulator) == calls_before
    assert report == (
        f"nightly job=lamps date={days[4]} products=10 written=10 succeeded=0 failed=0 "
        "expired=0 cancelled=0 rejected=0 reused=10 prompt_tokens=0 completion_tokens=0 "
        "cost_usd=0.000000 batches="
    )


def test_overlapping_runs_never_serve_a_text_for_another_request(clean_db, tmp_path):
    """Runs submitted before the previous one was collected, collected out of order: a
    product's text is always the answer to the request it is served for, and a run's
    reused texts are those it chose, whatever later runs store meanwhile."""
    from batchgen.errors import Conflict, IdempotencyKeyReused
    from batchgen.nightly.reuse import record
    from batchgen.store import nightly as store
    from batchgen.store.schema import NightlyProduct

    make_tenant("acme")
    job = Job(
        name="j", tenant="acme", model="m", catalog=tmp_path / "c.csv", output=tmp_path / "o.csv"
    )
    d1, d2, d3, d4, d5 = (dt.date(2030, 3, d) for d in range(1, 6))

    def run(day, planned):  # submit: returns the reused products
        with db.session_scope() as s:
            key = store.RunKey.find(s, "acme", "j", day)
            return set(store.record_run(s, key, list(planned.items()), list(planned))[0])

    def collect(day, texts):  # collect: returns the output rows
        with db.session_scope() as s:
            key = store.RunKey.find(s, "acme", "j", day)
            store.store_descriptions(s, key, list(texts.items()))
            out = {**texts, **dict(store.reused_descriptions(s, key))}
            store.close_run(s, key)
        return out

    def stored():
        with db.session_scope() as s:
            rows = s.execute(select(NightlyProduct).order_by(NightlyProduct.product_id)).scalars()
            return {r.product_id: (r.request_sha256, r.description, r.pending_on) for r in rows}

    assert run(d1, {"a": "h1", "b": "hb"}) == set()
    assert run(d2, {"a": "h2", "b": "hb"}) == set()  # before d1 is collected: all again
    collect(d1, {"a": "A1", "b": "B1"})  # both are pending on d2: nothing stored
    assert stored() == {"a": (None, None, d2), "b": (None, None, d2)}
    collect(d2, {"a": "A2", "b": "B2"})
    assert stored() == {"a": ("h2", "A2", d2), "b": ("hb", "B2", d2)}
    assert run(d3, {"a": "h1", "b": "hb"}) == {"b"}  # a is back to d1's request: called
    assert run(d4, {"a": "h1", "b": "hb2"}) == set()  # d3 not collected yet
    assert collect(d4, {"a": "A4", "b": "B4"}) == {"a": "A4", "b": "B4"}
    assert collect(d3, {"a": "A3"}) == {"a": "A3", "b": "B2"}  # b as d3 chose it
    assert stored() == {"a": ("h1", "A4", d4), "b": ("hb2", "B4", d4)}

    assert run(d3, {"a": "h1", "b": "hb"}) == {"b"}  # fired again: the same choice ...
    assert stored()["a"][2] == d4  # ... and d4's pending request stays
    with pytest.raises(IdempotencyKeyReused, match="'b' changed"):
        record(job, d3, {"a": "h1", "b": "hb3"}, [])
    assert run(d5, {"a": "h1", "b": "hb2"}) == {"a", "b"}
    collect(d5, {})  # drops the reused texts of d3 (and d4): their runs are closed
    with pytest.raises(Conflict, match="closed"):
        run(d3, {"a": "h1", "b": "hb"})
    with db.session_scope() as s, pytest.raises(Conflict, match="closed"):  # nor collected
        store.recorded_reuse(s, store.RunKey.find(s, "acme", "j", d3))
    with db.session_scope() as s:
        assert store.recorded_reuse(s, store.RunKey.find(s, "acme", "j", d5)) == 2
        assert store.recorded_reuse(s, store.RunKey.find(s, "acme", "j", d4)) == 0
        assert store.recorded_reuse(s, store.RunKey.find(s, "acme", "x", d5)) is None
