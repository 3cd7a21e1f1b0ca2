"""``batchgen`` commands about batches: submit, watch, results, cancel, nightly run.

They act for a tenant named with ``--tenant`` (operator access to the
database, no API key), print results on stdout (``--json`` for scripts) and
progress on stderr, and never print prompt text.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer

from batchgen.atomic_files import replacing
from batchgen.cli.common import console, err, fail, handled, print_json, progress, services
from batchgen.domain.formats import message_batches
from batchgen.domain.lifecycle.status import Priority
from batchgen.domain.scheduling.offload import OffloadMode
from batchgen.domain.scheduling.routes import RouteMode

TENANT = typer.Option(..., "--tenant", "-t", help="The tenant's name.")
JSON = typer.Option(False, "--json", help="Print one JSON document for scripts.")
WAIT_TIMEOUT = typer.Option(0.0, "--timeout", help="Give up waiting after this many seconds.")


def _override_model(raw: bytes, model: str) -> bytes:
    """``raw`` with ``body.model`` replaced; a line that is no object passes unchanged,
    so admission still reports it with its line number."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(obj, dict) or not isinstance(obj.get("body"), dict):
        return raw
    obj["body"]["model"] = model
    return json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n"


def _file_lines(path: Path, model: str | None, advance: Callable[[int], Any]) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        for raw in fh:
            advance(len(raw))
            yield _override_model(raw, model) if model else raw


def _done(counts: dict[str, int]) -> int:
    return counts["total"] - counts["pending"] - counts["queued"] - counts["running"]


def _wait(batch_ids: list[str], tenant: str, interval_s: float, timeout_s: float) -> list[dict]:
    """Poll until every batch has ended, with a progress bar; returns their descriptions."""
    from batchgen import python_api

    deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
    with progress() as bar:
        task = bar.add_task("generating", total=None)
        while True:
            infos = [python_api.get_batch(b, tenant=tenant) for b in batch_ids]
            bar.update(
                task,
                total=sum(i["request_counts"]["total"] for i in infos),
                completed=sum(_done(i["request_counts"]) for i in infos),
            )
            if all(i["finished_at"] is not None for i in infos):
                return infos
            if deadline is not None and time.monotonic() > deadline:
                fail(f"still running after {timeout_s:g}s: {', '.join(batch_ids)}")
            time.sleep(interval_s)


def _summary(info: dict[str, Any]) -> str:
    c = info["request_counts"]
    return (
        f"{info['id']} {info['status']}: {c['total']} requests, {c['succeeded']} succeeded, "
        f"{c['failed']} failed, {c['expired']} expired, {c['cancelled']} cancelled"
    )


def _finish(info: dict[str, Any], as_json: bool) -> None:
    """Print a finished batch; exit 1 unless every item succeeded."""
    if as_json:
        print_json(info)
    else:
        console.print(_summary(info))
    c = info["request_counts"]
    if info["status"] != "completed" or c["failed"] or c["expired"]:
        raise typer.Exit(1)


def submit(
    file: Path = typer.Argument(
        ...,
        exists=True,
        dir_okay=False,
        readable=True,
        help="An OpenAI Batch input file (JSONL) or an Anthropic Message Batch file (JSONL of "
        '{custom_id, params}, or {"requests": [...]}); which one is detected.',
    ),
    tenant: str = TENANT,
    model: str | None = typer.Option(None, help="Use this model on every line (body.model)."),
    completion_window: str | None = typer.Option(
        None, help="Deadline of every item: 24h, 2h, 30m… (default: 24h, from settings)"
    ),
    priority: Priority = typer.Option(Priority.INTERACTIVE, help="interactive or bulk."),
    offload: OffloadMode = typer.Option(
        OffloadMode.AUTO,
        help="auto: bulk items go to the provider's Batch API when the model offloads and "
        "the deadline allows; never; always.",
    ),
    route: RouteMode = typer.Option(
        RouteMode.AUTO,
        help="auto: standard calls for near deadlines, flex calls where the model offers "
        "them and the deadline leaves room, the provider's Batch API for the rest; "
        "standard; flex; batch.",
    ),
    metadata: str | None = typer.Option(None, help="A JSON object stored with the batch."),
    idempotency_key: str | None = typer.Option(None, help="Resubmitting returns the same batch."),
    wait: bool = typer.Option(
        False, "--wait", help="Wait for the batch to end (exit 1 if any item failed or expired)."
    ),
    interval: float = typer.Option(1.0, help="Seconds between checks with --wait."),
    timeout: float = WAIT_TIMEOUT,
    as_json: bool = JSON,
) -> None:
    """Submit a JSONL file as one batch (validated whole: all lines or nothing)."""
    from batchgen import python_api

    meta = None
    if metadata is not None:
        try:
            meta = json.loads(metadata)
        except json.JSONDecodeError as exc:
            raise typer.BadParameter("not valid JSON", param_hint="--metadata") from exc
    with services(), handled(as_json):
        with open(file, "rb") as fh:
            kind = message_batches.sniff_format(fh.read(64 * 1024))
        if kind == message_batches.ANTHROPIC_FORMAT:
            requests = message_batches.parse_requests(file.read_bytes())
            if model:
                for entry in requests:
                    if isinstance(entry, dict) and isinstance(entry.get("params"), dict):
                        entry["params"]["model"] = model
            created, _ = python_api.create_message_batch(
                requests,
                tenant=tenant,
                completion_window=completion_window,
                metadata=meta,
                idempotency_key=idempotency_key,
                priority=priority,
                offload=offload,
                route=route,
            )
            batch = python_api.get_batch(created["id"], tenant=tenant)
        else:
            with progress() as bar:
                task = bar.add_task(f"reading {file.name}", total=file.stat().st_size)
                batch = python_api.submit_batch(
                    _file_lines(file, model, lambda n: bar.advance(task, n)),
                    tenant=tenant,
                    completion_window=completion_window,
                    metadata=meta,
                    idempotency_key=idempotency_key,
                    priority=priority,
                    offload=offload,
                    route=route,
                )
        if wait:
            # Said before the wait: interrupted, the batch runs on and its id is known.
            err.print(
                f"submitted: {batch['request_counts']['total']} requests as {batch['id']}; "
                "waiting (Ctrl-C stops waiting, not the batch)"
            )
            (batch,) = _wait([batch["id"]], tenant, interval, timeout)
            _finish(batch, as_json)
            return
    if as_json:
        print_json(batch)
    else:
        err.print(f"submitted: {batch['request_counts']['total']} requests")
        console.print(batch["id"])


def watch(
    batch_id: str = typer.Argument(..., metavar="BATCH"),
    tenant: str = TENANT,
    interval: float = typer.Option(1.0, help="Seconds between checks."),
    timeout: float = WAIT_TIMEOUT,
    as_json: bool = JSON,
) -> None:
    """Follow a batch until it ends (exit 1 if any item failed or expired)."""
    with services(), handled(as_json):
        (info,) = _wait([batch_id], tenant, interval, timeout)
    _finish(info, as_json)


def results(
    batch_id: str = typer.Argument(..., metavar="BATCH"),
    tenant: str = TENANT,
    output: Path = typer.Option(..., "--output", "-o", help="JSONL file to write; '-': stdout."),
    as_json: bool = JSON,
) -> None:
    """Write the finished items' results (OpenAI Batch output format) to a file."""
    from batchgen import python_api

    to_stdout = str(output) == "-"
    if to_stdout and as_json:
        raise typer.BadParameter("--json needs a file, not '-'", param_hint="--output")
    with services(), handled(as_json):
        counts = python_api.get_batch(batch_id, tenant=tenant)["request_counts"]
        rows = python_api.iter_results(batch_id, tenant=tenant)
        if to_stdout:
            for row in rows:
                typer.echo(json.dumps(row, ensure_ascii=False))
            return
        written = _write_jsonl(output, rows, _done(counts))
    if as_json:
        print_json({"batch": batch_id, "path": str(output), "written": written})
    else:
        console.print(f"{written} results written to {output}")


def _write_jsonl(path: Path, rows: Iterator[dict[str, Any]], total: int) -> int:
    """Write through a temporary file, so a failure leaves no half-written file behind."""
    written = 0
    with replacing(path) as fh, progress() as bar:
        task = bar.add_task("writing results", total=total)
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            written += 1
            bar.advance(task)
    return written


def cancel(
    batch_id: str = typer.Argument(..., metavar="BATCH"), tenant: str = TENANT, as_json: bool = JSON
) -> None:
    """Cancel a batch: items not yet running end now; running calls are stopped."""
    from batchgen import python_api

    with services(), handled(as_json):
        info = python_api.cancel_batch(batch_id, tenant=tenant)
    if as_json:
        print_json(info)
    else:
        console.print(_summary(info))


def nightly_run(
    date: str | None = typer.Option(None, "--date", help="YYYY-MM-DD; default: today (UTC)."),
    job: str | None = typer.Option(None, "--job", help="Only this job of the jobs file."),
    jobs_file: Path | None = typer.Option(
        None,
        exists=True,
        dir_okay=False,
        help="Default: BATCHGEN_NIGHTLY_JOBS_FILE. Another file needs --wait.",
    ),
    wait: bool = typer.Option(
        False, "--wait", help="Wait for the batches, write the output here, print the report."
    ),
    interval: float = typer.Option(2.0, help="Seconds between checks with --wait."),
    timeout: float = WAIT_TIMEOUT,
    as_json: bool = JSON,
) -> None:
    """Run the nightly description jobs for a date by hand (submits once per job and date).

    Without --wait the dispatcher writes the output once the batches end, from the
    jobs of its own BATCHGEN_NIGHTLY_JOBS_FILE (so --jobs-file must be that file).
    """
    from batchgen.nightly import collect_job, jobs_from_settings, select_jobs, submit_job

    try:
        day = dt.date.fromisoformat(date) if date else dt.datetime.now(dt.UTC).date()
    except ValueError as exc:
        raise typer.BadParameter("expected YYYY-MM-DD", param_hint="--date") from exc
    with services() as settings, handled(as_json):
        configured = settings.nightly.jobs_file
        if not wait and jobs_file and not _same_file(jobs_file, configured):
            # Workers write a run's output from their own BATCHGEN_NIGHTLY_JOBS_FILE
            # (messages carry no paths): another jobs file is collected here, with --wait.
            fail(
                f"--jobs-file {jobs_file} is not BATCHGEN_NIGHTLY_JOBS_FILE ({configured}): "
                "the workers would not find its jobs; add --wait to write the output here",
                2,
            )
        jobs = select_jobs(jobs_from_settings(jobs_file), job)
        runs: dict[str, list[str]] = {}
        for j in jobs:
            with err.status(f"submitting {j.name}"):
                runs[j.name], created = submit_job(j, day)
            err.print(f"{j.name}: {'submitted' if created else 'already submitted'}")
        if not wait:
            from batchgen.worker import publish

            for name in runs:
                publish.collect_later(name, day.isoformat(), settings.nightly.poll_s)
            if as_json:
                print_json({"date": day.isoformat(), "batches": runs})
            else:
                for name, ids in runs.items():
                    console.print(f"{name} {day} {' '.join(ids)}", highlight=False)
            return
        reports = []
        for j in jobs:
            _wait(runs[j.name], j.tenant, interval, timeout)
            report = collect_job(j, day)
            assert report is not None  # every batch has ended
            reports.append(report)
    if as_json:
        print_json([r.as_dict() for r in reports])
    else:
        for r in reports:
            console.print(r.line(), highlight=False)


def _same_file(path: Path, other: Path | None) -> bool:
    return other is not None and path.resolve() == other.resolve()


def register(cli: typer.Typer) -> None:
    """Add these commands (and ``nightly run``) to the root command."""
    for command in (submit, watch, results, cancel):
        cli.command()(command)
    nightly_cli = typer.Typer(no_args_is_help=True, help="Nightly description jobs.")
    nightly_cli.command("run")(nightly_run)
    cli.add_typer(nightly_cli, name="nightly")
