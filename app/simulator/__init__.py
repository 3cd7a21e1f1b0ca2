"""Provider simulator: a small HTTP server speaking the OpenAI and Anthropic chat APIs.

It enforces tokens/requests per window per (API key, model) with real 429
answers and ``retry-after`` / rate-limit headers (an exact sliding window, or a
token bucket with the simulator's own token count: ``limiter="bucket"``), answers with deterministic
text after a configurable latency, and injects faults on demand. It also serves
the providers' own batch APIs (OpenAI Files + Batches, Anthropic Message
Batches: :mod:`batchgen.simulator.batch_jobs`) with a turnaround, row errors,
expiry, job failure and an enqueued-token limit. It is the default provider of
the demo and the peer of the integration tests.
"""

from batchgen.simulator.runner import SimulatorThread, run_simulator
from batchgen.simulator.server import create_app
from batchgen.simulator.sim_config import SimulatorConfig
from batchgen.simulator.text import completion_text, request_digest

__all__ = [
    "SimulatorConfig",
    "SimulatorThread",
    "completion_text",
    "create_app",
    "request_digest",
    "run_simulator",
]
