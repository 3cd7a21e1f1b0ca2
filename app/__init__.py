"""batchgen: multi-tenant LLM batch generation on Celery, Redis and PostgreSQL."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    #: The installed distribution's version (one source: pyproject.toml).
    __version__ = version("batchgen")
except PackageNotFoundError:  # a bare checkout on sys.path, never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
