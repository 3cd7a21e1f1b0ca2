"""Reading a catalog (CSV, JSONL or a SQL table) and rendering one request per product."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from batchgen.errors import ConfigError, ValidationFailed
from batchgen.nightly.jobs import Job, TableRef
from batchgen.store import host_tables

DEFAULT_TEMPLATE = """\
Write a {{ tone }} product description in the language of locale {{ locale }}.
Product: {{ product.name | default(product[id_column]) }}
{% for key, value in product.items() if key not in (id_column, "name") and value -%}
{{ key }}: {{ value }}
{% endfor -%}
Answer with the description only."""


@dataclass(frozen=True)
class Reject:
    """A catalog row left out of the run: its source line (a table's row number in key
    order), its product key if it has one, and why. No other value of the row."""

    line: int
    id: str | None
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"line": self.line, "id": self.id, "reason": self.reason}


#: A catalog row as read: its line and its values, or its line and what is wrong with it.
SourceRow = tuple[int, dict[str, Any] | str]


def read_catalog(job: Job) -> Iterator[SourceRow]:
    """The catalog's rows in file or key order, each with its source line number."""
    if isinstance(job.catalog, TableRef):
        yield from enumerate(_read_table(job.catalog, job.id_column), start=1)
        return
    try:
        with open(job.catalog, encoding="utf-8-sig", newline="") as fh:
            if job.catalog.suffix.lower() == ".csv":
                yield from _csv_rows(fh)
            else:
                yield from _jsonl_rows(fh)
    except OSError as exc:
        raise ConfigError(f"catalog {job.catalog}: {exc.strerror}") from exc


class _LineCounter:
    """Iterates a file's lines, counting them (the csv module reads only what a row needs)."""

    def __init__(self, lines: Iterable[str]) -> None:
        self._lines = iter(lines)
        self.count = 0

    def __iter__(self) -> _LineCounter:
        return self

    def __next__(self) -> str:
        line = next(self._lines)
        self.count += 1
        return line


def _csv_rows(fh: Iterable[str]) -> Iterator[SourceRow]:
    counter = _LineCounter(fh)
    reader = csv.reader(counter)
    header = next(reader, None)
    while header is not None:
        first_line = counter.count + 1  # a quoted field may span several lines
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            yield first_line, f"bad CSV: {exc}"
            continue
        if not fields:
            continue  # a blank line
        if len(fields) > len(header):
            yield first_line, f"{len(fields)} fields, the header has {len(header)}"
            continue
        yield first_line, dict(zip(header, fields, strict=False))  # short: columns missing


def _jsonl_rows(fh: Iterable[str]) -> Iterator[SourceRow]:
    for n, line in enumerate(fh, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            yield n, "bad JSON"
            continue
        yield n, row if isinstance(row, dict) else "not a JSON object"


def _read_table(ref: TableRef, id_column: str) -> Iterator[dict[str, Any]]:
    return host_tables.read_rows(ref.sqlalchemy_url(), ref.table, id_column)


def present(product: dict[str, Any]) -> dict[str, Any]:
    """The product without its empty values: ``None`` and blank strings count as missing."""
    return {
        k: v
        for k, v in product.items()
        if v is not None and not (isinstance(v, str) and not v.strip())
    }


def _missing_value_class() -> type:
    from jinja2 import Undefined

    class MissingValue(Undefined):
        """A missing or empty value: false in ``{% if %}``, an error once printed or used."""

        __slots__ = ()
        __str__ = Undefined._fail_with_undefined_error  # type: ignore[assignment]

        @property
        def _undefined_message(self) -> str:
            if isinstance(self._undefined_obj, dict) and isinstance(self._undefined_name, str):
                return f"missing or empty column {self._undefined_name!r}"
            return str(super()._undefined_message)

    return MissingValue


@dataclass
class PromptRenderer:
    """Renders a job's template (sandboxed) for one product. A value the template prints
    or computes with that is missing or empty rejects the product (:class:`Reject`)."""

    job: Job
    _template: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import SandboxedEnvironment

        env = SandboxedEnvironment(undefined=_missing_value_class(), autoescape=False)
        try:
            source = self.job.template.read_text("utf-8") if self.job.template else None
            self._template = env.from_string(source or DEFAULT_TEMPLATE)
        except OSError as exc:
            raise ConfigError(f"template {self.job.template}: {exc.strerror}") from exc
        except TemplateError as exc:
            raise ConfigError(f"template {self.job.template}: {exc}") from exc

    def render(self, row: SourceRow) -> dict[str, Any] | Reject:
        """The OpenAI Batch request line for a catalog row, or why the row is left out."""
        line, values = row
        if isinstance(values, str):
            return Reject(line, None, values)
        try:
            return self.request(values)
        except ValidationFailed as exc:
            key = present(values).get(self.job.id_column)
            return Reject(line, None if key is None else str(key), str(exc))

    def request(self, values: dict[str, Any]) -> dict[str, Any]:
        """The request line for a product (:class:`ValidationFailed` if it cannot render)."""
        from jinja2 import TemplateError, UndefinedError

        product = present(values)
        if product.get(self.job.id_column) is None:
            raise ValidationFailed(f"no {self.job.id_column!r} value")
        try:
            prompt = self._template.render(
                product=product,
                tone=self.job.tone,
                locale=self.job.locale,
                job=self.job.name,
                id_column=self.job.id_column,
            )
        except UndefinedError as exc:  # names the column, not the product's text
            raise ValidationFailed(str(exc)) from exc
        except TemplateError as exc:
            raise ValidationFailed(f"template: {exc}") from exc
        messages = [{"role": "system", "content": self.job.system}] if self.job.system else []
        messages.append({"role": "user", "content": prompt.strip()})
        return {
            "custom_id": str(product[self.job.id_column]),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": self.job.model,
                "max_tokens": self.job.max_tokens,
                "messages": messages,
            },
        }


def requests(job: Job, renderer: PromptRenderer, rejects: list[Reject]) -> Iterator[dict[str, Any]]:
    """The request lines of the catalog's rows in order; a row that cannot make one is
    added to ``rejects`` instead."""
    for row in read_catalog(job):
        rendered = renderer.render(row)
        if isinstance(rendered, Reject):
            rejects.append(rendered)
        else:
            yield rendered


def chunks(rows: Iterable[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    it = iter(rows)
    while chunk := list(islice(it, size)):
        yield chunk


def parts(
    lines: Iterable[dict[str, Any]], max_lines: int, max_bytes: int
) -> Iterator[list[dict[str, Any]]]:
    """A run's request lines as batches: at most ``max_lines`` lines and ``max_bytes``
    of JSON each (a long shared system prompt makes a part's text large long before
    its line count is), in order. A line larger than ``max_bytes`` goes alone (and
    admission names it)."""
    part: list[dict[str, Any]] = []
    size = 0
    for line in lines:
        line_bytes = len(json.dumps(line)) + 1
        if part and (len(part) >= max_lines or size + line_bytes > max_bytes):
            yield part
            part, size = [], 0
        part.append(line)
        size += line_bytes
    if part:
        yield part
