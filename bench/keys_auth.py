"""What authenticating a request's API key costs, side by side in one run.

PostgreSQL and Redis (embedded, or the given URLs in a database of their own), and
the API (Flask) in this process through its test client: no network, so the figures
are the server's own work. Rounds alternate five ways, ``--requests`` each:

  select 1    a transaction of ``SELECT 1`` (the floor of any lookup)
  lookup      ``store.api_keys.authenticate``: the key and its tenant by the hash's
              unique index, in one transaction (its last use written at most once
              a minute)
  no key      GET /healthz (routing, JSON, the app's hooks; no key)
  key         GET /v1/models/sim-small with a key
  key+rpm     the same with a key that has its own requests-per-minute limit (one
              Lua call on Redis more)

Per way: microseconds per request (the median round), and PostgreSQL rows updated
and transactions per 1 000 requests (pg_stat_database of this run's database): a
use is not a write.

    .venv/bin/python bench/keys_auth.py [--requests 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import servers, settled_pg_counters

WAYS = ("select 1", "lookup", "no key", "key", "key+rpm")


def _counters() -> dict[str, int]:
    """This run's database's counters once they settled, read from another database
    (not counted). The pool is closed first: a backend reports its counts when it
    exits, an idle one only some seconds later."""
    import psycopg
    from sqlalchemy.engine import make_url

    from batchgen.store.db import get_engine

    get_engine().dispose()
    url = make_url(os.environ["DATABASE_URL"].replace("postgresql+psycopg", "postgresql"))
    database = url.database or ""
    admin_url = url.set(database="postgres").render_as_string(hide_password=False)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        counters, _ = settled_pg_counters(conn, database)
        return counters


def run(requests: int, rounds: int) -> dict[str, dict[str, float]]:
    from sqlalchemy import text

    from batchgen import tenant_admin
    from batchgen.api import create_app
    from batchgen.store import api_keys
    from batchgen.store.db import session_scope

    made = tenant_admin.create_tenant("bench", actor="bench")
    plain = made["api_key"]["secret"]
    limited = tenant_admin.create_key("bench", name="limited", requests_per_min=10**8)["secret"]
    client = create_app().test_client()

    def ask(path: str, headers: dict[str, str]) -> Callable[[], object]:
        return lambda: client.get(path, headers=headers)

    def select_1() -> None:
        with session_scope() as session:
            session.execute(text("SELECT 1"))

    def lookup() -> None:
        with session_scope() as session:
            api_keys.authenticate(session, plain)

    one = "/v1/models/sim-small"
    asks: dict[str, Callable[[], object]] = {
        "select 1": select_1,
        "lookup": lookup,
        "no key": ask("/healthz", {}),
        "key": ask(one, {"Authorization": f"Bearer {plain}"}),
        "key+rpm": ask(one, {"Authorization": f"Bearer {limited}"}),
    }
    for do in asks.values():  # warm up: imports, pools, the first last-use write
        for _ in range(50):
            do()
    timings: dict[str, list[float]] = {way: [] for way in WAYS}
    writes: dict[str, list[float]] = {way: [] for way in WAYS}
    commits: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way in WAYS:
            do = asks[way]
            before = _counters()
            started = time.perf_counter()
            for _ in range(requests):
                do()
            elapsed = time.perf_counter() - started
            after = _counters()
            timings[way].append(elapsed / requests * 1e6)
            writes[way].append((after["tup_updated"] - before["tup_updated"]) * 1000 / requests)
            commits[way].append((after["xact_commit"] - before["xact_commit"]) * 1000 / requests)
    return {
        way: {
            "us": statistics.median(timings[way]),
            "updated_per_1000": statistics.median(writes[way]),
            "commits_per_1000": statistics.median(commits[way]),
        }
        for way in WAYS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with servers():
        found = run(args.requests, args.rounds)
    print(f"{'way':<10}{'us/request':>12}{'rows updated/1000':>19}{'commits/1000':>14}")
    for way in WAYS:
        row = found[way]
        print(
            f"{way:<10}{row['us']:>12.0f}"
            f"{row['updated_per_1000']:>19.1f}{row['commits_per_1000']:>14.0f}"
        )
    lookup, floor = found["lookup"]["us"], found["select 1"]["us"]
    api = found["key"]["us"] - found["no key"]["us"]
    print(f"lookup / select 1: {lookup / floor:.2f}; key vs no key: +{api:.0f} us")
    print(f"load {os.getloadavg()[0]:.2f}, {args.requests} requests x {args.rounds} rounds")


if __name__ == "__main__":
    main()
