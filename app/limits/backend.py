"""The process's Redis client and the Lua scripts, loaded by name from app/limits/lua/.

Scripts share code through includes (Redis Functions need Redis 7; the embedded
server is 6.2): a script may start with lines

    --! include clock
    --! include window

and is loaded with the text of ``lua/lib/clock.lua`` and ``lua/lib/window.lua``
put before it, each library once, in the order named. A library defines local
Lua functions; it includes nothing itself. The directive lines are Lua comments,
so the script's own text is sent as it is on disk.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from importlib import resources
from typing import Any

import redis
from redis.commands.core import Script

from batchgen.config import current_scope, get_settings

# What a Redis that is down or silent raises (refused, dropped, past the socket timeout,
# still loading its data).
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


def _make_client(url: str) -> redis.Redis:
    timeout_s = get_settings().redis_socket_timeout_s
    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=30
    )


_client = functools.cache(_make_client)


def get_redis(url: str | None = None) -> redis.Redis:
    """One client (one connection pool) per URL and process; inside a host app's
    :class:`~batchgen.config.SettingsScope`, that app's own (closed with it)."""
    settings_url = get_settings().redis_url
    target = url or settings_url
    if not target:
        raise RuntimeError("REDIS_URL is not set")
    scope = current_scope()
    if scope is None:
        return _client(target)
    return scope.resource(("redis", target), lambda: _make_client(target), redis.Redis.close)


class LuaIncludeError(RuntimeError):
    """A Lua script names an include that does not exist or is malformed."""


# "--! include <name>", the only directive; <name> is a file name in lua/lib/ without .lua.
_DIRECTIVE = re.compile(r"--!(?P<rest>.*)")
_INCLUDE = re.compile(r"\s*include\s+(?P<name>[A-Za-z0-9_]+)\s*")


def _read(*parts: str) -> str | None:
    """``app/limits/lua/<parts>`` as text, or None when there is no such file."""
    resource = resources.files("batchgen.limits").joinpath("lua", *parts)
    return resource.read_text("utf-8") if resource.is_file() else None


def includes(script_name: str, text: str) -> list[str]:
    """The libraries a script's leading ``--! include <name>`` lines name, in order,
    each once. A directive anywhere but in those leading lines, or one that is not
    ``include <name>``, is an error naming the script."""
    names: list[str] = []
    header = True
    for line_no, line in enumerate(text.splitlines(), 1):
        directive = _DIRECTIVE.match(line.strip())
        if directive is None:
            if line.strip():
                header = False  # the first line of the script proper
            continue
        where = f"Lua script {script_name!r}, line {line_no}"
        if not header:
            raise LuaIncludeError(f"{where}: '--!' directives must come before any code")
        include = _INCLUDE.fullmatch(directive["rest"])
        if include is None:
            raise LuaIncludeError(f"{where}: expected '--! include <name>', got {line.strip()!r}")
        if include["name"] not in names:
            names.append(include["name"])
    return names


def expand_includes(script_name: str, text: str, library: Callable[[str], str | None]) -> str:
    """``text`` with the libraries it includes put before it. ``library(name)`` gives a
    library's text, or None when there is none (an error naming script and include)."""
    parts: list[str] = []
    for name in includes(script_name, text):
        lib = library(name)
        if lib is None:
            raise LuaIncludeError(
                f"Lua script {script_name!r} includes {name!r}, but there is no lua/lib/{name}.lua"
            )
        if includes(f"lib/{name}", lib):
            raise LuaIncludeError(f"Lua library lib/{name}.lua includes others: libraries may not")
        parts.append(lib if lib.endswith("\n") else lib + "\n")
    return "".join(parts) + text


@functools.cache
def _source(name: str) -> str:
    """The text of ``lua/<name>.lua`` with its includes, as sent to Redis."""
    text = _read(f"{name}.lua")
    if text is None:
        raise FileNotFoundError(f"no Lua script lua/{name}.lua in batchgen.limits")
    return expand_includes(name, text, lambda lib: _read("lib", f"{lib}.lua"))


@functools.cache
def script(client: redis.Redis, name: str) -> Script:
    """``app/limits/lua/<name>.lua`` registered on ``client`` (EVALSHA, reloaded after a flush)."""
    return client.register_script(_source(name))


def scripts_pipelined(
    client: redis.Redis, name: str, calls: list[tuple[list[str], list[Any]]]
) -> list[Any]:
    """``lua/<name>.lua`` run once for each (keys, args) of ``calls``, in one round trip
    (a pipeline, not a transaction: each script is atomic on its own, as when called
    alone); the replies in order. A script Redis does not know (a flush, a restart)
    answers NOSCRIPT to every call of the pipeline, having run none: it is loaded and
    the pipeline sent again. A script's own error is raised (the others have run)."""
    if not calls:
        return []
    runner = script(client, name)
    for last_try in (False, True):
        pipe = client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(runner.sha, len(keys), *keys, *args)
        try:
            return list(pipe.execute())
        except redis.exceptions.NoScriptError:
            if last_try:
                raise
            client.script_load(runner.script)
    raise AssertionError("unreachable")
