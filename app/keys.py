"""Every Redis key this project writes, in one place.

Keys of one budget share a hash tag (``{...}``) so a Lua script touching
them works on Redis Cluster too.
"""

from __future__ import annotations

PREFIX = "bg:"


def budget_log(budget_key: str) -> str:
    return f"{PREFIX}budget:{{{budget_key}}}:log"


def budget_amounts(budget_key: str) -> str:
    return f"{PREFIX}budget:{{{budget_key}}}:amounts"


def cooldown(budget_key: str) -> str:
    return f"{PREFIX}budget:{{{budget_key}}}:cooldown"


def tenant_log(tenant_id: int) -> str:
    return f"{PREFIX}tenant-budget:{{t{tenant_id}}}:log"


def tenant_amounts(tenant_id: int) -> str:
    return f"{PREFIX}tenant-budget:{{t{tenant_id}}}:amounts"


def slots(model: str) -> str:
    return f"{PREFIX}slots:{{{model}}}"


def counters(model: str) -> str:
    """Hash of per-model event counters (denials, waits, cooldowns, 429s, errors)."""
    return f"{PREFIX}counters:{model}"


def rejections() -> str:
    """Hash of refused submissions, field ``<reason>:<tenant name>``."""
    return f"{PREFIX}rejections"


CANCEL_CHANNEL = f"{PREFIX}cancel"
