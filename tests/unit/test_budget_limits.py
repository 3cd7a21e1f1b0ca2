"""Budget limits, pure: shared budget keys in the registry, cooldown caps, wait plans."""

from __future__ import annotations

import pytest

from batchgen.errors import ConfigError
from batchgen.registry import parse_registry

MODEL = """
[models."{name}"]
provider = "openai"
base_url = "http://localhost:1/v1"
api_key_env = "K"
group = "g"
budget_key = "{key}"
context_window = 1000
max_output_tokens = 10
tokens_per_min = {tpm}
requests_per_min = {rpm}
max_concurrency = 2
input_usd_per_1m = 1
output_usd_per_1m = 2
"""


def registry(*models: tuple[str, str, int, int]) -> str:
    return "".join(MODEL.format(name=n, key=k, tpm=tpm, rpm=rpm) for n, k, tpm, rpm in models)


def test_models_sharing_a_budget_key_with_different_limits_are_rejected():
    # Same account, same limits: fine; different accounts may differ.
    ok = parse_registry(
        registry(("a", "acct", 1000, 10), ("b", "acct", 1000, 10), ("c", "other", 5, 1))
    )
    assert {m.name for m in ok} == {"a", "b", "c"}
    with pytest.raises(ConfigError) as tokens:
        parse_registry(registry(("a", "acct", 1000, 10), ("b", "acct", 4000, 10)), "m.toml")
    message = str(tokens.value)
    assert "m.toml" in message and "'acct'" in message and "tokens_per_min" in message
    assert "'a': 1000" in message and "'b': 4000" in message
    with pytest.raises(ConfigError, match="requests_per_min .*'a': 10, 'b': 20"):
        parse_registry(registry(("a", "acct", 1000, 10), ("b", "acct", 1000, 20)))


def test_cooldown_is_capped():
    from batchgen.limits.budget import capped_cooldown_s

    assert capped_cooldown_s(3600.0, 60.0) == 60.0
    assert capped_cooldown_s(2.5, 60.0) == 2.5
    assert capped_cooldown_s(-1.0, 60.0) == 0.0


def plan(wait_s: float, left_s: float, firm: bool = True, tenant: bool = False):
    from batchgen.domain.lifecycle.retry import plan_wait

    return plan_wait(wait_s, left_s, firm=firm, releases_dispatch=tenant, max_countdown_s=60.0)


def test_cooldown_wait_never_expires_an_item_before_its_deadline():
    from batchgen.domain.lifecycle.retry import WaitAction

    # A firm budget wait that passes the deadline: no call can happen in time.
    assert plan(100.0, 30.0).action is WaitAction.EXPIRE
    # A cooldown (not firm) longer than the time left: back by the deadline at the latest.
    assert plan(60.0, 30.0, firm=False) == (WaitAction.REQUEUE, 30.0)
    assert plan(3600.0, 7200.0, firm=False).action is WaitAction.DEFER
    # Only a deadline that has passed ends it.
    assert plan(5.0, 0.0, firm=False).action is WaitAction.EXPIRE


def test_tenant_wait_releases_the_dispatch_window():
    from batchgen.domain.lifecycle.retry import WaitAction

    assert plan(5.0, 3600.0, tenant=True) == (WaitAction.DEFER, 5.0)
    assert plan(5.0, 3600.0) == (WaitAction.REQUEUE, 5.0)
    assert plan(90.0, 3600.0) == (WaitAction.DEFER, 90.0)


def test_the_limits_know_nothing_of_items_workers_or_providers():
    """No module of batchgen.limits imports the store, the worker, the providers or the
    tasks: the gate reads items and answers through Protocols (CallTicket, CallAnswer)."""
    import ast
    from pathlib import Path

    limits = Path(__file__).resolve().parents[2] / "app" / "limits"
    banned = ("batchgen.store", "batchgen.worker", "batchgen.providers", "batchgen.tasks")
    found = []
    for path in sorted(limits.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            found += [
                f"{path.name}: {n}"
                for n in names
                if any(n == b or n.startswith(b + ".") for b in banned)
            ]
    assert found == []
