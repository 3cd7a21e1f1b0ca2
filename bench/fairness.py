"""Fairness between tenants on one model, side by side in one run.

1. Tenant B's 20-item interactive batch: completion time p50/p99 when B is
   alone, when submitted while tenant A has a 5 000-item bulk backlog (our
   dispatcher), and with a naive fan-out of the same load (every item
   published to the model's Celery queue at submit, A's first).
2. Throughput shares while two tenants both have backlog: Jain's fairness
   index at equal weights, and the share ratio at weights 2:1.

The model has a global concurrency cap of 8 and the simulator answers in
~100 ms, so concurrency is the scarce resource.

    .venv/bin/python bench/fairness.py [--backlog 5000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import func, select, update

from bench.harness import (
    MODEL_TOML,
    chat_requests,
    reset_state,
    servers,
    simulator_process,
    wait_finished,
)

MODEL = "fair"


def _tenant(name: str, weight: int = 1) -> None:
    from batchgen.store import db, tenants

    with db.session_scope() as s:
        tenants.create_tenant(s, name, weight=weight)


def _latencies_s(batch_id: str) -> list[float]:
    from batchgen.store.db import session_scope
    from batchgen.store.schema import Item

    with session_scope() as s:
        rows = s.execute(
            select(func.extract("epoch", Item.finished_at - Item.created_at)).where(
                Item.batch_id == batch_id, Item.status == "succeeded"
            )
        ).scalars()
        return sorted(float(r) for r in rows)


def _p(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _publish_all(batch_id: str) -> None:
    """Naive fan-out: every item straight onto the model's queue, in order."""
    from batchgen.store.db import session_scope
    from batchgen.store.schema import Item
    from batchgen.tasks.generate import generate

    with session_scope() as s:
        ids = list(
            s.scalars(
                update(Item)
                .where(Item.batch_id == batch_id)
                .values(
                    status="queued", lease_expires_at=func.now() + func.make_interval(0, 0, 0, 1)
                )
                .returning(Item.id)
            )
        )
    for item_id in sorted(ids):
        generate.apply_async(args=[item_id], kwargs={"model": MODEL})


def interactive_latency(args: argparse.Namespace, sim_url: str, mode: str) -> list[float]:
    from batchgen import python_api as client

    reset_state(sim_url)
    _tenant("A")
    _tenant("B")
    if mode != "alone":
        bulk = client.submit_batch(
            chat_requests(args.backlog, MODEL, "a", seed=1), tenant="A", priority="bulk"
        )
        if mode == "naive":
            _publish_all(bulk["id"])
        time.sleep(3)  # A's work is flowing
    b = client.submit_batch(chat_requests(20, MODEL, "b", seed=2), tenant="B")
    if mode == "naive":
        _publish_all(b["id"])
    wait_finished([b["id"]], timeout_s=args.timeout_s)
    if mode != "alone":
        client.cancel_batch(bulk["id"], tenant="A")
    return _latencies_s(b["id"])


def shares(args: argparse.Namespace, sim_url: str, weight_a: int) -> tuple[float, float]:
    """Items finished per tenant while both have backlog (after a warm-up)."""
    from batchgen import python_api as client
    from batchgen.store.db import session_scope
    from batchgen.store.schema import Item

    reset_state(sim_url)
    _tenant("A", weight=weight_a)
    _tenant("B")
    batches = [
        client.submit_batch(
            chat_requests(args.share_items, MODEL, name, seed=3), tenant=name, priority="bulk"
        )
        for name in ("A", "B")
    ]
    time.sleep(args.warmup_s)
    with session_scope() as s:
        start = s.scalar(select(func.now()))
    time.sleep(args.measure_s)
    counts = {}
    with session_scope() as s:
        for name, batch in zip(("A", "B"), batches, strict=True):
            counts[name] = s.scalar(
                select(func.count())
                .select_from(Item)
                .where(Item.batch_id == batch["id"], Item.finished_at >= start)
            )
    for name, batch in zip(("A", "B"), batches, strict=True):
        client.cancel_batch(batch["id"], tenant=name)
    return float(counts["A"]), float(counts["B"])


def jain(x: float, y: float) -> float:
    return (x + y) ** 2 / (2 * (x * x + y * y)) if x or y else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backlog", type=int, default=5000)
    parser.add_argument("--share-items", type=int, default=2000)
    parser.add_argument("--warmup-s", type=float, default=5)
    parser.add_argument("--measure-s", type=float, default=20)
    parser.add_argument("--timeout-s", type=float, default=1200)
    parser.add_argument("--shares-only", action="store_true", help="skip the latency runs")
    args = parser.parse_args()

    import os

    from batchgen.config import get_settings
    from batchgen.worker.procs import start_worker

    with (
        servers() as workdir,
        simulator_process("--latency-ms", "100", "--jitter-ms", "10") as sim_url,
    ):
        models_file = workdir / "models.toml"
        models_file.write_text(
            MODEL_TOML.format(name=MODEL, base_url=sim_url, tpm=10**9, rpm=10**7, concurrency=8)
        )
        os.environ["BATCHGEN_MODELS_FILE"] = str(models_file)
        get_settings.cache_clear()
        env = {"BATCHGEN_LOG_LEVEL": "WARNING", "BATCHGEN_DISPATCH_INTERVAL_S": "0.5"}
        worker = start_worker(
            [f"llm.{MODEL}", "batchgen.control"],
            log_dir=workdir / "logs",
            concurrency=16,
            beat=True,
            env=env,
            name="fair",
        )
        try:
            worker.wait_ready()
            modes = () if args.shares_only else ("alone", "dispatcher", "naive")
            latency = {mode: interactive_latency(args, sim_url, mode) for mode in modes}
            equal = shares(args, sim_url, weight_a=1)
            weighted = shares(args, sim_url, weight_a=2)
        finally:
            worker.stop()

    if latency:
        _print_latency(latency, args.backlog)
    _print_shares(equal, weighted, args.measure_s)


def _print_latency(latency: dict[str, list[float]], backlog: int) -> None:
    solo_p99 = _p(latency["alone"], 99)
    print(f"\nB's 20 interactive items (model cap 8, ~100 ms calls), A backlog {backlog}:")
    print(f"{'run':34} {'p50 s':>7} {'p99 s':>7} {'p99 / solo p99':>15}")
    names = {
        "alone": "B alone",
        "dispatcher": "B + A's backlog, our dispatcher",
        "naive": "B + A's backlog, naive fan-out",
    }
    for mode, values in latency.items():
        print(
            f"{names[mode]:34} {_p(values, 50):7.2f} {_p(values, 99):7.2f} "
            f"{_p(values, 99) / solo_p99:15.2f}"
        )


def _print_shares(
    equal: tuple[float, float], weighted: tuple[float, float], measure_s: float
) -> None:
    print(f"\nthroughput while both tenants have backlog ({measure_s:g} s):")
    print(
        f"  equal weights: A {equal[0]:.0f}, B {equal[1]:.0f} items; "
        f"Jain's index {jain(*equal):.3f}"
    )
    print(
        f"  weights 2:1:   A {weighted[0]:.0f}, B {weighted[1]:.0f} items; "
        f"ratio {weighted[0] / max(1.0, weighted[1]):.2f} (target 2.00 ± 10 %)"
    )


if __name__ == "__main__":
    main()
