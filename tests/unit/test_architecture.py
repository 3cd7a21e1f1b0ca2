"""The architecture, checked from the source: imports go down the layers, never in a
circle, the library never imports the task layer, and one module writes item state.

Every import counts, also one inside a function: a lazy import (kept for a fast
CLI start) must still point down. Run alone: ``pytest tests/unit/test_architecture.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"batchgen": ROOT / "app", "batchgen.tasks": ROOT / "tasks"}
FOLDERS["batchgen.migrations"] = ROOT / "migrations"

# Bottom to top. A module may import its own layer or a lower one. Within the
# "edges" layer, the three groups are peers that do not import each other.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("batchgen", "batchgen.config", "batchgen.errors", "batchgen.registry")),
    ("foundation", ("batchgen.logs", "batchgen.atomic_files")),
    ("domain", ("batchgen.domain",)),
    ("edges", ("batchgen.store", "batchgen.migrations")),
    ("edges", ("batchgen.limits",)),
    ("edges", ("batchgen.providers",)),
    ("edges", ("batchgen.embedded",)),
    ("edges", ("batchgen.telemetry",)),
    ("worker", ("batchgen.worker", "batchgen.celeryconfig")),
    (
        "interfaces",
        (
            "batchgen.api",
            "batchgen.tenant_admin",
            "batchgen.admin_api",
            "batchgen.request_auth",
            "batchgen.serving",
            "batchgen.bodies",
            "batchgen.dashboard",
            "batchgen.dashboard_auth",
            "batchgen.python_api",
            "batchgen.cli",
            "batchgen.integrations",
            "batchgen.nightly",
            "batchgen.monitoring",
        ),
    ),
    ("tasks", ("batchgen.tasks",)),
]
ORDER = ["foundation", "domain", "edges", "worker", "interfaces", "tasks"]
PEERS = [
    ("batchgen.store", "batchgen.migrations"),
    ("batchgen.limits",),
    ("batchgen.providers",),
    ("batchgen.telemetry",),
]
# The simulator is a test peer, self-contained: the product's token counter only.
SIMULATOR = "batchgen.simulator"
SIMULATOR_MAY_IMPORT = ("batchgen.simulator", "batchgen.domain.formats.tokens")


def _module_files() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if "versions" in parts:
                continue
            name = ".".join([package, *parts])
            if folder == ROOT / "app" and parts and parts[0] in ("tasks", "migrations"):
                continue
            modules[name] = path
    return modules


MODULES = _module_files()


def _imports(name: str, path: Path) -> set[str]:
    """Every batchgen module ``name`` imports, at any depth of the file."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            if target.startswith("batchgen"):
                while target not in MODULES and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _group(module: str) -> tuple[str, tuple[str, ...]]:
    best: tuple[str, tuple[str, ...]] | None = None
    best_len = -1
    for layer, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = (layer, prefixes), len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def test_every_module_has_a_layer():
    for module in MODULES:
        if not module.startswith(SIMULATOR):
            _group(module)


def test_imports_point_down():
    upward = []
    for source, targets in GRAPH.items():
        if source.startswith(SIMULATOR):
            continue
        layer, _ = _group(source)
        for target in targets:
            assert not target.startswith(SIMULATOR) or source.startswith(
                ("batchgen.cli", "batchgen.tasks")
            ), f"{source} imports the simulator, a test tool"
            if target.startswith(SIMULATOR):
                continue
            target_layer, _ = _group(target)
            if ORDER.index(target_layer) > ORDER.index(layer):
                upward.append(f"{source} ({layer}) -> {target} ({target_layer})")
    assert upward == []


def test_edge_packages_do_not_import_each_other():
    def peer(module: str) -> int | None:
        for i, prefixes in enumerate(PEERS):
            if any(module == p or module.startswith(p + ".") for p in prefixes):
                return i
        return None

    crossings = [
        f"{source} -> {target}"
        for source, targets in GRAPH.items()
        for target in targets
        if peer(source) is not None and peer(target) is not None and peer(source) != peer(target)
    ]
    assert crossings == []


def test_no_import_circles():
    """Tarjan's strongly connected components over every import: none larger than one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert circles == []


def test_library_never_imports_the_tasks():
    offenders = [
        f"{source} -> {target}"
        for source, targets in GRAPH.items()
        if not source.startswith("batchgen.tasks")
        for target in targets
        if target.startswith("batchgen.tasks")
    ]
    assert offenders == []


def test_tasks_do_not_import_each_other():
    """Tasks publish by name; only the Celery application module is shared."""
    shared = "batchgen.tasks.celery_app"
    offenders = [
        f"{source} -> {target}"
        for source, targets in GRAPH.items()
        if source.startswith("batchgen.tasks.") and source != shared
        for target in targets
        if target.startswith("batchgen.tasks.") and target != shared
    ]
    assert offenders == []


def test_items_are_run_by_the_worker_layer_only():
    """Running an item (gate, claim, provider call, recording) is the worker layer's: an
    interface starts a synchronous call through ``batchgen.worker.call_runner`` and waits on
    ``batchgen.worker.call_answers``; it runs no item, and no retry loop, itself."""
    runner = "batchgen.worker.execution"
    users = sorted(name for name, targets in GRAPH.items() if runner in targets)
    assert "batchgen.worker.call_runner" in users
    assert [name for name in users if _group(name)[0] not in ("worker", "tasks")] == []


# get_settings() (the settings in force: a host app's scope, else the environment's)
# is read at the edges only: the interfaces, the worker layer's entry points and the
# tasks, which hand settings (or the values needed) down as parameters.
MAY_GET_SETTINGS = (
    "batchgen.config",
    "batchgen.celeryconfig",
    "batchgen.embedded",
    "batchgen.logs",
    "batchgen.registry",
    "batchgen.worker",
    *dict(LAYERS)["interfaces"],
    "batchgen.tasks",
)
# The connection registries: every session and Redis client opens through them, for
# the active host app's scope or the process's own settings.
CONNECTION_REGISTRIES = ("batchgen.store.db", "batchgen.limits.backend")


def _calls_get_settings(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "get_settings":
                return True
    return False


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_get_settings_is_called_at_the_edges_only():
    """domain/, store/, limits/, providers/ and telemetry/ take settings as parameters."""
    callers = {name for name, path in MODULES.items() if _calls_get_settings(path)}
    offenders = sorted(
        name
        for name in callers
        if not _within(name, MAY_GET_SETTINGS) and name not in CONNECTION_REGISTRIES
    )
    assert offenders == []
    assert callers & set(CONNECTION_REGISTRIES) == set(CONNECTION_REGISTRIES)  # still needed?
    for package in ("domain", "store", "limits", "providers", "telemetry"):
        assert not _within(f"batchgen.{package}", MAY_GET_SETTINGS)


def test_the_get_settings_rule_sees_a_call(tmp_path: Path):
    source = tmp_path / "m.py"
    source.write_text("from batchgen import config\nx = config.get_settings().budget\n")
    assert _calls_get_settings(source)
    source.write_text("def f(settings):\n    return settings.budget\n")
    assert not _calls_get_settings(source)


def test_simulator_imports_nothing_of_the_product_but_the_token_counter():
    offenders = [
        f"{source} -> {target}"
        for source, targets in GRAPH.items()
        if source.startswith(SIMULATOR)
        for target in targets
        if not target.startswith(SIMULATOR_MAY_IMPORT)
    ]
    assert offenders == []


# --- rooms and names ----------------------------------------------------------------
#
# The domain keeps a handful of modules at its top; the rest live in subject rooms
# (``domain/formats``, ``domain/scheduling``, ``domain/lifecycle``, ``domain/billing``).
# No two modules share a file name, so a name (in a traceback, a grep, an editor's tab)
# says which module it is.
DOMAIN_TOP_LEVEL_MAX = 6
SHARED_NAMES_ALLOWED = {"__init__.py", "__main__.py"}


def test_the_domain_keeps_few_modules_at_its_top():
    top = sorted(p.name for p in (FOLDERS["batchgen"] / "domain").glob("*.py"))
    modules = [name for name in top if name != "__init__.py"]
    assert modules, "the domain's top-level modules must be found"
    assert len(modules) <= DOMAIN_TOP_LEVEL_MAX, (
        f"{len(modules)} modules at app/domain/'s top ({', '.join(modules)}): "
        "move some into a room (a sub-package by subject)"
    )


def test_no_two_modules_share_a_file_name():
    by_name: dict[str, list[str]] = {}
    for path in sorted(FOLDERS["batchgen"].rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        by_name.setdefault(path.name, []).append(relative)
    assert len(by_name) > 100, "the package's modules must be found"
    shared = {
        name: paths
        for name, paths in by_name.items()
        if len(paths) > 1 and name not in SHARED_NAMES_ALLOWED
    }
    assert shared == {}


# --- one owner of item state ----------------------------------------------------

ITEM_WRITES = re.compile(r"update\(\s*Item\b|UPDATE\s+items\b", re.IGNORECASE)
OWNER = "batchgen.store.items"


def _sql_files_loaded_by(path: Path) -> set[str]:
    return set(re.findall(r"query\(\s*\"([a-z_]+)\"", path.read_text()))


def test_one_module_writes_item_state():
    writers = sorted(
        name
        for name, path in MODULES.items()
        if name != OWNER and ITEM_WRITES.search(path.read_text())
    )
    assert writers == []
    # ORM writes of an item's status (``item.status = ...``) count too.
    orm_writes = sorted(
        name
        for name, path in MODULES.items()
        if name != OWNER and re.search(r"\bitem\.status\s*=[^=]", path.read_text())
    )
    assert orm_writes == []


def test_sql_files_that_write_items_are_loaded_by_the_owner_only():
    sql_dir = FOLDERS["batchgen"] / "store" / "sql"
    writing = {p.stem for p in sql_dir.glob("*.sql") if ITEM_WRITES.search(p.read_text())}
    assert writing, "the sweep's statements write items: the pattern must find them"
    owner_loads = _sql_files_loaded_by(MODULES[OWNER])
    assert writing <= owner_loads
    for name, path in MODULES.items():
        if name != OWNER:
            assert not (_sql_files_loaded_by(path) & writing), name


@pytest.mark.parametrize("sql", sorted((FOLDERS["batchgen"] / "store" / "sql").glob("*.sql")))
def test_every_sql_file_is_loaded(sql: Path):
    loaders = [name for name, path in MODULES.items() if sql.stem in _sql_files_loaded_by(path)]
    assert loaders, f"{sql.name} is loaded by no module"


def test_sql_includes_are_expanded_and_shipped():
    """``--! include`` lines are replaced by their part, every part is used, and a
    wheel ships the parts (package data) as well as the statements."""
    import fnmatch
    import tomllib

    from batchgen.store.sqlfiles import source

    sql_dir = FOLDERS["batchgen"] / "store" / "sql"
    statements = sorted(sql_dir.glob("*.sql"))
    included = {
        name
        for path in statements
        for name in re.findall(r"^--! include ([a-z_]+)$", path.read_text(), re.MULTILINE)
    }
    assert included == {p.stem for p in (sql_dir / "include").glob("*.sql")}
    for path in statements:
        assert "--! include" not in source(path.stem), path.name
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["batchgen.store"]
    for path in sql_dir.rglob("*.sql"):
        relative = path.relative_to(sql_dir.parent).as_posix()
        assert any(
            fnmatch.fnmatch(relative, g) and relative.count("/") == g.count("/") for g in globs
        ), relative


def test_sql_statements_fit_psycopgs_parse_cache():
    """psycopg caches the parsing of a statement only up to MAX_CACHED_STATEMENT_LENGTH
    bytes; a longer one is parsed again on every execution. The loaded statements (their
    comment lines left out, as compiled for psycopg) fit."""
    from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH
    from sqlalchemy.dialects import postgresql

    from batchgen.store.sqlfiles import query, source

    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    for path in sorted((FOLDERS["batchgen"] / "store" / "sql").glob("*.sql")):
        assert not re.search(r"^\s*--", source(path.stem), re.MULTILINE), path.name
        compiled = str(query(path.stem).compile(dialect=dialect)).encode()
        assert len(compiled) <= MAX_CACHED_STATEMENT_LENGTH, path.name


def test_driver_query_turns_binds_into_psycopgs_and_leaves_casts():
    from batchgen.store.sqlfiles import _BIND

    sql = "SELECT :a, x::int, '12:30' AS t, :b_2 FROM y WHERE z LIKE '5%'"
    converted = _BIND.sub(r"%(\1)s", sql.replace("%", "%%"))
    assert converted == "SELECT %(a)s, x::int, '12:30' AS t, %(b_2)s FROM y WHERE z LIKE '5%%'"


# --- SQL only in the store --------------------------------------------------------
#
# Only ``batchgen.store`` (and the migrations) speaks SQL. Anywhere else, a module:
#  1. imports nothing of SQLAlchemy but its errors (``sqlalchemy.exc``), the session type
#     (``sqlalchemy.orm.Session``, to pass a session on) and URL parsing
#     (``sqlalchemy.engine.make_url``): no statement, expression, table or engine;
#  2. imports nothing of psycopg but its errors (no ``psycopg.sql``, no connection);
#  3. names an ORM model of ``batchgen.store.schema`` in annotations and ``isinstance``
#     only (a model passed to a session call or a statement is a query);
#  4. runs nothing on a session or connection (``execute``, ``scalar``, ``scalars`` with
#     an argument; ``session.get/query/add/merge/flush/refresh``);
#  5. holds no string that reads as SQL (a statement keyword opening it), docstrings
#     aside;
# and no ``.sql`` file lives outside ``app/store/sql``.

SQL_SPEAKERS = ("batchgen.store", "batchgen.migrations")
SQLALCHEMY_ALLOWED = {
    "sqlalchemy.exc": None,  # every name: errors
    "sqlalchemy.orm": {"Session"},
    "sqlalchemy.engine": {"make_url", "URL"},
}
PSYCOPG_ERRORS = re.compile(r"(Error|Warning)$")
RUNS_SQL = {"execute", "scalar", "scalars"}
SESSION_CALLS = {"get", "query", "add", "add_all", "merge", "flush", "refresh"}
SQL_TEXT = re.compile(
    r"^\s*(SELECT|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM|WITH\s+(RECURSIVE\s+)?\w+"
    r"\s+AS|CREATE|DROP|ALTER|TRUNCATE|COPY|VACUUM|ANALYZE|EXPLAIN|LISTEN|NOTIFY)\s"
)


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _annotations(tree: ast.AST) -> set[int]:
    """The ids of every node inside an annotation."""
    roots: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
            roots.append(node.annotation)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            roots.append(node.returns)
    return {id(n) for root in roots for n in ast.walk(root)}


def _sql_outside_the_store(name: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: list[str] = []
    models: set[str] = set()
    psycopg_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = {a.name for a in node.names}
            if node.module == "sqlalchemy" or node.module.startswith("sqlalchemy."):
                allowed = SQLALCHEMY_ALLOWED.get(node.module, set())
                if node.module == "sqlalchemy":
                    allowed = {"exc"}
                if allowed is not None and names - allowed:
                    found.append(f"imports {node.module}: {sorted(names - allowed)}")
            if node.module == "psycopg" or node.module.startswith("psycopg."):
                bad = {n for n in names if not PSYCOPG_ERRORS.search(n)}
                if node.module != "psycopg" or bad:
                    found.append(f"imports {node.module}: {sorted(bad or names)}")
            if node.module == "batchgen.store.schema":
                models |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "sqlalchemy" or alias.name.startswith("sqlalchemy."):
                    found.append(f"imports {alias.name}")
                if alias.name == "psycopg" or alias.name.startswith("psycopg."):
                    psycopg_names.add(alias.asname or alias.name)
    in_annotation = _annotations(tree)
    docstrings = _docstrings(tree)
    isinstance_args: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            isinstance_args |= {id(n) for arg in node.args[1:] for n in ast.walk(arg)}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in psycopg_names
            and not PSYCOPG_ERRORS.search(node.attr)
        ):
            found.append(f"uses psycopg.{node.attr} (line {node.lineno})")
        if (
            isinstance(node, ast.Name)
            and node.id in models
            and id(node) not in in_annotation | isinstance_args
        ):
            found.append(f"uses the model {node.id} (line {node.lineno})")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, receiver = node.func.attr, node.func.value
            receiver_name = getattr(receiver, "id", getattr(receiver, "attr", ""))
            # (a Redis pipeline's execute(raise_on_error=...) is no statement)
            keywords = [k for k in node.keywords if k.arg != "raise_on_error"]
            if method in RUNS_SQL and (node.args or keywords):
                found.append(f"runs .{method}(...) (line {node.lineno})")
            if method in SESSION_CALLS and "session" in str(receiver_name):
                found.append(f"calls {receiver_name}.{method} (line {node.lineno})")
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and SQL_TEXT.match(node.value)
        ):
            found.append(f"SQL text {node.value.strip()[:40]!r} (line {node.lineno})")
    return found


def test_only_the_store_speaks_sql():
    offenders = {
        name: found
        for name, path in MODULES.items()
        if not name.startswith(SQL_SPEAKERS)
        and not name.startswith(SIMULATOR)
        and (found := _sql_outside_the_store(name, path))
    }
    assert offenders == {}
    stray = [
        p.relative_to(ROOT).as_posix()
        for folder in FOLDERS.values()
        for p in folder.rglob("*.sql")
        if (FOLDERS["batchgen"] / "store" / "sql") not in p.parents
    ]
    assert stray == []


@pytest.mark.parametrize(
    ("source", "finding"),
    [
        ("from sqlalchemy import select\n", "imports sqlalchemy"),
        ("from sqlalchemy.orm import Session, aliased\n", "imports sqlalchemy.orm"),
        ("import psycopg\npsycopg.connect('x')\n", "uses psycopg.connect"),
        ("from psycopg import sql\n", "imports psycopg"),
        ("from batchgen.store.schema import Item\nq = Item.status\n", "uses the model Item"),
        ("def f(session):\n    session.execute(x)\n", "runs .execute"),
        ("def f(session):\n    return session.get(k, 1)\n", "calls session.get"),
        ("Q = '''\n  SELECT id FROM items'''\n", "SQL text"),
        ("Q = 'WITH lost AS (SELECT 1) UPDATE items SET x = 1'\n", "SQL text"),
    ],
)
def test_the_sql_rule_finds_each_kind(tmp_path: Path, source: str, finding: str):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert any(f.startswith(finding) for f in _sql_outside_the_store("m", path)), source


def test_the_sql_rule_lets_through_what_is_not_sql(tmp_path: Path):
    path = tmp_path / "m.py"
    path.write_text(
        '"""SELECT ... FOR UPDATE SKIP LOCKED, in a docstring."""\n'
        "import psycopg\n"
        "from sqlalchemy.exc import OperationalError\n"
        "from sqlalchemy.orm import Session\n"
        "from batchgen.store.schema import Tenant\n"
        "def f(session: Session, t: Tenant) -> bool:\n"
        "    pipe.execute()\n"
        "    pipe.execute(raise_on_error=False)\n"
        "    client.delete('key')\n"
        "    return isinstance(t, Tenant) or isinstance(t, psycopg.Error)\n"
        "MESSAGE = 'Select a batch to see its items'\n"
    )
    assert _sql_outside_the_store("m", path) == []


# --- the store reads and writes; a submission's decisions are the domain's (issue #38) ----

# Interface modules that reach the store only through batchgen.python_api (or the worker).
STORE_FREE_INTERFACES = (
    "batchgen.api",
    "batchgen.admin_api",
    "batchgen.dashboard",
    "batchgen.request_auth",
)


@pytest.mark.parametrize("module", STORE_FREE_INTERFACES)
def test_interfaces_reach_the_store_through_python_api(module: str):
    direct = sorted(
        t for t in GRAPH[module] if t == "batchgen.store" or t.startswith("batchgen.store.")
    )
    assert direct == [], f"{module} imports the store; go through batchgen.python_api"


# Every top-level function of the store modules a submission goes through: each reads or
# writes. A new one is either the same (add it here) or a decision: that goes to
# batchgen.domain.submission (routes, cache keys, option checks, quota verdicts).
STORE_FUNCTIONS = {
    "batchgen.store.batches": {
        "output_file_id",
        "output_file_ids",
        "new_batch_id",
        "_find_idempotent",
        "_frame",
        "_copy_items",
        "_replay",
        "store_batch",
        "call_rows",
        "_get_batch",
        "get_readable_batch",
        "get_owned_batch",
        "request_counts",
        "_ts",
        "describe",
        "list_page",
        "_rfc3339",
        "describe_message_batch",
        "list_batches",
        "refresh_status",
        "keyed_batches",
        "cancel_requested_among",
        "unfinished_batch_ids",
        "close_if_done",
        "finish_if_done",
        "cancel",
        "error_codes",
        "iter_results",
    },
    "batchgen.store.quotas": {
        "check_files",
        "_open",
        "check_models",
        "_tokens_used_on",
        "check_tenant",
    },
}


def _top_level_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    return {
        node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


@pytest.mark.parametrize("module", sorted(STORE_FUNCTIONS))
def test_the_store_modules_of_a_submission_hold_only_their_reads_and_writes(module: str):
    assert _top_level_functions(MODULES[module]) == STORE_FUNCTIONS[module]


# What decides a submission, imported by no store module: the store calls
# batchgen.domain.submission, which uses these (route choice and parsing, the offload
# rule, prompt prefix keys, line parsing, option checks) and raises these refusals.
DECISION_NAMES = {
    "choose_route",
    "parse_route",
    "offload_of",
    "parse_offload",
    "asks_flex",
    "PrefixKeys",
    "parse_lines",
    "fitting",
    "check_callback",
    "check_task_name",
    "parse_duration_s",
    "unstorable_path",
}
REFUSALS = {"Overloaded", "OverQuota", "FileQuotaExceeded", "IdempotencyKeyReused"}


def _imported_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("batchgen"):
            names.update(a.name for a in node.names)
    return names


def _raised_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(call, ast.Name):
                names.add(call.id)
            elif isinstance(call, ast.Attribute):
                names.add(call.attr)
    return names


def test_no_store_module_decides_a_submission():
    found = []
    for name, path in MODULES.items():
        if not name.startswith("batchgen.store"):
            continue
        for decision in sorted(_imported_names(path) & (DECISION_NAMES | REFUSALS)):
            found.append(f"{name} imports {decision}")
        for refusal in sorted(_raised_names(path) & REFUSALS):
            found.append(f"{name} raises {refusal}")
    assert found == []


def test_the_decision_rule_finds_each_kind(tmp_path: Path):
    path = tmp_path / "m.py"
    path.write_text(
        "from batchgen.domain.scheduling.routes import choose_route\n"
        "from batchgen import errors\n"
        "def f():\n"
        "    raise errors.OverQuota('x')\n"
        "def _routes():\n"
        "    pass\n"
    )
    assert _imported_names(path) & DECISION_NAMES == {"choose_route"}
    assert _raised_names(path) & REFUSALS == {"OverQuota"}
    assert "_routes" in _top_level_functions(path)
