"""Nightly description jobs: a product catalog → prompts → a bulk batch per job and day.

A job reads a catalog (a CSV or JSONL file, or rows of a SQL table), renders
one prompt per product from a Jinja2 template (tone and locale per job),
submits them with priority ``bulk`` under the idempotency key
``nightly:<job>:<date>:<part>`` (so a beat that fires twice submits once), and
when the batches have ended writes the descriptions to a JSONL/CSV file or a
table and logs a one-line report. The jobs live in a TOML file
(``BATCHGEN_NIGHTLY_JOBS_FILE``); relative paths are relative to that file::

    [[jobs]]
    name = "shop-en"
    tenant = "acme"
    model = "sim-small"
    catalog = "catalog.csv"                 # or "products.jsonl", or a table:
    # catalog = { table = "products", url_env = "SHOP_DATABASE_URL" }
    id_column = "id"                        # the product key, also the custom_id
    template = "description.j2"             # optional: DEFAULT_TEMPLATE otherwise
    tone = "friendly"
    locale = "en-US"
    max_tokens = 200
    output = "out/{job}-{date}.jsonl"       # .jsonl or .csv, or { table = "..." }
    report = "out/{job}-{date}.report"      # optional: the report line, also logged
    rejects = "out/{job}-{date}.rejects.jsonl"  # optional: rows left out (see below)
    incremental = true                      # default; false: call every product each run

A catalog row that cannot make a prompt is not submitted (so not billed): a
value the template prints or computes with is missing or empty (``None``,
``""``, blanks; ``{% if product.x %}`` may test for it), the row has more
fields than the CSV header, or a JSONL line is not a JSON object. It goes to
the rejects file, one JSON object a line: ``{"line": <source line, or a
table's row number in key order>, "id": <product key or null>, "reason":
"missing or empty column 'price'"}`` (no other value of the row), and the
rest of the job runs. Default: beside a file output
(``<output>.rejects.jsonl``), else ``$BATCHGEN_DATA_DIR/nightly/``. The
report line counts them (``rejected=N``).

An incremental job (the default) calls only the products whose request changed
since their last description: the SHA-256 of the request's canonical JSON (model,
messages, ``max_tokens``, every parameter; so a new price, name, template, tone,
locale or model counts) is compared with the one stored with the text. The others
are served that text at no provider cost; a run with nothing to call has no batch
and still writes its output and report. The choice is recorded once per job and
date (``nightly_runs``, ``nightly_reused``: a second submit replays it), and a run's
results become the stored texts of the products it was the last to submit
(``nightly_products``). The output is the run's descriptions, then the reused ones;
the report counts them (``reused=N``; ``products`` is both, tokens and cost those
of the calls made). A failed product keeps no text, so the next run calls it.

A table without ``url``/``url_env`` is in batchgen's own database. An output
table is created if missing (``product_id, job, run_date, locale,
description``); a run replaces its own rows.
"""

from batchgen.nightly.catalog import DEFAULT_TEMPLATE, PromptRenderer, Reject, read_catalog
from batchgen.nightly.jobs import (
    Job,
    TableRef,
    jobs_from_settings,
    load_jobs,
    select_jobs,
)
from batchgen.nightly.runs import RunReport, collect_job, run_batch_ids, submit_job
from batchgen.store.host_tables import descriptions_table as output_table

__all__ = [
    "DEFAULT_TEMPLATE",
    "Job",
    "PromptRenderer",
    "Reject",
    "RunReport",
    "TableRef",
    "collect_job",
    "jobs_from_settings",
    "load_jobs",
    "output_table",
    "read_catalog",
    "run_batch_ids",
    "select_jobs",
    "submit_job",
]
