"""Reading a catalog (CSV, JSONL or a SQL table) and rendering one request per product."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from sqlalchemy import MetaData, Table, create_engine, select

from app.errors import ConfigError, ValidationFailed
from app.nightly.jobs import Job, TableRef

DEFAULT_TEMPLATE = """\
Write a {{ tone }} product description in the language of locale {{ locale }}.
Product: {{ product.name | default(product[id_column]) }}
{% for key, value in product.items() if key not in (id_column, "name") and value -%}
{{ key }}: {{ value }}
{% endfor -%}
Answer with the description only."""


def read_catalog(job: Job) -> Iterator[dict[str, Any]]:
    """The catalog's products as dicts, in file or key order."""
    if isinstance(job.catalog, TableRef):
        yield from _read_table(job.catalog, job.id_column)
        return
    try:
        with open(job.catalog, encoding="utf-8-sig", newline="") as fh:
            if job.catalog.suffix.lower() == ".csv":
                yield from csv.DictReader(fh)
                return
            for n, line in enumerate(fh, start=1):
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise ValidationFailed(
                            f"catalog {job.catalog.name}: line {n}: not an object"
                        )
                    yield row
    except OSError as exc:
        raise ConfigError(f"catalog {job.catalog}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ValidationFailed(f"catalog {job.catalog.name}: line {exc.lineno}: bad JSON") from exc


def _read_table(ref: TableRef, id_column: str) -> Iterator[dict[str, Any]]:
    engine = create_engine(ref.sqlalchemy_url())
    try:
        schema, _, name = ref.table.rpartition(".")
        table = Table(name, MetaData(), schema=schema or None, autoload_with=engine)
        if id_column not in table.c:
            raise ConfigError(f"catalog table {ref.table} has no column {id_column!r}")
        query = select(table).order_by(table.c[id_column]).execution_options(yield_per=1000)
        with engine.connect() as conn:
            for row in conn.execute(query):
                yield dict(row._mapping)
    finally:
        engine.dispose()


@dataclass
class PromptRenderer:
    """Renders a job's template (sandboxed, undefined names are errors) for one product."""

    job: Job
    _template: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from jinja2 import StrictUndefined, TemplateError
        from jinja2.sandbox import SandboxedEnvironment

        env = SandboxedEnvironment(undefined=StrictUndefined, autoescape=False)
        try:
            source = self.job.template.read_text("utf-8") if self.job.template else None
            self._template = env.from_string(source or DEFAULT_TEMPLATE)
        except OSError as exc:
            raise ConfigError(f"template {self.job.template}: {exc.strerror}") from exc
        except TemplateError as exc:
            raise ConfigError(f"template {self.job.template}: {exc}") from exc

    def request(self, product: dict[str, Any], n: int) -> dict[str, Any]:
        """The OpenAI Batch request line for product number ``n`` (1-based)."""
        from jinja2 import TemplateError

        key = product.get(self.job.id_column)
        if key is None or str(key) == "":
            raise ValidationFailed(f"catalog product {n}: no {self.job.id_column!r} value")
        try:
            prompt = self._template.render(
                product=product,
                tone=self.job.tone,
                locale=self.job.locale,
                job=self.job.name,
                id_column=self.job.id_column,
            )
        except TemplateError as exc:  # the message names the variable, not the product text
            raise ValidationFailed(f"template, product {key}: {exc}") from exc
        messages = [{"role": "system", "content": self.job.system}] if self.job.system else []
        messages.append({"role": "user", "content": prompt.strip()})
        return {
            "custom_id": str(key),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": self.job.model,
                "max_tokens": self.job.max_tokens,
                "messages": messages,
            },
        }


def chunks(rows: Iterable[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    it = iter(rows)
    while chunk := list(islice(it, size)):
        yield chunk
