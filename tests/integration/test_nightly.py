"""Nightly description jobs: beat firing twice submits one batch per job and date, the
worker writes the descriptions (file and table) and the one-line report."""

from __future__ import annotations

import csv
import datetime as dt
import json
import os
import time
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select, text

from batchgen import embedded
from batchgen.config import get_settings
from batchgen.errors import ConfigError, ValidationFailed
from batchgen.nightly import Job, PromptRenderer, load_jobs, output_table, submit_job
from batchgen.store import db
from batchgen.store.schema import Batch, Item, UsageLedger
from batchgen.worker.beat import cron_schedule
from tests.helpers import make_tenant, status_summary, wait_batches

pytestmark = pytest.mark.integration
DAY = "2030-01-02"
DAY1 = dt.date(2030, 1, 1)


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


def _wait_for(path: Path, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text()
        time.sleep(0.2)
    raise AssertionError(f"{path.name} not written after {timeout_s}s: {status_summary()}")


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
    worker.wait_ready()

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
        f"expired=0 cancelled=0 rejected=0 prompt_tokens={tokens[0]} completion_tokens={tokens[1]} "
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
    deadline = time.monotonic() + 30
    while True:  # the table job's collect runs on the worker too
        with shop_engine.connect() as conn:
            if shop_engine.dialect.has_table(conn, "product_descriptions"):
                rows = conn.execute(select(table).order_by(table.c.product_id)).all()
                if len(rows) == 30:
                    break
        assert time.monotonic() < deadline, "table output not written"
        time.sleep(0.2)
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
    deadline = time.monotonic() + 30
    while not (ended := _task_ended(worker.log_tail(400), sent.id)):
        assert time.monotonic() < deadline, worker.log_tail()
        time.sleep(0.1)
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
