"""deploy/helm/batchgen: the chart renders offline (Helm's own engine, through
helm-python-sdk's libhelm, no helm binary, no cluster), every manifest validates
against the Kubernetes schemas of a pinned version (kubernetes-validate, shipped with
the package), the KEDA ScaledObjects against a schema of KEDA's documented fields
(tests/unit/schemas/), and every command, port and probe is one that batchgen serves."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchgen.monitoring.runnable import SLOTS_WANTED
from batchgen.registry import get_registry
from tests.unit.test_compose import parse_batchgen, settings_variables

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "batchgen"
KUBERNETES_VERSION = "1.33.0"  # the schemas every manifest is checked against
KEDA_SCHEMA = Path(__file__).parent / "schemas" / "keda-scaledobject.schema.json"
SECRETS = {
    "databaseUrl": "postgresql://batchgen:pw@postgres:5432/batchgen",
    "redisUrl": "redis://redis:6379/0",
    "flowerPassword": "s3cret",
    "metricsToken": "t0ken",
    "providerKeys": {"OPENAI_API_KEY": "sk-test"},
}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart's manifests for ``values`` (over values.yaml), as an install renders them."""
    import helm_python as helm

    chart = helm.Chart.load(str(CHART))
    merged = {"secrets": SECRETS, **(values or {})}
    rendered = chart.render(merged, name="prod", namespace="llm", is_install=True)
    return [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="module")
def manifests() -> list[dict[str, Any]]:
    return render({"modelsToml": (ROOT / "app" / "models.toml").read_text()})


def of_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def containers(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    pods = [m["spec"]["template"]["spec"] for m in manifests if m["kind"] in ("Deployment", "Job")]
    return [c for pod in pods for c in pod["containers"]]


def test_every_manifest_follows_the_kubernetes_schemas(manifests):
    import kubernetes_validate
    from kubernetes_validate.utils import all_versions

    assert KUBERNETES_VERSION in all_versions()  # shipped with the package: offline
    kinds = set()
    for manifest in manifests:
        kinds.add(manifest["kind"])
        if manifest["kind"] != "ScaledObject":  # a CRD: below
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
    assert kinds == {"Deployment", "Service", "Job", "Secret", "ConfigMap", "ScaledObject"}
    broken = {**of_kind(manifests, "Service")[0], "spec": {"ports": [{"port": "http"}]}}
    with pytest.raises(kubernetes_validate.ValidationError):  # the schemas really apply
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_helm_lint_finds_nothing_wrong():
    """Helm's own lint (strict, for the pinned Kubernetes version): info only."""
    import helm_python as helm

    report = helm.lint(
        str(CHART), {"secrets": SECRETS}, strict=True, kube_version=f"v{KUBERNETES_VERSION}"
    )
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] > 1] == []


def test_one_scaled_worker_deployment_per_model_group(manifests):
    import jsonschema

    schema = json.loads(KEDA_SCHEMA.read_text())
    deployments = {m["metadata"]["name"]: m for m in of_kind(manifests, "Deployment")}
    groups = {}
    for scaled in of_kind(manifests, "ScaledObject"):
        jsonschema.validate(scaled, schema)
        target = deployments[scaled["spec"]["scaleTargetRef"]["name"]]
        command = target["spec"]["template"]["spec"]["containers"][0]["command"]
        group = command[command.index("--group") + 1]
        (trigger,) = scaled["spec"]["triggers"]
        # One pod per `concurrency` slots wanted: the threshold is the pod's threads.
        assert trigger["metadata"]["query"] == f'max({SLOTS_WANTED}{{queue="llm.{group}"}})'
        assert trigger["metadata"]["threshold"] == command[command.index("--concurrency") + 1]
        assert trigger["metricType"] == "AverageValue"
        groups[group] = scaled
    assert set(groups) == set(get_registry().groups)
    with pytest.raises(jsonschema.ValidationError):  # the schema really applies
        jsonschema.validate({**scaled, "spec": {"triggers": []}}, schema)


def test_every_command_is_a_batchgen_command_and_every_variable_is_read(manifests):
    known = settings_variables() | {"OPENAI_API_KEY"}
    commands = []
    for container in containers(manifests):
        command = container["command"]
        assert command[0] == "batchgen", command
        parse_batchgen(command[1:])
        commands.append(command[1:3])
        assert {e["name"] for e in container["env"]} <= known
    (secret,) = of_kind(manifests, "Secret")
    assert set(secret["stringData"]) <= known
    assert ["db", "upgrade"] in commands and ["beat"] in commands
    (job,) = of_kind(manifests, "Job")
    assert "pre-install" in job["metadata"]["annotations"]["helm.sh/hook"]
    # The Secret exists before the migrations hook reads it.
    weight = "helm.sh/hook-weight"
    assert int(secret["metadata"]["annotations"][weight]) < int(
        job["metadata"]["annotations"][weight]
    )


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_ports_and_probes_are_what_batchgen_serves(manifests):
    from flask import Flask

    from batchgen.api import blueprint

    app = Flask("probe")
    app.register_blueprint(blueprint)
    routes = {rule.rule for rule in app.url_map.iter_rules()}
    for container in containers(manifests):
        command = container["command"]
        for probe in ("livenessProbe", "readinessProbe"):
            http = container.get(probe, {}).get("httpGet")
            if http:
                assert http["path"] in routes, http
                (port,) = [p for p in container["ports"] if p["name"] == http["port"]]
                assert str(port["containerPort"]) == _option(command, "--port")
        if command[1] != "db":
            assert "livenessProbe" in container, command
    (flower,) = [c for c in containers(manifests) if c["command"][1] == "flower"]
    check = flower["livenessProbe"]["exec"]["command"][-1]
    port = _option(flower["command"], "--port")
    assert f"http://127.0.0.1:{port}/healthcheck" in check
    assert flower["ports"][0]["containerPort"] == int(port)
    assert "/healthcheck" in _flower_paths()  # Flower serves it
    (api,) = [c for c in containers(manifests) if c["command"][1] == "api"]
    assert api["readinessProbe"]["httpGet"]["path"] == "/healthz"
    services = {s["metadata"]["name"]: s for s in of_kind(manifests, "Service")}
    assert services["prod-batchgen-api"]["spec"]["ports"][0]["port"] == 8000


def test_worker_probes_ping_the_node_name_the_worker_takes(manifests, monkeypatch):
    """`batchgen worker --group G` names its Celery node G@<hostname>: the probe pings it."""
    from typer.testing import CliRunner

    from batchgen.cli import main

    seen: list[list[str]] = []
    monkeypatch.setattr(main, "_celery", seen.append)
    monkeypatch.setattr(main, "_services", _no_services)
    for container in containers(manifests):
        command = container["command"]
        if command[1] not in ("worker", "dispatcher"):
            continue
        result = CliRunner().invoke(main.cli, command[1:])
        assert result.exit_code == 0, result.output
        node = _option(seen[-1], "-n").replace("%h", "$HOSTNAME")
        ping = shlex.split(container["livenessProbe"]["exec"]["command"][-1])
        assert ping[:5] == ["celery", "-A", main.TASKS_APP, "inspect", "ping"]
        assert _option(ping, "-d") == node


def _flower_paths() -> set[str]:
    """The paths of Flower's handlers (tornado URLSpecs or tuples)."""
    from flower.urls import handlers

    return {h.regex.pattern.rstrip("$") if hasattr(h, "regex") else h[0] for h in handlers}


class _no_services:
    def __enter__(self) -> Any:
        from batchgen.config import Settings

        return Settings()

    def __exit__(self, *exc: object) -> None:
        return None


def test_values_reach_the_manifests():
    """The values docs/operations.md names: a registry's groups as workers, the Secret
    from elsewhere, KEDA and Flower off."""
    rendered = render(
        {
            "workers": [{"group": "gpt4o", "concurrency": 32, "minReplicas": 0, "maxReplicas": 4}],
            "secrets": {"create": False, "existingSecret": "mine"},
            "keda": {"enabled": False},
            "flower": {"enabled": False},
        }
    )
    kinds = [m["kind"] for m in rendered]
    assert "ScaledObject" not in kinds and "Secret" not in kinds and "ConfigMap" not in kinds
    for container in containers(rendered):
        assert container["envFrom"] == [{"secretRef": {"name": "mine"}}]
        assert container["command"][1] != "flower"
    (worker,) = [c["command"] for c in containers(rendered) if c["command"][1] == "worker"]
    assert worker == ["batchgen", "worker", "--group", "gpt4o", "--concurrency", "32"]


def test_one_beat_and_locked_down_containers(manifests):
    beats = [
        m
        for m in of_kind(manifests, "Deployment")
        if m["spec"]["template"]["spec"]["containers"][0]["command"][1] == "beat"
    ]
    assert len(beats) == 1 and beats[0]["spec"]["replicas"] == 1
    assert beats[0]["spec"]["strategy"]["type"] == "Recreate"
    for container in containers(manifests):
        context = container["securityContext"]
        assert context["runAsUser"] == 10001 and context["readOnlyRootFilesystem"]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/srv/data", "/etc/batchgen"} <= mounts
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["BATCHGEN_MODELS_FILE"] == "/etc/batchgen/models.toml"
    # A model worker stays up for the webhooks (batchgen.notify) when work is idle.
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert all(w["minReplicas"] >= 1 for w in defaults["workers"])


def test_the_documented_install_sets_real_values():
    """Every ``--set``/``--set-file`` key of docs/operations.md's helm install exists
    in values.yaml."""
    import re

    docs = (ROOT / "docs" / "operations.md").read_text()
    keys = re.findall(r"--set(?:-file)? ([\w.]+)=", docs)
    assert len(keys) >= 5
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for key in keys:
        node: Any = defaults
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, key
            node = node[part]
