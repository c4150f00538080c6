"""deploy/k8s: the overlays render with `kubectl kustomize`, validate strictly against the
Kubernetes schemas offline (kubernetes-validate bundles them), and keep the invariants a
production deployment relies on: probes on the gRPC health service, resources, a hardened
securityContext, a termination grace that covers preStop + the drain, ports equal to
specdec.config's defaults, the NetworkPolicy letting only gateways in, PDBs, HPAs, the GPU request.
CRD kinds (cert-manager, KEDA, Prometheus Operator) are checked structurally.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from specdec import config, serving, telemetry

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl is not installed: the manifests are rendered with `kubectl kustomize` (kustomize built in)",
)

OVERLAYS = ("cpu", "gpu", "production")
COMPONENTS = ("mtls", "cert-manager", "keda", "servicemonitor", "tracing", "pull-models", "ingress")
KINDS = ("verifier", "drafter", "gateway")
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject", "Certificate", "Issuer"}
# oldest Kubernetes these manifests are for, and the newest schemas kubernetes-validate has
K8S_VERSIONS = ("1.29", "latest")
OTHER_ENV = {"SPECDEC_CACHE_DIR", "SPECDEC_TRACE_FILE"}  # read outside the config dataclasses


def _kustomize(path: Path) -> list[dict[str, Any]]:
    done = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {path}:\n{done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every overlay, and the cpu overlay with every component (kustomize wants relative paths)."""
    out = {name: _kustomize(K8S / "overlays" / name) for name in OVERLAYS}
    for name, components in (("cpu+all-components", COMPONENTS), ("cpu+ingress", ("ingress",))):
        root = tmp_path_factory.mktemp("kustomize-all")
        rel = lambda p, root=root: os.path.relpath(p, root)  # noqa: E731
        (root / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "namespace": "specdec",
                    "resources": [rel(K8S / "overlays" / "cpu")],
                    "components": [rel(K8S / "components" / c) for c in components],
                }
            )
        )
        out[name] = _kustomize(root)
    return out


def _of(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def _named(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"one {kind}/{name}, got {len(found)}"
    return found[0]


def _deployment(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return _named(objs, "Deployment", kind)


def _main(dep: dict[str, Any]) -> dict[str, Any]:
    containers = dep["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{dep['metadata']['name']}: one container per pod"
    return containers[0]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists) against labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and labels.get(key) in values)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def _pod_labels(objs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in _of(objs, "Deployment")}


@pytest.fixture(params=list(OVERLAYS) + ["cpu+all-components"])
def objs(request: pytest.FixtureRequest, rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return rendered[request.param]


def test_overlays_render_every_role(objs) -> None:
    assert {d["metadata"]["name"] for d in _of(objs, "Deployment")} == set(KINDS)
    assert {o["metadata"]["namespace"] for o in objs if o["kind"] != "Namespace"} == {"specdec"}
    for dep in _of(objs, "Deployment"):
        rolling = dep["spec"]["strategy"]["rollingUpdate"]
        assert rolling["maxSurge"] or rolling["maxUnavailable"], f"{dep['metadata']['name']}: the roll-out cannot move"
        assert dep["spec"]["revisionHistoryLimit"] >= 2, "`kubectl rollout undo` needs the previous ReplicaSets"


def test_core_kinds_validate_strictly_against_kubernetes_schemas(objs) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the `test` extra)")
    versions = [kv.latest_version() if v == "latest" else v for v in K8S_VERSIONS]
    checked = 0
    for obj in objs:
        if obj["kind"] in CRD_KINDS:
            continue
        for version in versions:
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as err:
                where = "/".join(str(p) for p in err.absolute_path)
                pytest.fail(
                    f"{obj['kind']}/{obj['metadata']['name']} against Kubernetes {version}: {where}: {err.message}"
                )
        checked += 1
    assert checked >= 19


def test_only_known_kinds(objs) -> None:
    core = {
        "Namespace",
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "NetworkPolicy",
        "PersistentVolumeClaim",
        "Ingress",
    }
    assert {o["kind"] for o in objs} <= core | CRD_KINDS


def test_every_container_is_probed_sized_and_locked_down(objs) -> None:
    for dep in _of(objs, "Deployment"):
        name = dep["metadata"]["name"]
        pod = dep["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False, name
        psc = pod["securityContext"]
        assert (
            psc["runAsNonRoot"] is True and psc["runAsUser"] != 0 and psc["seccompProfile"]["type"] == "RuntimeDefault"
        )
        for c in pod.get("initContainers", []) + pod["containers"]:
            where = f"{name}/{c['name']}"
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][part]), f"{where}: resources.{part}"
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), where
            assert not sc.get("privileged"), where
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            volumes = {v["name"]: v for v in pod["volumes"]}
            if c in pod["containers"]:  # (init containers write only to the model volume: test_pull_models_...)
                assert "emptyDir" in volumes[mounts["/tmp"]], f"{where}: /tmp must be a writable emptyDir"
            cache = _env(c)["SPECDEC_CACHE_DIR"]["value"]
            assert "persistentVolumeClaim" in volumes[mounts[cache]], f"{where}: the model volume"
        main = _main(dep)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in main, f"{name}: no {probe}"
        assert main["readinessProbe"] != main["livenessProbe"], f"{name}: readiness and liveness are separate checks"
        env = _env(main)
        assert env["TMPDIR"]["value"] == "/tmp" and env["HOME"]["value"] == "/tmp", name


def _grpc_port(dep: dict[str, Any]) -> int:
    return next(p["containerPort"] for p in _main(dep)["ports"] if p["name"] == "grpc")


def test_probes_ask_the_grpc_health_service(objs) -> None:
    for kind in KINDS:
        dep = _deployment(objs, kind)
        main, port = _main(dep), _grpc_port(dep)
        env = _env(main)
        service = f"specdec.v1.{kind.capitalize()}Service"
        for name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = main[name]
            if "grpc" in probe:  # the kubelet's native gRPC probe (plaintext): the main port, or under TLS
                assert "exec" not in probe  # the plaintext health port (health checks only)
                if "SPECDEC_TLS_CERT" in env:
                    assert probe["grpc"]["port"] == int(env["SPECDEC_HEALTH_PORT"]["value"]), f"{kind} {name}"
                else:
                    assert probe["grpc"]["port"] == port, f"{kind} {name}"
                asked = probe["grpc"].get("service", "")
            else:  # under TLS: the image's health check client with the pod's certificate
                cmd = probe["exec"]["command"]
                assert cmd[:3] == ["python", "/opt/specdec/healthcheck.py", str(port)], f"{kind} {name}: {cmd}"
                asked = cmd[3] if len(cmd) > 3 else ""
            assert asked == (service if name == "readinessProbe" else ""), f"{kind} {name} asks for {asked!r}"


def test_verifier_startup_probe_allows_a_long_model_load(objs) -> None:
    probe = _main(_deployment(objs, "verifier"))["startupProbe"]
    assert probe["failureThreshold"] * probe["periodSeconds"] >= 20 * 60
    drafter = _main(_deployment(objs, "drafter"))["startupProbe"]
    assert drafter["failureThreshold"] * drafter["periodSeconds"] >= 5 * 60


def test_termination_grace_covers_prestop_and_the_drain(objs) -> None:
    for dep in _of(objs, "Deployment"):
        main = _main(dep)
        kind = dep["metadata"]["name"]
        cmd = main["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[0] == "sleep", kind
        pre_stop = float(cmd[1])
        default = config.SERVICE_CONFIGS[kind]().shutdown_timeout_s
        shutdown = float(_env(main).get("SPECDEC_SHUTDOWN_TIMEOUT_S", {}).get("value", default))
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert pre_stop >= 5, f"{kind}: preStop sleep long enough for endpoints to drop the pod"
        assert grace >= pre_stop + shutdown + serving.GRACE_S, f"{kind}: {grace} < {pre_stop} + {shutdown} + grace"


def test_ports_match_the_config_defaults(objs) -> None:
    for kind in KINDS:
        cfg = config.SERVICE_CONFIGS[kind]()
        main = _main(_deployment(objs, kind))
        ports = {p["name"]: p["containerPort"] for p in main["ports"]}
        want = {"grpc": cfg.port, "metrics": cfg.metrics_port} | ({"http": cfg.rest_port} if kind == "gateway" else {})
        if "SPECDEC_HEALTH_PORT" in _env(main):  # under TLS: the plaintext health port the probes use
            want["health"] = int(_env(main)["SPECDEC_HEALTH_PORT"]["value"])
        assert ports == want, kind
        env = _env(main)
        assert (
            int(env["SPECDEC_PORT"]["value"]) == cfg.port
            and int(env["SPECDEC_METRICS_PORT"]["value"]) == cfg.metrics_port
        )
        if kind == "gateway":
            assert int(env["SPECDEC_REST_PORT"]["value"]) == cfg.rest_port
        assert env["SPECDEC_HOST"]["value"] == "0.0.0.0"


def test_env_names_are_specdec_settings(objs) -> None:
    for kind in KINDS:
        dep = _deployment(objs, kind)
        fields = {config.env_name(f) for f in config.SERVICE_CONFIGS[kind].__dataclass_fields__}
        for c in dep["spec"]["template"]["spec"]["containers"]:
            unknown = {n for n in _env(c) if n.startswith("SPECDEC_")} - fields - OTHER_ENV
            assert not unknown, (
                f"{kind}: {unknown} are not settings of specdec.config.{config.SERVICE_CONFIGS[kind].__name__}"
            )


def test_services_and_headless_services_reach_the_right_pods(objs) -> None:
    pods = _pod_labels(objs)
    services = {s["metadata"]["name"]: s for s in _of(objs, "Service")}
    for kind in KINDS:
        dep = _deployment(objs, kind)
        names = {p["name"]: p["containerPort"] for p in _main(dep)["ports"]}
        svc = services[kind]
        assert [k for k, labels in pods.items() if _matches({"matchLabels": svc["spec"]["selector"]}, labels)] == [kind]
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names and port["port"] == names[port["targetPort"]], f"{kind}: {port}"
    for kind in ("verifier", "drafter"):
        headless = services[f"{kind}-headless"]
        assert headless["spec"]["clusterIP"] == "None"
        assert [k for k, labels in pods.items() if _matches({"matchLabels": headless["spec"]["selector"]}, labels)] == [
            kind
        ]
        assert [p["port"] for p in headless["spec"]["ports"]] == [config.SERVICE_CONFIGS[kind]().port]


def test_gateway_finds_peers_through_the_headless_services(objs) -> None:
    env = _env(_main(_deployment(objs, "gateway")))
    names = list(env)
    for kind in ("verifier", "drafter"):
        address = env[f"SPECDEC_{kind.upper()}_ADDRESS"]["value"]
        port = config.SERVICE_CONFIGS[kind]().port
        assert address == f"dns:///{kind}-headless.$(POD_NAMESPACE).svc.cluster.local:{port}", address
        # $(POD_NAMESPACE) expands only when defined earlier in the list
        assert names.index("POD_NAMESPACE") < names.index(f"SPECDEC_{kind.upper()}_ADDRESS")
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_api_keys_come_from_a_secret_mounted_as_a_file(objs) -> None:
    """SPECDEC_API_KEY_FILE names a file of the Secret's volume (not SPECDEC_API_KEYS, whose value an
    environment shows); the Secret is not optional, so the gateway never starts without keys."""
    deployment = _deployment(objs, "gateway")
    main = _main(deployment)
    env = _env(main)
    assert "SPECDEC_API_KEYS" not in env
    path = env["SPECDEC_API_KEY_FILE"]["value"]
    mount = next(m for m in main["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    assert mount.get("readOnly") is True
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    secret = volume["secret"]
    assert secret["secretName"] == "specdec-api-keys" and not secret.get("optional")
    assert [(i["key"], i["path"]) for i in secret["items"]] == [
        ("api-keys", path[len(mount["mountPath"]) :].lstrip("/"))
    ]
    assert secret["defaultMode"] & 0o007 == 0, "not readable by others"
    for obj in _of(objs, "ConfigMap"):
        assert not any(
            re.search(r"(^|_)(API_?KEYS?|KEY|TOKEN|PASSWORD|SECRET)(_|$)", k, re.I) for k in obj.get("data", {})
        ), obj


def test_network_policy_lets_only_gateways_reach_verifiers_and_drafters(objs) -> None:
    pods = _pod_labels(objs)
    policies = _of(objs, "NetworkPolicy")
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    assert deny and deny[0]["spec"]["policyTypes"] == ["Ingress"], "a default deny of ingress in the namespace"
    for kind in ("verifier", "drafter"):
        cfg = config.SERVICE_CONFIGS[kind]()
        selecting = [p for p in policies if p["spec"]["podSelector"] and _matches(p["spec"]["podSelector"], pods[kind])]
        assert len(selecting) == 1, f"{kind}: one policy selects its pods"
        spec = selecting[0]["spec"]
        assert "Ingress" in spec["policyTypes"]
        for other in KINDS:  # it selects exactly these pods
            assert _matches(spec["podSelector"], pods[other]) == (other == kind)
        for rule in spec["ingress"]:
            peers = rule.get("from")
            assert peers, f"{kind}: an ingress rule without `from` lets everyone in"
            ports = {p["port"] for p in rule.get("ports", [])}
            assert ports, f"{kind}: every rule names its ports"
            for peer in peers:
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    # pods of this namespace: gateways only, to the gRPC port only
                    allowed = [k for k, labels in pods.items() if _matches(peer["podSelector"], labels)]
                    assert allowed == ["gateway"], f"{kind}: pods {allowed} may connect"
                    assert ports == {cfg.port}, kind
                else:  # another namespace (Prometheus): the metrics port only
                    assert "ipBlock" not in peer, kind
                    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
                    assert ports == {cfg.metrics_port}, f"{kind}: monitoring may reach {ports}"
        gateway_rules = [
            r
            for r in spec["ingress"]
            if any("namespaceSelector" not in p and _matches(p["podSelector"], pods["gateway"]) for p in r["from"])
        ]
        assert gateway_rules, f"{kind}: gateways must be let in"


def test_a_pod_disruption_budget_per_deployment(objs) -> None:
    pods = _pod_labels(objs)
    pdbs = _of(objs, "PodDisruptionBudget")
    for kind, labels in pods.items():
        mine = [p for p in pdbs if _matches(p["spec"]["selector"], labels)]
        assert len(mine) == 1, f"{kind}: {len(mine)} PDBs"
        spec = mine[0]["spec"]
        assert [k for k, other in pods.items() if _matches(spec["selector"], other)] == [kind]
        # maxUnavailable: a single replica never blocks a node drain forever
        assert spec.get("maxUnavailable") == 1 and "minAvailable" not in spec


def test_drafters_and_gateways_autoscale_on_cpu(objs) -> None:
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in _of(objs, "HorizontalPodAutoscaler")}
    assert set(hpas) == {"drafter", "gateway"}
    for kind, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
        assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
        assert "replicas" not in _deployment(objs, kind)["spec"], f"{kind}: the HPA owns replicas"


def test_images_are_the_dockerfile_targets_pinned(objs) -> None:
    targets = set(re.findall(r"^FROM \S+ AS ([\w-]+)", (REPO / "deploy/docker/Dockerfile").read_text(), re.M))
    for dep in _of(objs, "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            image, _, tag = c["image"].rpartition(":")
            assert tag and tag != "latest" and re.search(r"\d", tag), c["image"]
            assert image.startswith("specdec/") and image.split("/")[-1] in targets, c["image"]


def test_gpu_overlay_requests_a_gpu_and_the_cuda_image(rendered) -> None:
    for name in ("gpu", "production"):
        verifier = _main(_deployment(rendered[name], "verifier"))
        assert verifier["image"].startswith("specdec/verifier-cuda:")
        assert verifier["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert verifier["resources"]["requests"]["nvidia.com/gpu"] == 1
        tolerations = _deployment(rendered[name], "verifier")["spec"]["template"]["spec"]["tolerations"]
        assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)
        for kind in ("drafter", "gateway"):  # only the verifier takes GPUs
            assert "nvidia.com/gpu" not in str(_deployment(rendered[name], kind))
    cpu = _main(_deployment(rendered["cpu"], "verifier"))
    assert cpu["image"].startswith("specdec/verifier-cpu:") and "nvidia.com/gpu" not in str(cpu)
    models = _named(
        rendered["cpu"], "ConfigMap", next(c["metadata"]["name"] for c in _of(rendered["cpu"], "ConfigMap"))
    )["data"]
    assert models["MODEL_PAIR"] == "qwen-coder" and models["VERIFIER_MODEL"] == "qwen-coder/target"


def _models_volume(dep: dict[str, Any]) -> dict[str, Any]:
    return next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "models")


def test_every_role_reads_its_model_from_the_read_only_model_volume(rendered) -> None:
    """The base: a PersistentVolumeClaim, ReadOnlyMany, mounted read-only at SPECDEC_CACHE_DIR
    (/models) by the three services; no init container (pulling is components/pull-models)."""
    for name in OVERLAYS:
        objs = rendered[name]
        claim = _named(objs, "PersistentVolumeClaim", "specdec-models")
        assert claim["spec"]["accessModes"] == ["ReadOnlyMany"], name
        for dep in _of(objs, "Deployment"):
            where = f"{name}/{dep['metadata']['name']}"
            pod = dep["spec"]["template"]["spec"]
            assert not pod.get("initContainers"), f"{where}: pulling is opt-in (components/pull-models)"
            assert _models_volume(dep) == {
                "name": "models",
                "persistentVolumeClaim": {"claimName": "specdec-models", "readOnly": True},
            }, where
            main = _main(dep)
            (mount,) = [m for m in main["volumeMounts"] if m["name"] == "models"]
            assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}, where
            assert _env(main)["SPECDEC_CACHE_DIR"]["value"] == "/models", where
    keys = _of(rendered["cpu"], "ConfigMap")[0]["data"]
    assert set(keys) == {"MODEL_PAIR", "VERIFIER_MODEL", "DRAFTER_MODEL", "TOKENIZER"}


# what each role's init container pulls (components/pull-models): its own model, the gateway only
# the tokenizer; and the ConfigMap key its main container reads the same reference from
PULLS = {
    "verifier": (["$(VERIFIER_MODEL)"], "VERIFIER_MODEL", "SPECDEC_MODEL"),
    "drafter": (["$(DRAFTER_MODEL)"], "DRAFTER_MODEL", "SPECDEC_MODEL"),
    "gateway": (["$(TOKENIZER)", "--tokenizer"], "TOKENIZER", "SPECDEC_TOKENIZER"),
}


def test_pull_models_component_pulls_each_roles_own_model_onto_the_model_volume(rendered) -> None:
    objs = rendered["cpu+all-components"]
    claim = _named(objs, "PersistentVolumeClaim", "specdec-models")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "written by pods on every node"
    images = {kind: _main(_deployment(objs, kind))["image"] for kind in KINDS}
    for kind in KINDS:
        dep = _deployment(objs, kind)
        pod = dep["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        args, key, main_var = PULLS[kind]
        assert init["command"] == ["specdec", "models", "pull", *args], kind
        env = _env(init)
        ref = env[key]["valueFrom"]["configMapKeyRef"]
        assert ref["key"] == key and ref["name"] == _of(objs, "ConfigMap")[0]["metadata"]["name"], kind
        main_env = _env(_main(dep))
        assert main_env[main_var]["valueFrom"]["configMapKeyRef"] == env[key]["valueFrom"]["configMapKeyRef"], (
            f"{kind}: pulls the model its service reads"
        )
        # the image the overlay set for the service (the gateway's has no GGUF reader: the drafter's)
        assert init["image"] == images["drafter" if kind == "gateway" else kind], kind
        # it writes only to the model volume: the one mount it has, read-write; a read-only root;
        # every place pip, Python and Hugging Face write (TMPDIR, HOME, caches) on that volume
        assert init["volumeMounts"] == [{"name": "models", "mountPath": "/models"}], kind
        assert init["securityContext"]["readOnlyRootFilesystem"] is True
        assert _models_volume(dep)["persistentVolumeClaim"] == {"claimName": "specdec-models", "readOnly": False}
        paths = {name: e["value"] for name, e in env.items() if "value" in e}
        assert paths["SPECDEC_CACHE_DIR"] == "/models"
        for var in ("TMPDIR", "HOME", "HF_HOME", "XDG_CACHE_HOME"):
            assert paths[var].startswith("/models/.staging/"), f"{kind}: {var}={paths[var]}"
        # the service still mounts it read-only
        (mount,) = [m for m in _main(dep)["volumeMounts"] if m["name"] == "models"]
        assert mount["readOnly"] is True, kind


def test_pull_cli_takes_what_the_init_containers_pass() -> None:
    """`specdec models pull PAIR/ROLE` and `--tokenizer` exist as the component calls them."""
    done = subprocess.run(
        [sys.executable, "-m", "specdec_cli", "models", "pull", "--help"],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert "--tokenizer" in done.stdout and "PAIR[/ROLE]" in done.stdout, done.stdout


# ---- the optional components (CRDs: checked structurally) ---------------------------------------


def test_mtls_mounts_the_certificates_cert_manager_issues(rendered) -> None:
    objs = rendered["production"]
    certs = {c["spec"]["secretName"]: c for c in _of(objs, "Certificate")}
    issuers = {i["metadata"]["name"] for i in _of(objs, "Issuer")}
    for kind in KINDS:
        dep = _deployment(objs, kind)
        env = _env(_main(dep))
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        secret = volumes["tls"]["secret"]["secretName"]
        assert secret == f"specdec-{kind}-tls" and secret in certs
        mount = next(m for m in _main(dep)["volumeMounts"] if m["name"] == "tls")
        assert mount["readOnly"] is True and "subPath" not in mount, "subPath mounts never see a rotation"
        for var, file in (
            ("SPECDEC_TLS_CERT", "tls.crt"),
            ("SPECDEC_TLS_KEY", "tls.key"),
            ("SPECDEC_TLS_CA", "ca.crt"),
        ):
            assert env[var]["value"] == f"{mount['mountPath']}/{file}"
        spec = certs[secret]["spec"]
        assert spec["uris"] == [f"spiffe://specdec/{kind}"], "each role its own identity"
        if kind != "gateway":
            assert env["SPECDEC_TLS_CLIENT_AUTH"]["value"] == "require", f"{kind}: only gateways get in"
            assert env["SPECDEC_TLS_ALLOWED_PEERS"]["value"] == "spiffe://specdec/gateway", f"{kind}: only gateways"
            assert "client auth" not in spec["usages"], f"{kind}: its host cannot call anything with it"
        else:
            assert {"server auth", "client auth"} <= set(spec["usages"]), "the gateway presents its own to its peers"
        assert spec["issuerRef"]["name"] in issuers and spec["issuerRef"]["kind"] == "Issuer"
        assert spec["privateKey"]["rotationPolicy"] == "Always" and "renewBefore" in spec
        if kind != "gateway":  # the name the gateway dials (dns:///<kind>-headless.<ns>.svc.cluster.local)
            assert f"{kind}-headless.specdec.svc.cluster.local" in spec["dnsNames"]
    ca = _named(objs, "Certificate", "specdec-ca")["spec"]
    assert ca["isCA"] is True and _named(objs, "Issuer", "specdec-ca")["spec"]["ca"]["secretName"] == ca["secretName"]


def test_keda_scales_verifiers_on_an_exported_queue_metric(rendered) -> None:
    objs = rendered["production"]
    (scaled,) = _of(objs, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "verifier"}
    assert "replicas" not in _deployment(objs, "verifier")["spec"], "KEDA's HPA owns the verifiers' replicas"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    names = set(re.findall(r"specdec:[A-Za-z0-9_:]+", trigger["metadata"]["query"]))
    gauges = {
        m.name
        for cls in (telemetry.VerifierMetrics, telemetry.GatewayMetrics)
        for m in cls(CollectorRegistry()).registry.collect()
        if m.type == "gauge"
    }
    assert names and names <= gauges, f"{names}: queue depth is a gauge the services export"
    assert (
        scaled["spec"]["minReplicaCount"] >= 1 and scaled["spec"]["maxReplicaCount"] > scaled["spec"]["minReplicaCount"]
    )


def test_service_monitor_scrapes_every_metrics_port(rendered) -> None:
    objs = rendered["production"]
    (monitor,) = _of(objs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selected = [s for s in _of(objs, "Service") if _matches(monitor["spec"]["selector"], s["metadata"]["labels"])]
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    scraped = {s["metadata"]["name"] for s in selected if any(p["name"] in ports for p in s["spec"]["ports"])}
    assert scraped == set(KINDS), scraped
    (rule,) = _of(objs, "PrometheusRule")
    assert rule["spec"]["groups"], "the alert rules ship with the ServiceMonitor"


def test_tracing_component(rendered) -> None:
    objs = rendered["cpu+all-components"]
    for kind in KINDS:
        env = _env(_main(_deployment(objs, kind)))
        assert env["OTEL_TRACES_EXPORTER"]["value"] == "otlp" and env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"]


def test_ingress_component_exposes_only_the_gateways_client_ports_under_tls(rendered) -> None:
    """REST under /v1 to the gateway's `http` port, gRPC (the GatewayService only) to its `grpc`
    port, TLS on every host; never /metrics, the health service or the peers. (Without
    components/mtls: the gateway serves plaintext behind the ingress, so GRPC, not GRPCS.)"""
    objs = rendered["cpu+ingress"]
    assert "SPECDEC_TLS_CERT" not in _env(_main(_deployment(objs, "gateway")))
    gateway = _named(objs, "Service", "gateway")
    ports = {p["name"] for p in gateway["spec"]["ports"]}
    seen = {}
    for ingress in _of(objs, "Ingress"):
        spec = ingress["spec"]
        tls_hosts = {h for t in spec["tls"] for h in t["hosts"]}
        for rule in spec["rules"]:
            assert rule["host"] in tls_hosts, f"{ingress['metadata']['name']}: {rule['host']} without TLS"
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                assert backend["name"] == "gateway" and backend["port"]["name"] in ports - {"metrics"}
                seen[backend["port"]["name"]] = (path["path"], ingress["metadata"]["annotations"])
    assert set(seen) == {"http", "grpc"}
    assert seen["http"][0] == "/v1"
    assert seen["grpc"][0] == "/specdec.v1.GatewayService"
    assert seen["grpc"][1]["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
    assert seen["http"][1]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off", "streams token by token"
