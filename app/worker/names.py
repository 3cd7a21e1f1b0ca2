"""Task and queue names: the contract between publishers and :mod:`batchgen.tasks`."""

from __future__ import annotations

CONTROL_QUEUE = "batchgen.control"  # the dispatcher, the sweep, nightly jobs
# Batch-finished callbacks and webhooks, served by the model workers (never the
# dispatcher's threads: a slow receiver must not hold up dispatch).
NOTIFY_QUEUE = "batchgen.notify"

GENERATE_TASK = "batchgen.generate"
DISPATCH_TASK = "batchgen.dispatch"
SWEEP_TASK = "batchgen.sweep"
OFFLOAD_TASK = "batchgen.offload"
NOTIFY_TASK = "batchgen.notify"
RETENTION_TASK = "batchgen.retention"
NIGHTLY_TASK = "batchgen.nightly"
COLLECT_TASK = "batchgen.nightly_collect"
