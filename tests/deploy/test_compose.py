"""deploy/compose.yaml: valid against the Compose Specification's JSON schema (offline: the copy
check-jsonschema vendors, `--builtin-schema vendor.compose-spec`; `docker compose config` needs the
compose plugin, which the test machines lack), and consistent with the Dockerfile, specdec.config
and the observability files it mounts. Also: every path deploy/README.md names exists.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from specdec import config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
ROLES = {"verifier": "verifier-cpu", "drafter": "drafter", "gateway": "gateway"}
OTHER_ENV = {"SPECDEC_CACHE_DIR", "SPECDEC_TRACE_FILE"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _default(value: str) -> str:
    """A compose value with ${VAR:-default} interpolated as if VAR were unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))


def test_compose_file_validates_against_the_compose_spec_schema() -> None:
    pytest.importorskip("check_jsonschema", reason="pip install check-jsonschema (the `test` extra)")
    done = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_stack_has_every_part(compose) -> None:
    assert set(compose["services"]) == {"models", *ROLES, "otel-collector", "jaeger", "prometheus", "grafana"}


def test_observability_services_are_a_profile(compose) -> None:
    """`up` alone runs what the Dockerfile builds; the images from a registry need --profile observability."""
    for name, service in compose["services"].items():
        assert (service.get("profiles") == ["observability"]) == ("build" not in service), name


def test_images_are_pinned_and_roles_build_their_dockerfile_target(compose) -> None:
    targets = set(re.findall(r"^FROM \S+ AS ([\w-]+)", (DEPLOY / "docker" / "Dockerfile").read_text(), re.M))
    for name, svc in compose["services"].items():
        image = _default(svc["image"])
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and re.search(r"\d", tag), f"{name}: {image}"
        if "build" in svc:
            build = svc["build"]
            context = (COMPOSE.parent / build["context"]).resolve()
            assert context == REPO and (context / build["dockerfile"]).is_file()
            assert build["target"] in targets and repo == f"specdec/{build['target']}", name
    for role, target in ROLES.items():
        assert compose["services"][role]["build"]["target"] == target


def test_specdec_services_match_the_config(compose) -> None:
    for kind in ROLES:
        svc = compose["services"][kind]
        cfg = config.SERVICE_CONFIGS[kind]()
        env = {k: _default(v) for k, v in svc["environment"].items()}
        fields = {config.env_name(f) for f in config.SERVICE_CONFIGS[kind].__dataclass_fields__}
        unknown = {k for k in env if k.startswith("SPECDEC_")} - fields - OTHER_ENV
        assert not unknown, f"{kind}: {unknown} are not settings"
        assert int(env["SPECDEC_PORT"]) == cfg.port and int(env["SPECDEC_METRICS_PORT"]) == cfg.metrics_port, kind
        assert env["SPECDEC_HOST"] == "0.0.0.0" and env["SPECDEC_CACHE_DIR"] == "/models"
        assert float(env["SPECDEC_SHUTDOWN_TIMEOUT_S"]) > 0
        grace = int(svc["stop_grace_period"].rstrip("s"))
        assert grace >= float(env["SPECDEC_SHUTDOWN_TIMEOUT_S"]) + 5, f"{kind}: SIGKILL before the drain ends"
        # hardened as the pods are
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"], kind
        assert any(t.split(":")[0] == "/tmp" for t in svc["tmpfs"]), f"{kind}: a writable /tmp"
        assert "no-new-privileges:true" in svc["security_opt"], kind
        assert "models:/models" in svc["volumes"], kind
        assert svc["depends_on"]["models"]["condition"] == "service_completed_successfully", kind
        assert svc["command"] == ["serve", kind]
    gateway = {k: _default(v) for k, v in compose["services"]["gateway"]["environment"].items()}
    for peer in ("verifier", "drafter"):
        assert gateway[f"SPECDEC_{peer.upper()}_ADDRESS"] == f"{peer}:{config.SERVICE_CONFIGS[peer]().port}"
        assert compose["services"]["gateway"]["depends_on"][peer]["condition"] == "service_healthy"
    models = compose["services"]["models"]
    assert models["command"][:2] == ["models", "pull"] and "models:/models" in models["volumes"]
    assert "models" in compose["volumes"]


def test_only_loopback_ports_are_published(compose) -> None:
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port} is published on every interface"
    published = {int(str(p).split(":")[1]) for p in compose["services"]["gateway"]["ports"]}
    cfg = config.GatewayConfig()
    assert published == {cfg.port, cfg.rest_port}


def test_mounted_files_exist_and_wire_up(compose) -> None:
    for name, svc in compose["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), f"{name}: {source} does not exist"
    prom = compose["services"]["prometheus"]
    config_path = next(v.split(":")[1] for v in prom["volumes"] if v.startswith("./observability/prometheus.yml"))
    assert f"--config.file={config_path}" in prom["command"]
    prometheus = yaml.safe_load((DEPLOY / "observability" / "prometheus.yml").read_text())
    mounted = {v.split(":")[1] for v in prom["volumes"]}
    assert set(prometheus["rule_files"]) <= mounted, "the alert rules are mounted where prometheus.yml loads them"
    targets = {t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{kind}:{config.SERVICE_CONFIGS[kind]().metrics_port}" for kind in ROLES}
    # traces: services -> collector (OTLP/gRPC) -> jaeger (OTLP)
    env = compose["services"]["verifier"]["environment"]
    assert env["OTEL_TRACES_EXPORTER"] == "${OTEL_TRACES_EXPORTER:-otlp}"  # otlp unless `none` is asked for
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
    collector = yaml.safe_load((DEPLOY / "observability" / "otel-collector.yaml").read_text())
    assert collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    exporter = collector["service"]["pipelines"]["traces"]["exporters"][0]
    assert collector["exporters"][exporter]["endpoint"] == "jaeger:4317"
    # grafana: the provisioned datasource is the one the dashboard's variable picks
    sources = yaml.safe_load((DEPLOY / "observability/grafana/provisioning/datasources/datasources.yml").read_text())
    prom_source = next(d for d in sources["datasources"] if d["type"] == "prometheus")
    assert prom_source["url"] == "http://prometheus:9090" and prom_source["isDefault"] is True
    providers = yaml.safe_load((DEPLOY / "observability/grafana/provisioning/dashboards/dashboards.yml").read_text())
    grafana_mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert grafana_mounts["./observability/grafana/dashboards"] == providers["providers"][0]["options"]["path"]


def test_deploy_readme_names_only_existing_paths() -> None:
    text = (DEPLOY / "README.md").read_text()
    paths = set(re.findall(r"(?<![\w/.-])((?:deploy|docs|tests)/[\w./-]*[\w/])", text))
    assert len(paths) >= 10
    # and paths relative to deploy/ (k8s/..., docker/...) and to deploy/k8s (components/..., overlays/...)
    local = set(re.findall(r"(?<![\w/.-])((?:k8s|docker|observability)/[\w./-]*[\w/])", text))
    k8s = set(re.findall(r"(?<![\w/.-])((?:components|overlays)/[\w.-]+)", text))
    missing = sorted(p for p in paths if not (REPO / p).exists())
    missing += sorted(p for p in local if not (DEPLOY / p).exists())
    missing += sorted(p for p in k8s if not (DEPLOY / "k8s" / p).exists())
    assert not missing, f"deploy/README.md names paths that do not exist: {missing}"


def test_each_role_serves_the_model_named_as_in_the_kubernetes_configmap(compose) -> None:
    """VERIFIER_MODEL, DRAFTER_MODEL, TOKENIZER (and MODEL_PAIR for `models`): the keys of the
    base's specdec-models ConfigMap, with its values as defaults; a pair's roles by their names
    (the tiny pair's draft is tiny/draft-mid, so no `${MODEL_PAIR}/draft`)."""
    base = yaml.safe_load((DEPLOY / "k8s" / "base" / "kustomization.yaml").read_text())
    (generator,) = [g for g in base["configMapGenerator"] if g["name"] == "specdec-models"]
    keys = dict(literal.split("=", 1) for literal in generator["literals"])
    wanted = {
        "verifier": ("SPECDEC_MODEL", "VERIFIER_MODEL"),
        "drafter": ("SPECDEC_MODEL", "DRAFTER_MODEL"),
        "gateway": ("SPECDEC_TOKENIZER", "TOKENIZER"),
    }
    for role, (var, key) in wanted.items():
        value = compose["services"][role]["environment"][var]
        assert value == f"${{{key}:-{keys[key]}}}", f"{role}: {var}={value}"
    assert compose["services"]["models"]["command"] == ["models", "pull", f"${{MODEL_PAIR:-{keys['MODEL_PAIR']}}}"]
