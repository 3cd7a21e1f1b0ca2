"""The process's Redis client and the Lua scripts, loaded by name from app/limits/lua/.

Scripts share code through includes (Redis Functions need Redis 7; the embedded
server is 6.2): a script may start with lines

    --! include clock
    --! include window

and is loaded with the text of ``lua/lib/clock.lua`` and ``lua/lib/window.lua``
put before it, each library once, in the order named. A library defines local
Lua functions; it includes nothing itself. The directive lines are Lua comments,
so the script's own text is sent as it is on disk.

A Redis that can fail over (docs/operations.md, "High availability"): besides
``redis://`` and ``rediss://``, the URL may name Sentinels,
``redis+sentinel://[:password@]host:port[,host:port...]/<master name>[/<db>]``
(the client asks them for the current primary, and again after a failover), or a
Redis Cluster, ``redis+cluster://[:password@]host:port[,host:port...]`` (the nodes to
learn the cluster from; database 0). The cluster's client answers the same commands
as a single Redis, a multi-key read goes through :func:`mget` (keys of several slots).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, cast
from urllib.parse import parse_qs, unquote

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.sentinel import Sentinel

from batchgen import json_codec
from batchgen.config import current_scope, get_settings, redact_url
from batchgen.errors import ConfigError

# What a Redis that is down or silent raises (refused, dropped, past the socket timeout,
# still loading its data).
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


SENTINEL_SCHEME = "redis+sentinel://"
CLUSTER_SCHEME = "redis+cluster://"


@dataclass(frozen=True)
class NodesUrl:
    """A ``redis+sentinel://`` or ``redis+cluster://`` URL taken apart."""

    scheme: str
    hosts: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    master: str = ""  # Sentinel: the primary's name as the Sentinels know it
    db: int = 0
    ssl: bool = False


def parse_nodes_url(url: str) -> NodesUrl:
    """``redis+sentinel://[user:password@]host:port[,host:port...]/<master>[/<db>]``
    or ``redis+cluster://[user:password@]host:port[,...][/0]``; ``?ssl=true`` for
    TLS. A port left out is 26379 (Sentinel) or 6379 (Cluster)."""
    scheme, sep, rest = url.partition("://")
    if not sep or f"{scheme}://" not in (SENTINEL_SCHEME, CLUSTER_SCHEME):
        raise ConfigError(f"not a redis+sentinel:// or redis+cluster:// URL: {redact_url(url)}")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(pw) if colon else None)
    default_port = 26379 if scheme == "redis+sentinel" else 6379
    hosts: list[tuple[str, int]] = []
    for part in filter(None, hostlist.split(",")):
        host, colon, port = part.rpartition(":")
        if not colon:
            host, port = part, str(default_port)
        if not port.isdigit():
            raise ConfigError(f"bad port {port!r} in {redact_url(url)}")
        hosts.append((host, int(port)))
    if not hosts:
        raise ConfigError(f"no host in {redact_url(url)}")
    segments = [unquote(p) for p in path.split("/") if p]
    master, db_text = "", "0"
    if scheme == "redis+sentinel":
        if not segments:
            raise ConfigError(f"no master name in {redact_url(url)} (.../<master>[/<db>])")
        master, db_text = segments[0], (segments[1] if len(segments) > 1 else "0")
    elif segments:
        db_text = segments[0]
    if not db_text.isdigit() or (scheme == "redis+cluster" and int(db_text) != 0):
        raise ConfigError(f"bad database {db_text!r} in {redact_url(url)}")
    ssl = parse_qs(query).get("ssl", ["false"])[0].lower() in ("1", "true", "yes")
    return NodesUrl(scheme, tuple(hosts), username, password, master, int(db_text), ssl)


def _make_client(url: str) -> redis.Redis:
    timeout_s = get_settings().redis.socket_timeout_s
    common: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if url.startswith(SENTINEL_SCHEME):
        nodes = parse_nodes_url(url)
        auth: dict[str, Any] = {"username": nodes.username, "password": nodes.password}
        sentinel = Sentinel(
            list(nodes.hosts),
            sentinel_kwargs={**common, **auth, "ssl": nodes.ssl},
            **common,
            **auth,
            ssl=nodes.ssl,
            db=nodes.db,
            health_check_interval=30,
        )
        return sentinel.master_for(nodes.master)
    if url.startswith(CLUSTER_SCHEME):
        nodes = parse_nodes_url(url)
        cluster = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes.hosts],
            username=nodes.username,
            password=nodes.password,
            ssl=nodes.ssl,
            **common,
        )
        # Not a redis.Redis, but it answers the same commands (routed by key slot).
        return cast(redis.Redis, cluster)
    return redis.Redis.from_url(url, **common, health_check_interval=30)


def mget(client: redis.Redis, keys_: Sequence[str]) -> list[Any]:
    """MGET of keys that may lie in several slots: one MGET per slot on a cluster."""
    if isinstance(client, RedisCluster):
        return list(client.mget_nonatomic(list(keys_)))
    return list(client.mget(keys_))


_client = functools.cache(_make_client)


def get_redis(url: str | None = None) -> redis.Redis:
    """One client (one connection pool) per URL and process; inside a host app's
    :class:`~batchgen.config.SettingsScope`, that app's own (closed with it)."""
    settings_url = get_settings().redis.url
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


# A script run for each entry of a list (:func:`scripts_at_once`): the script's own text
# is the body of a function whose KEYS and ARGV are the entry's.
_EACH_HEAD = """\
-- lua/{name}.lua for each entry of ARGV[1], a JSON list of [key indexes, args]:
-- each entry's KEYS are the KEYS its indexes name, its ARGV the args (strings), as if
-- it were called alone; the replies in order, an entry's error as its reply.
local function run_entry(KEYS, ARGV)
"""
_EACH_TAIL = """
end
local replies = {}
for i, entry in ipairs(cjson.decode(ARGV[1])) do
    local names, own = {}, entry[1]
    for j = 1, #own do
        names[j] = KEYS[own[j]]
    end
    local ok, reply = pcall(run_entry, names, entry[2])
    if not ok then
        reply = {err = type(reply) == 'table' and reply.err or tostring(reply)}
    elseif reply == nil then
        reply = false
    end
    replies[i] = reply
end
return replies
"""


@functools.cache
def each_source(name: str) -> str:
    """``lua/<name>.lua`` made to run once for each entry of a list, in one call
    (:func:`scripts_at_once`)."""
    return _EACH_HEAD.format(name=name) + _source(name) + _EACH_TAIL


@functools.cache
def script_each(client: redis.Redis, name: str) -> Script:
    """:func:`each_source` of ``name`` registered on ``client``."""
    return client.register_script(each_source(name))


_NUMBERS = frozenset({int, float})  # exactly: a bool is refused, a subclass checked


def _arg_text(value: Any) -> str:
    """An argument as Redis receives it from redis-py (ints and floats as their repr)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise redis.DataError(f"a script argument must be a string or a number, not {value!r}")
    return repr(value)


def each_payload(
    calls: Sequence[tuple[Sequence[str], Sequence[Any]]],
) -> tuple[list[str], bytes]:
    """The keys and the one argument of :func:`each_source`'s call for ``calls``: every
    key once, in order of first use (declared, as Redis Cluster wants), and a JSON list
    of each call's key indexes (1-based) and arguments as text."""
    index: dict[str, int] = {}
    entries = []
    for keys_, args in calls:
        own = [index.setdefault(k, len(index) + 1) for k in keys_]
        texts = [
            a if a.__class__ is str else repr(a) if a.__class__ in _NUMBERS else _arg_text(a)
            for a in args
        ]
        entries.append((own, texts))
    return list(index), json_codec.dumps(entries)


def scripts_at_once(
    client: redis.Redis,
    name: str,
    calls: list[tuple[list[str], list[Any]]],
    then: Sequence[tuple[Any, ...]] = (),
) -> list[Any]:
    """``lua/<name>.lua`` run once for each (keys, args) of ``calls``, in order, in one
    script call (:func:`each_source`: a pack's many entries cost one command to send and
    to parse, not one each; each entry reads its keys and arguments as when called
    alone); the replies in order. ``then``: commands sent after it in the same round
    trip, best effort (their replies, errors too, are dropped: a PUBLISH that the Redis
    user may not send does not fail the scripts). A script Redis does not know (a
    flush, a restart) is loaded and the call sent again, ``then`` not (they went with
    the first try: after a flush, before the scripts). An entry's own error is raised
    after the others have run."""
    if not calls:
        return []
    runner = script_each(client, name)
    keys_, payload = each_payload(calls)
    for last_try in (False, True):
        pipe = client.pipeline(transaction=False)
        pipe.evalsha(runner.sha, len(keys_), *keys_, payload)
        for command in () if last_try else then:  # sent once, with the first try
            pipe.execute_command(*command)
        reply = pipe.execute(raise_on_error=False)[0]
        if isinstance(reply, redis.exceptions.NoScriptError) and not last_try:
            client.script_load(runner.script)
            continue
        if isinstance(reply, Exception):
            raise reply
        replies = list(reply)
        errors = [r for r in replies if isinstance(r, Exception)]
        if errors:
            raise errors[0]
        return replies
    raise AssertionError("unreachable")
