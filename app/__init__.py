"""batchgen: multi-tenant LLM batch generation on Celery, Redis and PostgreSQL."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

#: The distribution that installs this package (pyproject.toml's [project] name): the
#: import name is ``batchgen``, the name on the package index is this one.
DISTRIBUTION = "batchgen-llm"

try:
    #: The installed distribution's version (one source: pyproject.toml).
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # a bare checkout on sys.path, never installed
    __version__ = "0+unknown"

__all__ = ["DISTRIBUTION", "__version__"]
