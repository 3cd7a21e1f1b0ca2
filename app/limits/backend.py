"""The process's Redis client and the Lua scripts, loaded by name from app/limits/lua/."""

from __future__ import annotations

import functools
from importlib import resources

import redis
from redis.commands.core import Script

from batchgen.config import get_settings


@functools.cache
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(
        url, socket_timeout=5, socket_connect_timeout=5, health_check_interval=30
    )


def get_redis(url: str | None = None) -> redis.Redis:
    """One client (one connection pool) per URL and process."""
    settings_url = get_settings().redis_url
    target = url or settings_url
    if not target:
        raise RuntimeError("REDIS_URL is not set")
    return _client(target)


@functools.cache
def _source(name: str) -> str:
    return resources.files("batchgen.limits").joinpath("lua", f"{name}.lua").read_text("utf-8")


@functools.cache
def script(client: redis.Redis, name: str) -> Script:
    """``app/limits/lua/<name>.lua`` registered on ``client`` (EVALSHA, reloaded after a flush)."""
    return client.register_script(_source(name))
