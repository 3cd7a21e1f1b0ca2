"""The ``batchgen`` command line (Typer). Service commands start embedded
PostgreSQL and Redis when ``DATABASE_URL`` / ``REDIS_URL`` are unset.

Exit codes: 0 ok, 1 error, 2 wrong usage. ``--json`` prints one JSON document."""

from __future__ import annotations

import sys

import typer
from rich.table import Table

from batchgen.cli.batch_commands import register as register_batch_commands
from batchgen.cli.common import (
    JsonErrorsGroup,
    console,
    err,
    fail,
    handled,
    print_error,
    print_json,
)
from batchgen.cli.common import services as _services
from batchgen.cli.ops import register as register_ops_commands
from batchgen.cli.tenant_commands import register as register_admin_commands
from batchgen.config import get_settings
from batchgen.errors import BatchgenError
from batchgen.registry import ChargePolicy

cli = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__, cls=JsonErrorsGroup)
tenants_cli = typer.Typer(
    no_args_is_help=True, help="Create, list, change, suspend and resume tenants."
)
db_cli = typer.Typer(no_args_is_help=True, help="Database schema (Alembic).")
cli.add_typer(tenants_cli, name="tenants")
cli.add_typer(db_cli, name="db")
register_batch_commands(cli)  # submit, watch, results, cancel, nightly run
register_ops_commands(cli)  # usage, status, doctor
register_admin_commands(cli, tenants_cli)  # keys, audit, admin, tenants update/suspend/resume
JSON = typer.Option(False, "--json", help="Print one JSON document for scripts.")


def _print_version(value: bool) -> None:
    if value:
        from batchgen import __version__

        console.print(f"batchgen {__version__}")
        raise typer.Exit()


@cli.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print the installed version and exit.",
    ),
) -> None:
    # The group's help is the module docstring (typer.Typer(help=...)).
    del version


def _fail(exc: BatchgenError, code: int = 1) -> None:
    fail(str(exc), code)


@db_cli.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Apply migrations (creates the schema on an empty database)."""
    from alembic.util import CommandError

    from batchgen.store import db

    with _services():
        try:
            db.upgrade(revision=revision)
        except CommandError as exc:
            fail(f"migration: {exc}")
    console.print(f"database at {revision}")


@tenants_cli.command("create")
def tenants_create(
    name: str,
    weight: int = typer.Option(1, min=1, help="Share of capacity relative to other tenants."),
    max_pending_items: int | None = typer.Option(
        None, min=1, help="At most this many open items (more: 429)."
    ),
    daily_token_quota: int | None = typer.Option(
        None, min=1, help="At most this many tokens per UTC day (more: 429)."
    ),
    tokens_per_min: int | None = typer.Option(
        None, min=1, help="The tenant's own token budget per minute, across models."
    ),
    max_files: int | None = typer.Option(
        None, min=1, help="Uploads kept at most (default BATCHGEN_TENANT_MAX_FILES)."
    ),
    max_file_bytes: int | None = typer.Option(
        None, min=1, help="Bytes of uploads kept at most (BATCHGEN_TENANT_MAX_FILE_BYTES)."
    ),
    admin_: bool = typer.Option(
        False, "--admin/--no-admin", help="May read every tenant's batches and usage."
    ),
    webhook_url: str | None = typer.Option(
        None, help="Where its batches' ends are POSTed, signed (unless a batch names its own)."
    ),
    as_json: bool = JSON,
) -> None:
    """Create a tenant and print its first API key, ``default``, with every scope (shown
    this once; only a hash is kept). More keys: ``batchgen keys create``."""
    from batchgen import tenant_admin
    from batchgen.cli.tenant_commands import actor

    with _services(), handled(as_json):
        made = tenant_admin.create_tenant(
            name,
            actor=actor(),
            weight=weight,
            max_pending_items=max_pending_items,
            daily_token_quota=daily_token_quota,
            tokens_per_min=tokens_per_min,
            is_admin=admin_,
            webhook_url=webhook_url,
            max_files=max_files,
            max_file_bytes=max_file_bytes,
        )
    key, secret = made["api_key"], made["webhook_secret"]
    if as_json:
        print_json(
            {
                "id": made["id"],
                "name": made["name"],
                "api_key": key["secret"],
                "key_id": key["id"],
                "webhook_secret": secret,
            }
        )
    else:
        err.print(f"tenant {name} (id {made['id']}) created; webhook secret {secret}")
        err.print(f"API key {key['id']} (default, every scope), shown once:")
        print(key["secret"])


@tenants_cli.command("webhook")
def tenants_webhook(
    name: str,
    url: str | None = typer.Option(None, help="Set the tenant's webhook URL."),
    rotate: bool = typer.Option(False, "--rotate", help="Give it a new signing secret."),
    as_json: bool = JSON,
) -> None:
    """Show (or set) a tenant's webhook URL and the secret its deliveries are signed with."""
    from batchgen.store import db, tenants

    with _services(), handled(as_json), db.session_scope() as session:
        current, secret = tenants.set_webhook(session, name, url, rotate=rotate)
    if as_json:
        print_json({"name": name, "webhook_url": current, "webhook_secret": secret})
    else:
        print(f"webhook_url {current or '-'}\nwebhook_secret {secret}")


@tenants_cli.command("list")
def tenants_list(as_json: bool = JSON) -> None:
    """List tenants (their keys: ``batchgen keys list NAME``)."""
    from batchgen import tenant_admin

    with _services(), handled(as_json):
        rows = [{**t, "revoked": t["suspended"]} for t in tenant_admin.list_tenants()]
    if as_json:
        print_json(rows)
        return
    table = Table("id", "name", "weight", "open items", "tokens/day", "tokens/min", "suspended")
    for r in rows:
        limits = [r[k] for k in ("max_pending_items", "daily_token_quota", "tokens_per_min")]
        cells = ["" if v is None else str(v) for v in limits]
        suspended = "yes" if r["suspended"] else ""
        table.add_row(str(r["id"]), str(r["name"]), str(r["weight"]), *cells, suspended)
    console.print(table)


@tenants_cli.command("revoke")
def tenants_revoke(name: str, as_json: bool = JSON) -> None:
    """Suspend a tenant: none of its keys works (401); its batches stay. The same as
    ``tenants suspend``; to stop one key, ``batchgen keys revoke``."""
    from batchgen import tenant_admin
    from batchgen.cli.tenant_commands import actor

    with _services(), handled(as_json):
        tenant_admin.suspend_tenant(name, actor=actor())
    if as_json:
        print_json({"name": name, "revoked": True})
    else:
        console.print(f"tenant {name}: suspended (every key refused)")


@cli.command()
def models(as_json: bool = JSON) -> None:
    """Show the model registry."""
    from batchgen.registry import get_registry

    with handled():
        specs = list(get_registry())
    if as_json:
        print_json([s.model_dump(mode="json") for s in specs])
        return
    columns = ["model", "provider", "queue", "tokens/min", "requests/min", "concurrency"]
    table = Table(*columns, "$ in/1M", "$ out/1M")
    for s in specs:
        table.add_row(
            s.name,
            s.provider,
            s.queue,
            str(s.tokens_per_min),
            str(s.requests_per_min),
            str(s.max_concurrency),
            str(s.input_usd_per_1m),
            str(s.output_usd_per_1m),
        )
    console.print(table)


def _beat_schedule_file() -> str:
    """Beat's state file, in the data folder (the working directory may be read-only)."""
    data_dir = get_settings().paths.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    return str(data_dir / "celerybeat-schedule")


# Celery finds the task modules by name, as ``celery -A batchgen.tasks`` does: the
# library never imports batchgen.tasks.
TASKS_APP = "batchgen.tasks"


def _celery(argv: list[str]) -> None:
    """Run ``celery -A batchgen.tasks <argv>`` in this process."""
    from celery.bin.celery import celery as celery_command
    from click.exceptions import Exit

    try:
        celery_command.main(args=["-A", TASKS_APP, *argv], standalone_mode=False)
    except Exit as exc:
        if exc.exit_code:
            raise typer.Exit(exc.exit_code) from exc


def _celery_worker(queues: list[str], concurrency: int, beat: bool, name: str) -> None:
    from batchgen.worker.procs import WORKER_POOL

    argv = ["worker", "-Q", ",".join(queues), "-P", WORKER_POOL, "-c", str(concurrency)]
    argv += ["-n", f"{name}@%h", "--loglevel", get_settings().log.level]
    if beat:
        argv += ["-B", "-s", _beat_schedule_file()]
    _celery(argv)


@cli.command()
def worker(
    group: list[str] = typer.Option(
        None, "--group", "-g", help="Model group(s) to serve; default: all."
    ),
    concurrency: int = typer.Option(0, help="Threads; default BATCHGEN_WORKER_CONCURRENCY."),
    pool: str = typer.Option("threads", "--pool", "-P", help="Celery pool: threads only."),
) -> None:
    """A Celery worker (thread pool) for one or more model groups."""
    from batchgen.registry import get_registry
    from batchgen.worker.procs import pool_error

    refused = pool_error(pool)
    if refused:
        fail(refused, 2)
    with handled():
        registry = get_registry()
    unknown = set(group or []) - set(registry.groups)
    if unknown:
        fail(f"unknown group(s) {sorted(unknown)}; known: {registry.groups}", 2)
    from batchgen.worker.names import NOTIFY_QUEUE

    # Every model worker also delivers batch-finished callbacks and webhooks.
    queues = ["llm." + g for g in (group or registry.groups)] + [NOTIFY_QUEUE]
    with _services() as settings:
        _celery_worker(
            queues, concurrency or settings.worker.concurrency, False, "-".join(group or ["all"])
        )


@cli.command()
def dispatcher(
    beat: bool = typer.Option(
        True,
        help="Embed Celery beat (dispatch, sweep and nightly ticks); --no-beat when "
        "`batchgen beat` runs on its own.",
    ),
) -> None:
    """The dispatcher and sweep: a worker on the control queue (beat embedded by default)."""
    from batchgen.worker.names import CONTROL_QUEUE

    with _services():
        _celery_worker([CONTROL_QUEUE], 2, beat, "dispatcher")


@cli.command()
def beat() -> None:
    """Celery beat alone (dispatch, sweep and nightly ticks); run exactly one."""
    with _services() as settings:
        _celery(["beat", "-s", _beat_schedule_file(), "--loglevel", settings.log.level])


# Flower's task list (default: name, uuid, state, received, runtime, worker) with the
# kwargs column: a generate task's kwargs name its batch and tenant (ids and names, no
# request text), so an operator finds a batch's tasks in the list, not one by one.
FLOWER_TASK_COLUMNS = "name,uuid,state,kwargs,received,runtime,worker"


@cli.command()
def flower(
    port: int = typer.Option(5555, help="HTTP port."),
    address: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: all)."),
    basic_auth: str | None = typer.Option(
        None,
        "--basic-auth",
        help="user:password; default BATCHGEN_FLOWER_USER and BATCHGEN_FLOWER_PASSWORD.",
    ),
) -> None:
    """Flower on the configured broker, behind HTTP basic auth (required)."""
    settings = get_settings()
    if basic_auth is None and settings.flower.user and settings.flower.password:
        basic_auth = f"{settings.flower.user}:{settings.flower.password}"
    user, _, password = (basic_auth or "").partition(":")
    if not user or not password:
        fail(
            "Flower needs basic auth: set BATCHGEN_FLOWER_USER and BATCHGEN_FLOWER_PASSWORD "
            "or pass --basic-auth user:password",
            2,
        )
    from batchgen.monitoring.flower_auth import require_auth

    require_auth()  # /metrics too (Flower serves it open)
    with _services():
        console.print(f"flower on http://{address}:{port} (basic auth as {user})")
        # In-process: the password stays out of the process list.
        _celery(
            [
                "flower",
                f"--basic-auth={basic_auth}",
                f"--port={port}",
                f"--address={address}",
                f"--tasks_columns={FLOWER_TASK_COLUMNS}",
            ]
        )


@cli.command()
def api(
    host: str = "",
    port: int = 0,
    workers: int = typer.Option(0, min=0, help="Worker processes (0: api_workers)."),
    threads: int = typer.Option(0, min=0, help="Threads per worker (0: api_threads)."),
    dev: bool = typer.Option(False, "--dev", help="Werkzeug's development server instead."),
) -> None:
    """The HTTP API, served by gunicorn's threaded workers (production)."""
    with _services() as settings:
        host, port = host or settings.api.host, port or settings.api.port
        if dev:
            from werkzeug.serving import run_simple

            from batchgen.api import create_app

            run_simple(host, port, create_app(), threaded=True)
            return
        from batchgen.serving import serve

        serve(host, port, workers or settings.api.workers, threads or settings.api.threads)


@cli.command()
def simulator(
    host: str = "127.0.0.1",
    port: int = 8099,
    tpm: int = typer.Option(0, help="Tokens per minute per key and model (0: unlimited)."),
    rpm: int = typer.Option(0, help="Requests per minute per key and model (0: unlimited)."),
    latency_ms: float = typer.Option(100.0, help="Base latency of an answer."),
    per_token_ms: float = typer.Option(1.0, help="Extra latency per output token."),
    fault_rate: float = typer.Option(0.0, help="Share of requests answered with a fault."),
    charge_mode: ChargePolicy = typer.Option(
        ChargePolicy.RESERVE, help="'reserve' (OpenAI) or 'actual' (Anthropic)."
    ),
) -> None:
    """The provider simulator (OpenAI and Anthropic APIs, rate limits, faults)."""
    from batchgen.simulator import SimulatorConfig, run_simulator

    config = SimulatorConfig(
        tokens_per_min=tpm or None,
        requests_per_min=rpm or None,
        latency_base_ms=latency_ms,
        latency_per_token_ms=per_token_ms,
        fault_rate=fault_rate,
        charge_mode=charge_mode.value,  # type: ignore[arg-type]  # the same two values
    )
    console.print(f"simulator on http://{host}:{port} (OpenAI: /v1, Anthropic: /v1/messages)")
    run_simulator(host, port, config)


@cli.command()
def demo(
    items: int = typer.Option(300, min=1, help="Requests to submit across 3 tenants and 2 models."),
    anthropic: bool = typer.Option(False, "--anthropic", help="Use the Anthropic-mode model."),
    offload: bool = typer.Option(
        False,
        "--offload",
        help="Bulk batches through the simulated providers' Batch APIs, at half the price.",
    ),
) -> None:
    """End to end on embedded servers: simulator, worker, dispatcher, 3 tenants, a table."""
    from batchgen.cli.demo import run_demo

    code = run_demo(items=items, anthropic=anthropic, offload=offload, console=console)
    raise typer.Exit(code)


def main() -> None:
    """Console script entry point."""
    try:
        cli()
    except BatchgenError as exc:
        if "--json" in sys.argv[1:]:  # an error no command turned into its document
            print_json({"error": {"code": getattr(exc, "code", "error"), "message": str(exc)}})
        print_error(str(exc))
        sys.exit(1)


__all__ = ["cli", "main"]

if __name__ == "__main__":
    main()
