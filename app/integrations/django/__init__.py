"""A reusable Django app serving the batch API and offering the Python API.

    # settings.py
    INSTALLED_APPS += ["batchgen.integrations.django"]
    BATCHGEN_DATABASE_URL = "postgresql://…"   # any BATCHGEN_* setting of batchgen.config

    # urls.py
    path("batchgen/", include("batchgen.integrations.django.urls"))

    # a view
    from batchgen.integrations.django.services import submit_batch

The HTTP API answers under the include's prefix exactly as the standalone
Flask API does (the same code serves it). The app has no models and no
migrations: batchgen's schema belongs to its Alembic migrations
(``batchgen db upgrade``). ``manage.py batchgen_submit FILE --tenant NAME``
submits a JSONL file; ``batchgen_results``, ``batchgen_cancel`` and
``batchgen_usage`` read results, cancel and report usage; ``manage.py check``
names the settings batchgen lacks (:mod:`batchgen.integrations.django.checks`).
"""
