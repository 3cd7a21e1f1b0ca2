"""The Lua scripts' include mechanism (``--! include <name>``), without a Redis server."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

from batchgen.limits import backend
from batchgen.limits.backend import LuaIncludeError, expand_includes, includes

ROOT = Path(__file__).resolve().parents[2]
LUA = ROOT / "app" / "limits" / "lua"
SCRIPTS = sorted(p.stem for p in LUA.glob("*.lua"))
LIBS = sorted(p.stem for p in (LUA / "lib").glob("*.lua"))
LIB_TEXT = {"a": "local function a() return 1 end\n", "b": "local function b() return 2 end"}


def expand(text: str, libs: dict[str, str] = LIB_TEXT) -> str:
    return expand_includes("demo", text, libs.get)


# --- the mechanism -----------------------------------------------------------------------


def test_includes_are_put_before_the_script_once_each_in_order():
    text = "--! include b\n--!include a\n--! include b\n\nreturn b() + a()\n"
    assert includes("demo", text) == ["b", "a"]
    assert expand(text) == LIB_TEXT["b"] + "\n" + LIB_TEXT["a"] + text


def test_a_script_without_includes_is_sent_as_it_is():
    text = "-- a comment\nreturn 1\n"
    assert includes("demo", text) == [] and expand(text) == text


def test_an_unknown_include_names_the_script_and_the_include():
    with pytest.raises(LuaIncludeError, match=r"'demo' includes 'nope'.*lua/lib/nope\.lua"):
        expand("--! include a\n--! include nope\nreturn 1\n")


@pytest.mark.parametrize(
    "text",
    [
        "--! include\nreturn 1\n",
        "--! include ../secret\nreturn 1\n",
        "--! include a b\nreturn 1\n",
        "--! require a\nreturn 1\n",
    ],
)
def test_a_malformed_directive_is_refused(text):
    with pytest.raises(LuaIncludeError, match=r"'demo', line 1: expected '--! include <name>'"):
        expand(text)


def test_an_include_after_code_is_refused():
    with pytest.raises(LuaIncludeError, match=r"'demo', line 3: .*must come before any code"):
        expand("--! include a\n-- doc\n--! include b\nreturn 1\n")


def test_a_library_may_not_include_another():
    with pytest.raises(LuaIncludeError, match=r"lib/a\.lua includes others"):
        expand("--! include a\nreturn 1\n", {"a": "--! include b\nlocal x = 1\n"})


def test_a_missing_script_is_an_error():
    with pytest.raises(FileNotFoundError, match=r"lua/no_such_script\.lua"):
        backend._source("no_such_script")


# --- the scripts on disk -------------------------------------------------------------------


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_loads_with_its_libraries(name):
    raw = (LUA / f"{name}.lua").read_text("utf-8")
    source = backend._source(name)
    assert source.endswith(raw)  # the script's own text, unchanged, after its libraries
    prefix = source[: len(source) - len(raw)]
    assert prefix == "".join(
        (LUA / "lib" / f"{lib}.lua").read_text() for lib in includes(name, raw)
    )
    # Every shared function the script calls is defined in what is sent.
    for lib in LIBS:
        for fn in re.findall(
            r"^local function (\w+)\(", (LUA / "lib" / f"{lib}.lua").read_text(), re.M
        ):
            if re.search(rf"\b{fn}\(", raw):
                assert lib in includes(name, raw), (
                    f"{name}.lua calls {fn}() without --! include {lib}"
                )


def test_each_library_defines_local_functions_only_and_is_used():
    used = {lib for name in SCRIPTS for lib in includes(name, (LUA / f"{name}.lua").read_text())}
    assert used == set(LIBS) == {"clock", "window"}
    for lib in LIBS:
        text = (LUA / "lib" / f"{lib}.lua").read_text()
        assert includes(f"lib/{lib}", text) == []
        # No globals (Redis refuses them) and no top-level statements beyond local functions.
        top = [
            line for line in text.splitlines() if line and not line.startswith((" ", "--", "end"))
        ]
        assert top and all(line.startswith("local function ") for line in top), top


def test_the_shared_code_is_no_longer_copied():
    """The clock and the window expiry live in lua/lib/ only."""
    for path in LUA.glob("*.lua"):
        text = path.read_text()
        assert "redis.call('TIME')" not in text, path.name
        assert "'_requests', -requests_freed" not in text, path.name
        assert "local function expire" not in text, path.name
    assert "redis.call('TIME')" in (LUA / "lib" / "clock.lua").read_text()
    assert "ZREMRANGEBYSCORE" in (LUA / "lib" / "window.lua").read_text()


def test_the_libraries_are_package_data():
    """A wheel ships every file the loader reads (lua/*.lua and lua/lib/*.lua)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = data["package-data"]["batchgen.limits"]
    for path in LUA.rglob("*.lua"):
        relative = path.relative_to(LUA.parent).as_posix()
        assert any(
            fnmatch.fnmatch(relative, g) and relative.count("/") == g.count("/") for g in globs
        )
