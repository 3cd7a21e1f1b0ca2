"""The ``batchgen`` command line (Typer). Service commands start embedded
PostgreSQL and Redis when ``DATABASE_URL`` / ``REDIS_URL`` are unset."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator

import typer
from rich.console import Console
from rich.table import Table

from app.config import Settings, get_settings
from app.errors import BatchgenError

cli = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
tenants_cli = typer.Typer(no_args_is_help=True, help="Create, list and revoke tenants.")
db_cli = typer.Typer(no_args_is_help=True, help="Database schema (Alembic).")
cli.add_typer(tenants_cli, name="tenants")
cli.add_typer(db_cli, name="db")
console = Console()
err = Console(stderr=True)


@contextlib.contextmanager
def _services() -> Iterator[Settings]:
    """Ensure the servers run (embedded if no URLs are set), then yield fresh settings."""
    from app import embedded

    with embedded.services(Settings().data_dir):
        get_settings.cache_clear()
        yield get_settings()


def _fail(exc: BatchgenError, code: int = 1) -> None:
    err.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(code)


@db_cli.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Apply migrations (creates the schema on an empty database)."""
    from app import db

    with _services():
        db.upgrade(revision=revision)
    console.print(f"database at {revision}")


@tenants_cli.command("create")
def tenants_create(
    name: str,
    weight: int = typer.Option(1, help="Share of capacity relative to other tenants."),
    admin: bool = typer.Option(False, help="May read every tenant's batches and usage."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Create a tenant and print its API key (shown this once; only a hash is kept)."""
    from app import db, tenants

    with _services():
        try:
            with db.session_scope() as session:
                tenant, key = tenants.create_tenant(session, name, weight=weight, is_admin=admin)
                tenant_id = tenant.id
        except BatchgenError as exc:
            _fail(exc)
    if as_json:
        print(json.dumps({"id": tenant_id, "name": name, "api_key": key}))
    else:
        console.print(f"tenant {name} (id {tenant_id}) created. API key, shown once:")
        print(key)


@tenants_cli.command("list")
def tenants_list(as_json: bool = typer.Option(False, "--json")) -> None:
    """List tenants (key prefixes only)."""
    from app import db, tenants

    with _services(), db.session_scope() as session:
        rows = [
            {
                "id": t.id,
                "name": t.name,
                "key_prefix": t.key_prefix,
                "weight": t.weight,
                "revoked": t.revoked_at is not None,
            }
            for t in tenants.list_tenants(session)
        ]
    if as_json:
        print(json.dumps(rows))
        return
    table = Table("id", "name", "key prefix", "weight", "revoked")
    for r in rows:
        table.add_row(
            str(r["id"]),
            str(r["name"]),
            str(r["key_prefix"]),
            str(r["weight"]),
            "yes" if r["revoked"] else "",
        )
    console.print(table)


@tenants_cli.command("revoke")
def tenants_revoke(name: str) -> None:
    """Revoke a tenant's API key."""
    from app import db, tenants

    with _services():
        try:
            with db.session_scope() as session:
                tenants.revoke(session, name)
        except BatchgenError as exc:
            _fail(exc)
    console.print(f"tenant {name}: key revoked")


@cli.command()
def models(as_json: bool = typer.Option(False, "--json")) -> None:
    """Show the model registry."""
    from app.registry import get_registry

    specs = list(get_registry())
    if as_json:
        print(json.dumps([s.model_dump(mode="json") for s in specs]))
        return
    table = Table(
        "model",
        "provider",
        "queue",
        "tokens/min",
        "requests/min",
        "concurrency",
        "$ in/1M",
        "$ out/1M",
    )
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


def _celery_worker(queues: list[str], concurrency: int, beat: bool, name: str) -> None:
    from tasks.celery_app import celery_app

    argv = [
        "worker",
        "-Q",
        ",".join(queues),
        "-P",
        "threads",
        "-c",
        str(concurrency),
        "-n",
        f"{name}@%h",
        "--loglevel",
        get_settings().log_level,
    ]
    if beat:
        argv.append("-B")
    celery_app.worker_main(argv)


@cli.command()
def worker(
    group: list[str] = typer.Option(
        None, "--group", "-g", help="Model group(s) to serve; default: all."
    ),
    concurrency: int = typer.Option(0, help="Threads; default BATCHGEN_WORKER_CONCURRENCY."),
) -> None:
    """A Celery worker (thread pool) for one or more model groups."""
    from app.registry import get_registry

    registry = get_registry()
    unknown = set(group or []) - set(registry.groups)
    if unknown:
        err.print(f"[red]error:[/red] unknown group(s) {sorted(unknown)}; known: {registry.groups}")
        raise typer.Exit(2)
    queues = ["llm." + g for g in (group or registry.groups)]
    with _services() as settings:
        _celery_worker(
            queues, concurrency or settings.worker_concurrency, False, "-".join(group or ["all"])
        )


@cli.command()
def dispatcher() -> None:
    """The dispatcher and sweep: a worker on the control queue with beat embedded."""
    from celeryconfig import CONTROL_QUEUE

    with _services():
        _celery_worker([CONTROL_QUEUE], 2, True, "dispatcher")


@cli.command()
def beat() -> None:
    """Celery beat alone (dispatch and sweep ticks)."""
    from tasks.celery_app import celery_app

    with _services():
        celery_app.start(["beat", "--loglevel", get_settings().log_level])


@cli.command()
def api(host: str = "", port: int = 0) -> None:
    """The HTTP API (development server; use gunicorn 'app.api:create_app()' in production)."""
    from werkzeug.serving import run_simple

    from app.api import create_app

    with _services() as settings:
        run_simple(
            host or settings.api_host, port or settings.api_port, create_app(), threaded=True
        )


@cli.command()
def simulator(
    host: str = "127.0.0.1",
    port: int = 8099,
    tpm: int = typer.Option(0, help="Tokens per minute per key and model (0: unlimited)."),
    rpm: int = typer.Option(0, help="Requests per minute per key and model (0: unlimited)."),
    latency_ms: float = typer.Option(100.0, help="Base latency of an answer."),
    per_token_ms: float = typer.Option(1.0, help="Extra latency per output token."),
    fault_rate: float = typer.Option(0.0, help="Share of requests answered with a fault."),
    charge_mode: str = typer.Option("reserve", help="'reserve' (OpenAI) or 'actual' (Anthropic)."),
) -> None:
    """The provider simulator (OpenAI and Anthropic APIs, rate limits, faults)."""
    from app.simulator import SimulatorConfig, run_simulator

    config = SimulatorConfig(
        tokens_per_min=tpm or None,
        requests_per_min=rpm or None,
        latency_base_ms=latency_ms,
        latency_per_token_ms=per_token_ms,
        fault_rate=fault_rate,
        charge_mode=charge_mode,  # type: ignore[arg-type]  # validated by the config
    )
    console.print(f"simulator on http://{host}:{port} (OpenAI: /v1, Anthropic: /v1/messages)")
    run_simulator(host, port, config)


@cli.command()
def demo(
    items: int = typer.Option(300, help="Requests to submit across 3 tenants and 2 models."),
    anthropic: bool = typer.Option(False, "--anthropic", help="Use the Anthropic-mode model."),
) -> None:
    """End to end on embedded servers: simulator, worker, dispatcher, 3 tenants, a table."""
    from app.demo import run_demo

    code = run_demo(items=items, anthropic=anthropic, console=console)
    raise typer.Exit(code)


def main() -> None:
    """Console script entry point."""
    try:
        cli()
    except BatchgenError as exc:
        err.print(f"[red]error:[/red] {exc}")
        sys.exit(1)


if __name__ == "__main__":
    main()
