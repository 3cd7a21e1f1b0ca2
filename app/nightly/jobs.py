"""The nightly jobs file: which catalogs to describe, how, and where to write."""

from __future__ import annotations

import datetime as dt
import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from batchgen.config import get_settings
from batchgen.domain.scheduling.offload import OffloadMode
from batchgen.domain.scheduling.routes import RouteMode
from batchgen.errors import ConfigError, NotFound


class TableRef(BaseModel):
    """A SQL table: in batchgen's database unless ``url`` or ``url_env`` names another."""

    model_config = ConfigDict(extra="forbid")

    table: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$")
    url: str | None = None
    url_env: str | None = None

    def sqlalchemy_url(self) -> str:
        url = self.url or (os.environ.get(self.url_env) if self.url_env else None)
        if self.url_env and not url:
            raise ConfigError(f"table {self.table}: environment variable {self.url_env} is unset")
        if not url:
            return get_settings().sqlalchemy_url
        for prefix in ("postgresql://", "postgres://"):
            if url.startswith(prefix):
                return "postgresql+psycopg://" + url[len(prefix) :]
        return url


class Job(BaseModel):
    """One nightly job of the jobs file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
    tenant: str
    model: str
    catalog: Path | TableRef
    output: Path | TableRef
    id_column: str = "id"
    template: Path | None = None
    system: str | None = None
    tone: str = "neutral"
    locale: str = "en-US"
    max_tokens: PositiveInt = 300
    completion_window: str | None = None  # None: default_completion_window_s
    # auto: to the provider's Batch API at the batch price when the model offloads and
    # the window allows (batchgen.domain.scheduling.offload); never; always.
    offload: OffloadMode = OffloadMode.AUTO
    # auto: standard, flex or the provider's Batch API by the window and the model's
    # routes (batchgen.domain.scheduling.routes); standard; flex; batch.
    route: RouteMode = RouteMode.AUTO
    # A product whose request has not changed since its last description is served
    # that text, not called again (batchgen.nightly.runs); false: every run calls all.
    incremental: bool = True
    report: Path | None = None
    rejects: Path | None = None

    @model_validator(mode="after")
    def _file_kinds(self) -> Job:
        for name in ("catalog", "output"):
            value = getattr(self, name)
            if isinstance(value, Path) and value.suffix.lower() not in (".csv", ".jsonl"):
                raise ValueError(f"{name}: a .csv or .jsonl file or a {{ table = ... }}")
        if self.rejects is not None and self.rejects.suffix.lower() != ".jsonl":
            raise ValueError("rejects: a .jsonl file")
        return self

    def rejects_path(self, day: dt.date) -> Path:
        """Where a run's rejected catalog rows go: ``rejects``, else beside a file output
        (``<output>.rejects.jsonl``), else in the data folder."""
        if self.rejects is not None:
            template = self.rejects
        elif isinstance(self.output, Path):
            template = self.output.with_suffix(".rejects.jsonl")
        else:
            template = (
                get_settings().paths.data_dir.resolve() / "nightly" / "{job}-{date}.rejects.jsonl"
            )
        return self.path(template, day)

    def key_prefix(self, day: dt.date) -> str:
        """The idempotency keys of this job's batches for ``day`` start with this."""
        return f"nightly:{self.name}:{day.isoformat()}:"

    def path(self, template: Path, day: dt.date) -> Path:
        return Path(str(template).format(job=self.name, date=day.isoformat()))


def load_jobs(path: Path | str) -> list[Job]:
    """Read and validate a jobs file; relative paths become relative to its folder."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the jobs file: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    raw_jobs = data.get("jobs")
    if not isinstance(raw_jobs, list) or not raw_jobs:
        raise ConfigError(f"{path}: no [[jobs]] tables")
    jobs: list[Job] = []
    for i, raw in enumerate(raw_jobs):
        label = raw.get("name", f"#{i + 1}") if isinstance(raw, dict) else f"#{i + 1}"
        try:
            job = Job.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-"))
            raise ConfigError(f"{path}: job {label!r}: {loc}: {first['msg']}") from exc
        jobs.append(_resolve(job, path.parent.resolve()))
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: job names must be unique")
    return jobs


def _resolve(job: Job, base: Path) -> Job:
    updates: dict[str, Any] = {}
    for name in ("catalog", "output", "template", "report", "rejects"):
        value = getattr(job, name)
        if isinstance(value, Path) and not value.is_absolute():
            updates[name] = base / value
    return job.model_copy(update=updates)


def select_jobs(jobs: list[Job], only: str | None) -> list[Job]:
    """All jobs, or the one named ``only`` (:class:`NotFound` if there is none)."""
    if only is None:
        return jobs
    chosen = [j for j in jobs if j.name == only]
    if not chosen:
        raise NotFound(f"no nightly job named {only!r}; known: {[j.name for j in jobs]}")
    return chosen


def jobs_from_settings(jobs_file: Path | str | None = None) -> list[Job]:
    """The jobs of ``jobs_file`` (a local command's choice) or of ``BATCHGEN_NIGHTLY_JOBS_FILE``."""
    path = jobs_file or get_settings().nightly.jobs_file
    if not path:
        raise ConfigError("no jobs file: set BATCHGEN_NIGHTLY_JOBS_FILE")
    return load_jobs(path)
