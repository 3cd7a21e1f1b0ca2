"""PostgreSQL: the only code that writes SQL.

:mod:`batchgen.store.items` owns every move of an item's state; batches,
ledger, quotas, tenants and usage own their tables. The engine and sessions
are in :mod:`batchgen.store.db`, the models in :mod:`batchgen.store.schema`,
statements SQLAlchemy cannot express cleanly in ``sql/*.sql``.
"""
