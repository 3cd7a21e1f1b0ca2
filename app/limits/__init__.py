"""Provider limits on Redis: the token budget, concurrency slots and the gate.

Every decision that must hold across all workers and hosts is one atomic Lua
script (``lua/*.lua``, loaded by name in :mod:`batchgen.limits.backend`, which
puts the shared ``lua/lib/*.lua`` a script includes before it). The
limiters know nothing of items or providers: they take ids, token counts and
the model's limits.
"""
