"""``python -m batchgen.simulator``: run the provider simulator in the foreground."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from batchgen.simulator.lanes import LaneConfig
from batchgen.simulator.runner import run_simulator
from batchgen.simulator.sim_config import DEFAULT_FAULT_KINDS, LIMITERS, SimulatorConfig


def build_parser() -> argparse.ArgumentParser:
    """The command-line options (also used by the project CLI)."""
    p = argparse.ArgumentParser(prog="python -m batchgen.simulator", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--tpm", type=int, default=None, help="tokens per window (default: unlimited)")
    p.add_argument("--rpm", type=int, default=None, help="requests per window (default: unlimited)")
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--charge-mode", choices=("reserve", "actual"), default="reserve")
    p.add_argument(
        "--limiter",
        choices=LIMITERS,
        default="window",
        help="'window': exact sliding window (default); 'bucket': token bucket of capacity "
        "tpm/rpm refilled at limit/window-s per second, charging ceil(body bytes/4) + max_tokens",
    )
    p.add_argument(
        "--latency-ms",
        "--latency-base-ms",
        dest="latency_ms",
        type=float,
        default=0.0,
        help="base latency per answer",
    )
    p.add_argument("--per-token-ms", type=float, default=0.0, help="latency per output token")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="uniform jitter in [0, J]")
    p.add_argument("--fault-rate", type=float, default=0.0)
    p.add_argument(
        "--fault-kinds",
        default=",".join(DEFAULT_FAULT_KINDS),
        help="comma-separated subset of 5xx,hang,reset,malformed,429 and status:NNN[:code]",
    )
    p.add_argument("--hang-s", type=float, default=30.0)
    p.add_argument("--context-window", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--models", default="", help="comma-separated model names for /v1/models")
    p.add_argument(
        "--batch-turnaround-s", type=float, default=2.0, help="how long a batch job takes"
    )
    p.add_argument("--batch-row-error-rate", type=float, default=0.0, help="share of rows failing")
    p.add_argument("--batch-expire", action="store_true", help="batch jobs expire unanswered")
    p.add_argument(
        "--batch-create-delay-s", type=float, default=0.0, help="answer a job's create this late"
    )
    p.add_argument(
        "--batch-enqueued-tokens", type=int, default=None, help="enqueued tokens per key and model"
    )
    p.add_argument(
        "--flex-latency-factor",
        type=float,
        default=3.0,
        help="a service_tier flex answer is this many times slower",
    )
    p.add_argument(
        "--flex-max-in-flight",
        type=int,
        default=None,
        help="flex calls in progress per deployment beyond which one is refused (429 "
        "resource_unavailable); default: never busy",
    )
    p.add_argument(
        "--flex-refusal-rate", type=float, default=0.0, help="share of flex calls refused anyway"
    )
    p.add_argument(
        "--prompt-cache-ttl-s",
        type=float,
        default=300.0,
        help="a prompt prefix stays cached this long after its last use (0: no caching)",
    )
    p.add_argument(
        "--deployment",
        action="append",
        default=[],
        metavar="NAME:FIELD=VALUE,...",
        help="a simulated deployment served under /d/NAME/ with its own limits and faults: "
        "tpm, rpm, limiter, fault_rate, fault_kinds (joined by +), fault_for_s "
        "(e.g. east:tpm=30000,rpm=500,fault_rate=0.5,fault_for_s=60); repeatable",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> SimulatorConfig:
    """A :class:`SimulatorConfig` from parsed options."""
    return SimulatorConfig(
        tokens_per_min=args.tpm,
        requests_per_min=args.rpm,
        window_s=args.window_s,
        charge_mode=args.charge_mode,
        limiter=args.limiter,
        latency_base_ms=args.latency_ms,
        latency_per_token_ms=args.per_token_ms,
        latency_jitter_ms=args.jitter_ms,
        fault_rate=args.fault_rate,
        fault_kinds=tuple(k for k in args.fault_kinds.split(",") if k),
        hang_s=args.hang_s,
        context_window=args.context_window,
        seed=args.seed,
        models=tuple(m for m in args.models.split(",") if m),
        batch_turnaround_s=args.batch_turnaround_s,
        batch_row_error_rate=args.batch_row_error_rate,
        batch_expire=args.batch_expire,
        batch_enqueued_tokens_limit=args.batch_enqueued_tokens,
        batch_create_delay_s=args.batch_create_delay_s,
        flex_latency_factor=args.flex_latency_factor,
        flex_max_in_flight=args.flex_max_in_flight,
        flex_refusal_rate=args.flex_refusal_rate,
        prompt_cache_ttl_s=args.prompt_cache_ttl_s,
        deployments=dict(LaneConfig.parse(text) for text in args.deployment),
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Parse options and serve until interrupted."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    config = config_from_args(args)
    logging.getLogger(__name__).info("simulator on http://%s:%d", args.host, args.port)
    run_simulator(args.host, args.port, config)


if __name__ == "__main__":
    main()
