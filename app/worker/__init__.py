"""The worker's orchestration: dispatch, execution of one item, sweep, cancel.

Thin: each step asks :mod:`batchgen.domain` what to do, then calls
:mod:`batchgen.store` and :mod:`batchgen.limits`. Messages are published by
task name (:mod:`batchgen.worker.publish`), so nothing here imports
:mod:`batchgen.tasks`.
"""
