"""What the history, the tenants and the files cost, each figure against its target and
next to the code of an earlier release, in one run (each part may run alone: ``--only``).

Set-up: PostgreSQL and Redis (embedded, or the given ``DATABASE_URL`` / ``REDIS_URL``,
in a database of their own), histories bulk-loaded by bench/history.py.

history    (bench/scale_history.py) ``--pending`` pending items (all deferred),
           ``--finished`` finished ones with their results and ledger rows and
           ``--calls`` finished synchronous calls (a batch each): ``/metrics``,
           the status view, a 1k-line submit, an idle dispatch round and the sweep's
           expiry, against the formulas of migration 0008; the plans of the scans.
retention  (bench/scale_retention.py) one retention pass over that finished history,
           timed, and the hot path's items/s while it runs against the hot path alone.
ticks      (bench/scale_retention.py) retention alone, ticks back to back with the
           default chunks and budget, over ``--calls`` expired synchronous calls and
           ``--finished`` expired items: batches/s and items/s (alone in its run: it
           loads a history of its own).
dispatch   (bench/scale_dispatch.py) ``--pending`` ready items on a model for each of
           ``--tenants`` (spread over that many tenants, two batches each; ``--idle``
           tenants with no work besides): the median round, the sizes taken in turn;
           Jain's index of releases/weight over ``--rounds`` rounds at 500 tenants
           (weights 1 to 3) and the tenants served; each against the 0008 release.
files      (bench/scale_files.py) a finished batch of ``--results`` results: the output
           file's metadata and its download through ``batchgen api``.
upload     (bench/scale_files.py) a batch created from an upload of ``--upload-mb`` MB:
           the API process's peak RSS against its idle RSS.
submission bench/submission.py at ``--submit-lines`` (0: skipped).

    .venv/bin/python bench/scale.py [--pending 1000000] [--finished 1000000] [--calls 300000]
        [--tenants 50,500,5000] [--idle 5000] [--rounds 100] [--results 200000]
        [--upload-mb 40] [--repeat 5] [--submit-lines 0] [--only dispatch,files]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import history, scale_dispatch, scale_files, scale_history, scale_retention
from bench.harness import servers

PARTS = ("history", "retention", "ticks", "dispatch", "files", "upload")
TARGETS_MS = {"/metrics": 100.0, "submit 1k": 100.0, "idle round": 20.0}
ROUND_MS, ROUNDS_SPREAD, JAIN = 20.0, 1.5, 0.95
META_MS, DOWNLOAD_ROWS_S = 50.0, 20_000.0


def _mark(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def _print_history(args: argparse.Namespace, found: scale_history.History) -> None:
    print(
        f"history: {args.pending:,} pending (all deferred) + {args.finished:,} finished items "
        f"with results and ledger rows + {args.calls:,} finished synchronous calls (a batch "
        f"each); loaded in {found.load_s:.0f} s, first roll-up "
        f"{found.first_roll_up_s:.1f} s (once)"
    )
    print(f"  {'':16}{'now ms':>10}{'target':>12}{'0008 ms':>12}{'0008/now':>10}")
    for label, now_ms, before_ms in found.rows:
        target = TARGETS_MS.get(label)
        mark = "" if target is None else f"{target:.0f} {_mark(now_ms <= target)}"
        print(f"  {label:16}{now_ms:>10.1f}{mark:>12}{before_ms:>12.1f}{before_ms / now_ms:>10.1f}")
    print("  (submit 1k's 0008 column: its admission queries alone, on top of the rest)")
    print("  plans at this size (whole-table reads of items, results, ledger, batches):")
    for label, plan in found.plans.items():
        whole = history.seq_scans_of_items(plan, history.LARGE_TABLES)
        print(f"    {label:28} {whole or 'none'}")


def _print_retention(found: scale_retention.Retention) -> None:
    ratio = found.hot_during_per_s / found.hot_alone_per_s
    print(
        f"retention: one pass removed {found.batches} batches, {found.items:,} items (with "
        f"their results and ledger rows) in {found.purge_s:.1f} s"
    )
    print(
        f"  hot path: {found.hot_alone_per_s:.0f} items/s alone, {found.hot_during_per_s:.0f} "
        f"items/s while the pass ran ({ratio:.2f} of alone)"
    )


def _print_ticks(found: scale_retention.Ticks) -> None:
    print(
        f"retention ticks: {found.ticks} removed {found.batches:,} batches, {found.items:,} "
        f"items in {found.purge_s:.1f} s: {found.batches / found.purge_s:,.0f} batches/s, "
        f"{found.items / found.purge_s:,.0f} items/s"
    )


def _print_dispatch(
    args: argparse.Namespace, found: list[scale_dispatch.Rounds], repeat: int
) -> None:
    print(
        f"dispatch: {args.pending:,} ready items per model, spread over the tenants below "
        f"(+{args.idle:,} idle tenants); window {scale_dispatch.WINDOW}; median of "
        f"{repeat} rounds each, the sizes in turn"
    )
    print(f"  {'tenants':>8}{'round ms':>10}{'target':>12}{'0008 ms':>12}{'0008/now':>10}")
    for row in found:
        target = f"{ROUND_MS:.0f} {_mark(row.round_ms <= ROUND_MS)}"
        print(
            f"  {row.tenants:>8,}{row.round_ms:>10.1f}{target:>12}{row.old_round_ms:>12.1f}"
            f"{row.old_round_ms / row.round_ms:>10.1f}"
        )
    times = [row.round_ms for row in found]
    spread = max(times) / min(times)
    print(
        f"  largest / smallest round: {spread:.2f} (target <= {ROUNDS_SPREAD} "
        f"{_mark(spread <= ROUNDS_SPREAD)})"
    )
    for row in found:
        if row.jain is not None:
            print(
                f"  fairness over {args.rounds} rounds at {row.tenants} tenants (weights 1-3): "
                f"Jain {row.jain:.3f} on releases/weight (target >= {JAIN} "
                f"{_mark(row.jain >= JAIN)}), {row.served} of {row.tenants} tenants served; "
                f"0008: Jain {row.old_jain:.3f}, {row.old_served} served"
            )


def _print_files(found: scale_files.Files) -> None:
    print(f"files: a finished batch of {found.results:,} results, through `batchgen api`")
    print(
        f"  GET /v1/files/{{output}}: {found.meta_ms:.1f} ms rolled up (target <= {META_MS:.0f} "
        f"{_mark(found.meta_ms <= META_MS)}); {found.meta_tail_ms:.0f} ms while its items "
        "were still in the totals' tail (before the roll-up, a few minutes after the end)"
    )
    print(
        f"  GET /v1/files/{{output}}/content: {found.download_rows_per_s:,.0f} rows/s "
        f"({found.download_mb:.0f} MB; target >= {DOWNLOAD_ROWS_S:,.0f} "
        f"{_mark(found.download_rows_per_s >= DOWNLOAD_ROWS_S)}); the same rows rendered "
        f"by Python one by one (GET /v1/batches/{{id}}/results): "
        f"{found.python_rows_per_s:,.0f} rows/s"
    )


def _print_upload(found: scale_files.Upload) -> None:
    print(
        f"upload: a batch created from a {found.file_mb:.0f} MB upload ({found.lines:,} "
        f"lines) in {found.create_s:.0f} s: API process RSS {found.idle_rss_mb:.0f} MB idle, "
        f"peak {found.peak_rss_mb:.0f} MB (target <= 1.5 x idle + 50 = {found.bound_mb:.0f} "
        f"{_mark(found.peak_rss_mb <= found.bound_mb)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--finished", type=int, default=1_000_000)
    parser.add_argument("--calls", type=int, default=300_000)
    parser.add_argument("--tenants", default="50,500,5000")
    parser.add_argument("--idle", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--hot-items", type=int, default=100_000)
    parser.add_argument("--results", type=int, default=200_000)
    parser.add_argument("--upload-mb", type=float, default=40.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--submit-lines", type=int, default=0)
    parser.add_argument("--only", default=",".join(PARTS))
    args = parser.parse_args()
    parts = set(args.only.split(","))
    if parts - set(PARTS):
        parser.error(f"--only takes {', '.join(PARTS)}")
    sizes = [int(n) for n in args.tenants.split(",")]

    from batchgen.config import get_settings

    found: dict[str, Any] = {}
    with servers() as workdir:
        url = get_settings().sqlalchemy_url
        libpq = url.replace("postgresql+psycopg://", "postgresql://")
        if "history" in parts or "retention" in parts:
            found["history"] = scale_history.run(
                url, args.pending, args.finished, args.calls, args.repeat
            )
            _print_history(args, found["history"])
        if "retention" in parts:
            found["retention"] = scale_retention.run(args.hot_items, alone_s=15.0)
            _print_retention(found["retention"])
        if "ticks" in parts:
            _print_ticks(scale_retention.ticks(libpq, args.calls, args.finished))
        if "dispatch" in parts:
            repeat = max(args.repeat, 15)
            rows, load_s = scale_dispatch.run(
                libpq, args.pending, sizes, args.idle, args.rounds, 500, repeat
            )
            print(f"(dispatch histories loaded in {load_s:.0f} s)")
            _print_dispatch(args, rows, repeat)
        if "files" in parts:
            scale_dispatch.reset()
            _print_files(scale_files.files(workdir, args.results, max(args.repeat, 10)))
        if "upload" in parts:
            scale_dispatch.reset()
            _print_upload(scale_files.upload(workdir, args.upload_mb))
    if args.submit_lines:
        print(f"submission of {args.submit_lines:,} lines (bench/submission.py):")
        done = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).with_name("submission.py")),
                "--lines",
                str(args.submit_lines),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        print(done.stdout, end="")


if __name__ == "__main__":
    main()
