"""Start a batchgen worker on Celery's gevent pool, for measuring it against threads
(``bench/peer.py --pools threads,gevent``).

batchgen workers run the thread pool only (``batchgen.worker.procs.pool_error``
refuses any other); this launcher lifts that refusal for the one process it starts
and changes nothing else: the same tasks, settings and code, with gevent's monkey
patching done first, as ``celery -P gevent`` would do it.

    python bench/gevent_worker.py -A batchgen.tasks worker -P gevent -c 64 ...
"""

from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import sys  # noqa: E402

import batchgen.worker.procs as procs  # noqa: E402

procs.pool_error = lambda pool: None  # read by batchgen.tasks.celery_app at import

from celery.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "celery"
    sys.exit(main())
