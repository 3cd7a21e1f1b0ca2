"""Operator commands for tenants and keys: ``batchgen tenants update|suspend|resume``,
``batchgen keys create|list|rotate|revoke``, ``batchgen budgets set|show|remove``,
``batchgen audit`` and
``batchgen admin operator-key``. Every change goes through :mod:`batchgen.tenant_admin`,
so the audit log records it, as ``cli:<os user>``."""

from __future__ import annotations

import getpass
import hashlib
from typing import Any

import typer
from rich.table import Table

from batchgen.cli.common import console, err, handled, print_json, services

JSON = typer.Option(False, "--json", help="Print one JSON document for scripts.")
keys_cli = typer.Typer(
    no_args_is_help=True, help="A tenant's API keys: create, list, rotate, revoke."
)
admin_cli = typer.Typer(no_args_is_help=True, help="The admin API's operator keys.")
budgets_cli = typer.Typer(
    no_args_is_help=True, help="Dollar budgets of tenants and keys: set, show, remove."
)


def actor() -> str:
    """Who the audit log says ran a command: ``cli:<the OS user>``."""
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # no user name in this environment
        return "cli:unknown"


def _show_secret(described: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(described)
        return
    err.print(
        f"key {described['id']} '{described['name']}' ({', '.join(described['scopes'])}), "
        "shown once:"
    )
    print(described["secret"])


def _key_table(rows: list[dict[str, Any]]) -> None:
    table = Table("id", "name", "prefix", "scopes", "state", "expires", "last used", "rpm")
    for r in rows:
        table.add_row(
            str(r["id"]),
            r["name"],
            r["prefix"] + "…",
            ",".join(r["scopes"]),
            r["state"],
            r["expires_at"] or "",
            r["last_used_at"] or "",
            "" if r["requests_per_min"] is None else str(r["requests_per_min"]),
        )
    console.print(table)


@keys_cli.command("create")
def keys_create(
    tenant: str,
    name: str = typer.Option(..., "--name", help="What the key is for (shown in lists)."),
    scope: list[str] = typer.Option(
        None, "--scope", help="batches, calls, read or admin; repeat it (default: all but admin)."
    ),
    expires_in_s: float | None = typer.Option(
        None, min=1, help="It stops working this many seconds from now."
    ),
    requests_per_min: int | None = typer.Option(
        None, min=1, help="Its own limit of requests per minute."
    ),
    as_json: bool = JSON,
) -> None:
    """Create a key for TENANT and print it (shown this once; only a hash is kept)."""
    from batchgen import tenant_admin

    with services(), handled(as_json):
        made = tenant_admin.create_key(
            tenant,
            name=name,
            scopes=scope or None,
            expires_in_s=expires_in_s,
            requests_per_min=requests_per_min,
            actor=actor(),
        )
    _show_secret(made, as_json)


@keys_cli.command("list")
def keys_list(tenant: str, as_json: bool = JSON) -> None:
    """List TENANT's keys (prefixes only; revoked and expired ones too)."""
    from batchgen import tenant_admin

    with services(), handled(as_json):
        rows = tenant_admin.list_keys(tenant)
    if as_json:
        print_json(rows)
    else:
        _key_table(rows)


@keys_cli.command("rotate")
def keys_rotate(
    tenant: str,
    key_id: int,
    overlap_s: float = typer.Option(
        24 * 3600.0, min=0, help="How long the old key keeps working (0: it stops now)."
    ),
    as_json: bool = JSON,
) -> None:
    """Make a new key like KEY_ID and print it; KEY_ID expires after the overlap."""
    from batchgen import tenant_admin

    with services(), handled(as_json):
        rotated = tenant_admin.rotate_key(tenant, key_id, overlap_s=overlap_s, actor=actor())
    if as_json:
        print_json(rotated)
        return
    err.print(f"key {key_id} now expires at {rotated['old']['expires_at']}")
    _show_secret(rotated["new"], False)


@keys_cli.command("revoke")
def keys_revoke(tenant: str, key_id: int, as_json: bool = JSON) -> None:
    """Revoke one key now; TENANT's other keys go on working."""
    from batchgen import tenant_admin

    with services(), handled(as_json):
        revoked = tenant_admin.revoke_key(tenant, key_id, actor=actor())
    if as_json:
        print_json(revoked)
    else:
        console.print(f"key {key_id} of {tenant}: revoked")


def audit(
    tenant: str | None = typer.Option(None, help="One tenant's changes only."),
    limit: int = typer.Option(50, min=1, max=500, help="How many, newest first."),
    as_json: bool = JSON,
) -> None:
    """The audit log: who changed which tenant or key, when, before and after."""
    from batchgen import tenant_admin

    with services(), handled(as_json):
        rows = tenant_admin.audit_log(tenant=tenant, limit=limit)
    if as_json:
        print_json(rows)
        return
    table = Table("id", "at", "actor", "action", "tenant", "key", title="audit log")
    for r in rows:
        key = "" if r["key_id"] is None else str(r["key_id"])
        table.add_row(str(r["id"]), r["at"], r["actor"], r["action"], r["tenant"] or "", key)
    console.print(table)


@admin_cli.command("operator-key")
def operator_key(name: str, as_json: bool = JSON) -> None:
    """Make an operator key for the admin API: prints the key (give it to the operator)
    and the BATCHGEN_ADMIN_KEYS entry (its hash) to configure."""
    from batchgen.store.api_keys import new_secret

    if ":" in name or not name.strip():
        err.print("[red]error:[/red] the name may not be empty nor hold ':'")
        raise typer.Exit(2)
    secret = new_secret()
    entry = f"{name}:{hashlib.sha256(secret.encode()).hexdigest()}"
    if as_json:
        print_json({"name": name, "key": secret, "admin_keys_entry": entry})
        return
    err.print("operator key, shown once:")
    print(secret)
    err.print(f"add to BATCHGEN_ADMIN_KEYS (a JSON list): {entry}")


def register_tenant_commands(tenants_cli: typer.Typer) -> None:
    """``tenants update|suspend|resume`` on the ``tenants`` group."""

    @tenants_cli.command("update")
    def tenants_update(
        name: str,
        weight: int | None = typer.Option(None, min=1, help="Share of capacity."),
        max_pending_items: int | None = typer.Option(None, min=1, help="Open items at most."),
        daily_token_quota: int | None = typer.Option(None, min=1, help="Tokens per UTC day."),
        tokens_per_min: int | None = typer.Option(None, min=1, help="Tokens per minute."),
        max_files: int | None = typer.Option(None, min=1, help="Uploads kept at most."),
        max_file_bytes: int | None = typer.Option(None, min=1, help="Bytes of uploads."),
        clear: list[str] = typer.Option(
            None, "--clear", help="Remove a limit (e.g. daily_token_quota); repeatable."
        ),
        as_json: bool = JSON,
    ) -> None:
        """Change a tenant's weight or quotas (audited)."""
        from batchgen import tenant_admin

        given = {
            "weight": weight,
            "max_pending_items": max_pending_items,
            "daily_token_quota": daily_token_quota,
            "tokens_per_min": tokens_per_min,
            "max_files": max_files,
            "max_file_bytes": max_file_bytes,
        }
        changes: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        changes.update({field: None for field in clear or []})
        with services(), handled(as_json):
            after = tenant_admin.update_tenant(name, changes, actor=actor())
        if as_json:
            print_json(after)
        else:
            console.print(f"tenant {name}: " + ", ".join(f"{k}={after[k]}" for k in changes))

    @tenants_cli.command("suspend")
    def tenants_suspend(name: str, as_json: bool = JSON) -> None:
        """Stop every key of a tenant (401) until it is resumed; its batches stay."""
        from batchgen import tenant_admin

        with services(), handled(as_json):
            after = tenant_admin.suspend_tenant(name, actor=actor())
        print_json(after) if as_json else console.print(f"tenant {name}: suspended")

    @tenants_cli.command("resume")
    def tenants_resume(name: str, as_json: bool = JSON) -> None:
        """Let a suspended tenant's keys work again."""
        from batchgen import tenant_admin

        with services(), handled(as_json):
            after = tenant_admin.resume_tenant(name, actor=actor())
        print_json(after) if as_json else console.print(f"tenant {name}: resumed")


@budgets_cli.command("set")
def budgets_set(
    tenant: str,
    limit_usd: str = typer.Option(..., "--limit-usd", help="The hard limit per period ($)."),
    period: str = typer.Option("month", help="day, month or total."),
    time_zone: str = typer.Option("UTC", "--time-zone", help="The IANA zone of days/months."),
    thresholds: str = typer.Option("50,80,100", help="Soft thresholds, per cent, comma-separated."),
    key_id: int | None = typer.Option(None, "--key", help="A key's budget, not the tenant's."),
    as_json: bool = JSON,
) -> None:
    """Set TENANT's dollar budget (or one of its keys'): docs/money.md."""
    from batchgen import tenant_admin

    with services(), handled(as_json):
        try:
            pcts = [int(t) for t in thresholds.split(",") if t.strip()]
        except ValueError:
            err.print("thresholds are whole per cents, e.g. 50,80,100")
            raise typer.Exit(2) from None
        made = tenant_admin.set_budget(
            tenant,
            limit_usd=limit_usd,
            period=period,
            time_zone=time_zone,
            thresholds=pcts,
            key_id=key_id,
            actor=actor(),
        )
    if as_json:
        print_json(made)
    else:
        console.print(
            f"{tenant}{'' if key_id is None else f' key {key_id}'}: ${made['limit_usd']} "
            f"per {made['period']} ({made['time_zone']}), alerts at {made['thresholds']} %"
        )


@budgets_cli.command("show")
def budgets_show(tenant: str, as_json: bool = JSON) -> None:
    """TENANT's budgets: limit, used and reserved this period, and the reset."""
    from batchgen import tenant_admin

    with services(), handled(as_json):
        rows = tenant_admin.get_budgets(tenant)
    if as_json:
        print_json(rows)
        return
    table = Table("id", "key", "period", "limit $", "used $", "reserved $", "resets at")
    for r in rows:
        table.add_row(
            str(r["id"]),
            "" if r["key_id"] is None else str(r["key_id"]),
            r["period_key"],
            r["limit_usd"],
            r["used_usd"],
            str(r["reserved_micros"] / 1_000_000),
            r["resets_at"] or "never",
        )
    console.print(table)


@budgets_cli.command("remove")
def budgets_remove(
    tenant: str,
    key_id: int | None = typer.Option(None, "--key", help="A key's budget, not the tenant's."),
    as_json: bool = JSON,
) -> None:
    """Remove TENANT's budget (or one of its keys'): its calls are no longer capped."""
    from batchgen import tenant_admin

    with services(), handled(as_json):
        removed = tenant_admin.delete_budget(tenant, key_id=key_id, actor=actor())
    print_json(removed) if as_json else console.print(f"{tenant}: budget removed")


def register(cli: typer.Typer, tenants_cli: typer.Typer) -> None:
    cli.add_typer(keys_cli, name="keys")
    cli.add_typer(budgets_cli, name="budgets")
    cli.add_typer(admin_cli, name="admin")
    cli.command("audit")(audit)
    register_tenant_commands(tenants_cli)
