"""Environment variables set for a test's stretch and undone after it."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` set in this process (settings and registry read afresh), then undone."""
    from batchgen.config import get_settings
    from batchgen.registry import load_registry

    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    get_settings.cache_clear()
    load_registry.cache_clear()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        get_settings.cache_clear()
        load_registry.cache_clear()
