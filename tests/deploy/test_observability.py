"""deploy/observability: the Grafana dashboard and the Prometheus alert rules (and the copies of
them in deploy/k8s: the PrometheusRule, KEDA's query) use only metrics the services really
export, and every PromQL expression parses.

Exported names come from a running tiny stack (tests/conftest.py's `services`): after one
generation through the "mid" gateway, the verifier's, a drafter's and that gateway's /metrics
are scraped and each family's series names derived from its type (counter: _total;
histogram: _bucket, _sum, _count; ...). Expressions are parsed with promql-parser (the Rust
parser Prometheus-compatible tools use) when it is installed, and checked for balanced
brackets and quotes always.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.client import GatewayClient, generation_spec

REPO = Path(__file__).resolve().parents[2]
OBS = REPO / "deploy" / "observability"
DASHBOARD = OBS / "grafana" / "dashboards" / "specdec.json"
ALERTS = OBS / "alerts.yml"
PROMETHEUS_RULE = REPO / "deploy" / "k8s" / "components" / "servicemonitor" / "prometheusrule.yaml"
SCALED_OBJECT = REPO / "deploy" / "k8s" / "components" / "keda" / "scaledobject.yaml"

METRIC = re.compile(r"specdec:[A-Za-z0-9_:]+")
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "untyped": ("",),
    "unknown": ("",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
}
# Grafana's variables, replaced by a value of their kind before an expression is parsed
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
REQUIRED_PANELS = {
    "Acceptance rate over time",
    "Mean accepted length over time",
    "Acceptance by position",
    "Round stage p99",
    "Latency spikes by stage",
    "Drafter fallbacks",
    "Queue depth",
    "Tokens per second",
    "Replicas serving",
    "Error rate",
    "Latency: time to first token and end-to-end",
}
REQUIRED_ALERTS = {
    "SpecdecAcceptanceCollapse",
    "SpecdecLatencySpikes",
    "SpecdecDrafterFallbacks",
    "SpecdecQueueGrowing",
    # availability, errors, latency (TTFT and end-to-end)
    "SpecdecTargetDown",
    "SpecdecNoGateway",
    "SpecdecNoVerifierServing",
    "SpecdecNoDrafterServing",
    "SpecdecErrorRate",
    "SpecdecTimeToFirstTokenHigh",
    "SpecdecEndToEndLatencyHigh",
}
PROMETHEUS_YML = OBS / "prometheus.yml"
SERVICE_MONITOR = REPO / "deploy" / "k8s" / "components" / "servicemonitor" / "servicemonitor.yaml"
README = REPO / "deploy" / "README.md"
ROLES = {"gateway", "drafter", "verifier"}
# Labels Prometheus itself puts on every target; `service`, `job` and `exported_*` are left out on
# purpose: the Prometheus Operator sets `service`/`job` from the Kubernetes Service (and compose from
# the job name), and renames a scraped `service` label (specdec:build_info's) to `exported_service`.
TARGET_LABELS = {"instance"}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dash["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return out


def _grafana_exprs() -> list[tuple[str, str]]:
    return [(f"dashboard panel {p['title']!r}", t["expr"]) for p in _panels(_dashboard()) for t in p.get("targets", [])]


def _alert_rules(path: Path) -> list[dict[str, Any]]:
    doc = yaml.safe_load(path.read_text())
    groups = doc["spec"]["groups"] if doc.get("kind") == "PrometheusRule" else doc["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _all_exprs() -> list[tuple[str, str]]:
    out = _grafana_exprs()
    out += [(f"alert {r['alert']}", r["expr"]) for r in _alert_rules(ALERTS)]
    out += [(f"PrometheusRule {r['alert']}", r["expr"]) for r in _alert_rules(PROMETHEUS_RULE)]
    scaled = yaml.safe_load(SCALED_OBJECT.read_text())
    out += [("KEDA ScaledObject", t["metadata"]["query"]) for t in scaled["spec"]["triggers"]]
    return out


def _promql(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr.replace("$labels", "").replace("$value", ""), f"unknown Grafana variable in {expr}"
    return expr


# ---- syntax: no services needed -----------------------------------------------------------------


def _balanced(expr: str) -> None:
    pairs, stack, quote = {")": "(", "]": "[", "}": "{"}, [], ""
    for ch in expr:
        if quote:
            if ch == quote:
                quote = ""
            continue
        if ch in "\"'`":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            assert stack and stack.pop() == pairs[ch], f"unbalanced {ch!r} in {expr}"
    assert not stack and not quote, f"unclosed {stack or quote} in {expr}"


@pytest.mark.parametrize(("where", "expr"), _all_exprs(), ids=lambda v: v if " " not in str(v) or len(v) < 60 else None)
def test_every_expression_parses(where: str, expr: str) -> None:
    expr = _promql(expr)
    _balanced(expr)
    parser = pytest.importorskip("promql_parser", reason="pip install promql-parser (the `test` extra)")
    try:
        parser.parse(expr)
    except ValueError as err:
        pytest.fail(f"{where}: {err}\n{expr}")


def _selector_names(expr: str) -> set[str]:
    """Metric names of the vector selectors in an expression, from the parsed tree."""
    parser = pytest.importorskip("promql_parser", reason="pip install promql-parser (the `test` extra)")
    names: set[str] = set()

    def visit(node: Any) -> None:
        if type(node).__name__ == "VectorSelector" and node.name:
            names.add(node.name)

    parser.walk(parser.parse(_promql(expr)), visit)
    return names


def test_the_regex_finds_every_metric_the_parser_finds() -> None:
    """So the name check below, done with the regex, misses no selector."""
    for where, expr in _all_exprs():
        names = _selector_names(expr)
        assert {n for n in names if n.startswith("specdec:")} == set(METRIC.findall(expr)), where
        assert {n for n in names if not n.startswith("specdec:")} <= {"up"}, f"{where}: only Prometheus's own `up`"


def test_dashboard_has_the_panels_operators_need() -> None:
    dash = _dashboard()
    panels = _panels(dash)
    titles = {p["title"] for p in panels}
    assert REQUIRED_PANELS <= titles, f"missing: {REQUIRED_PANELS - titles}"
    assert len({p["id"] for p in panels}) == len(panels), "panel ids are unique"
    assert dash["uid"] and dash["schemaVersion"] >= 36
    assert [v["name"] for v in dash["templating"]["list"] if v["type"] == "datasource"] == ["datasource"]
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}" and t["refId"], p["title"]
    stages = next(p for p in panels if p["title"] == "Round stage p99")["targets"][0]["expr"]
    assert "histogram_quantile(0.99" in stages and "stage" in stages


def test_alert_rules_are_complete_and_shipped_to_kubernetes() -> None:
    rules = _alert_rules(ALERTS)
    assert REQUIRED_ALERTS <= {r["alert"] for r in rules}
    for rule in rules:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    alerts = yaml.safe_load(ALERTS.read_text())["groups"]
    assert yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"]["groups"] == alerts, (
        "deploy/k8s/components/servicemonitor/prometheusrule.yaml must hold alerts.yml's groups"
    )


# ---- names: against what a running stack exports ------------------------------------------------


def _scrape(port: int) -> set[str]:
    """Every series name a service can expose: each family's name with its type's suffixes
    (a labelled family with no child yet shows only its HELP and TYPE, and counts too)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
        names |= {sample.name for sample in family.samples}
    return names


@pytest.fixture(scope="module")
def exported(services) -> dict[str, set[str]]:
    gateway = services.gateways["mid"]
    with GatewayClient(gateway.address, timeout_s=300) as client:
        response = client.generate(generation_spec([5, 6, 7, 8], max_tokens=16, gamma=4, ignore_eos=True))
    assert len(response.token_ids) == 16 and response.stats.drafted_tokens > 0
    running = {"gateway": gateway, "drafter": services.drafters["mid"], "verifier": services.verifier}
    return {kind: _scrape(svc.metrics_port) for kind, svc in running.items()}


def test_every_metric_used_is_exported_by_a_running_stack(exported: dict[str, set[str]]) -> None:
    available = set().union(*exported.values())
    missing = {}
    for where, expr in _all_exprs():
        unknown = {name for name in METRIC.findall(expr) if name not in available}
        if unknown:
            missing[where] = sorted(unknown)
    assert not missing, f"metrics no service exports: {missing}"
    # names in descriptions and annotations too (what an operator is told to look at)
    for path in (DASHBOARD, ALERTS, PROMETHEUS_RULE, SCALED_OBJECT):
        for name in set(METRIC.findall(path.read_text())):
            assert name in available or f"{name}_total" in available, f"{path.name}: {name}"


def test_every_family_the_operators_asked_for_is_on_the_dashboard(exported: dict[str, set[str]]) -> None:
    text = DASHBOARD.read_text()
    for name in (
        "specdec:spec_decode_num_accepted_tokens_per_pos_total",
        "specdec:round_stage_seconds_bucket",
        "specdec:latency_spikes_total",
        "specdec:drafter_fallbacks_total",
        "specdec:requests_running",
        "specdec:generation_tokens_total",
        "specdec:verifier_sessions",
        "specdec:drafter_step_seconds_sum",
    ):
        assert name in text, name
        assert any(name in names for names in exported.values()), name


def _label_names() -> set[str]:
    """Every label a specdec family has (specdec/telemetry.py), plus histograms' `le`."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase

    from specdec import telemetry

    labels = {"le", "version"}  # specdec:build_info{service, version}: its `service` is renamed by the Operator
    for cls in (telemetry.GatewayMetrics, telemetry.DrafterMetrics, telemetry.VerifierMetrics):
        for metric in vars(cls(CollectorRegistry())).values():
            if isinstance(metric, MetricWrapperBase):
                labels |= set(metric._labelnames)
    return labels


def test_label_names_used_exist_on_the_families() -> None:
    """`by (stage)`, `{{position}}`, `$labels.stage` ... name labels the families really have."""
    known = _label_names() | TARGET_LABELS | {"component"}  # component: test_both_scrape_configs_set_component
    assert {"stage", "position", "finish_reason", "reason", "term"} <= known
    used: dict[str, set[str]] = {}
    for where, expr in _all_exprs():
        for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
            used.setdefault(where, set()).update(g.strip() for g in group.split(",") if g.strip())
    for panel in _panels(_dashboard()):
        for t in panel.get("targets", []):
            used.setdefault(panel["title"], set()).update(re.findall(r"\{\{\s*([a-z_]+)\s*\}\}", t["legendFormat"]))
    for rule in _alert_rules(ALERTS):
        text = " ".join(rule["annotations"].values())
        used.setdefault(rule["alert"], set()).update(re.findall(r"\$labels\.([a-z_]+)", text))
    unknown = {where: names - known for where, names in used.items() if names - known}
    assert not unknown, f"labels no specdec family has: {unknown}"


# ---- what survives a real Prometheus (Operator) --------------------------------------------------


def _matchers(expr: str) -> list[tuple[str, str, str, str]]:
    """(metric, label, operator, value) of every label matcher in an expression."""
    parser = pytest.importorskip("promql_parser", reason="pip install promql-parser (the `test` extra)")
    found: list[tuple[str, str, str, str]] = []

    def visit(node: Any) -> None:
        if type(node).__name__ == "VectorSelector":
            found.extend((node.name or "", m.name, str(m.op).split(".")[-1], m.value) for m in node.matchers.matchers)

    parser.walk(parser.parse(_promql(expr)), visit)
    return found


def test_no_expression_keys_on_labels_a_prometheus_renames() -> None:
    """Neither `service`/`exported_service` nor `job`: their values differ between compose and the
    Operator (which sets service and job from the Kubernetes Service and renames the scraped
    `service` label); `component` (set by both scrape configurations) names a role instead."""
    renamed = {"service", "exported_service", "job"}
    for where, expr in _all_exprs():
        assert not {label for _, label, _, _ in _matchers(expr)} & renamed, f"{where}: {expr}"
        for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
            assert not {g.strip() for g in group.split(",")} & renamed, f"{where}: {expr}"
    for panel in _panels(_dashboard()):
        for t in panel.get("targets", []):
            assert not set(re.findall(r"\{\{\s*([a-z_]+)\s*\}\}", t["legendFormat"])) & renamed, panel["title"]


def test_both_scrape_configs_set_component() -> None:
    """`component` is gateway | drafter | verifier on every target: a static label per job in
    prometheus.yml (compose), a relabelling of the pods' app.kubernetes.io/component label in the
    ServiceMonitor (whose selector takes exactly those components)."""
    jobs = yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]
    compose = {sc["labels"]["component"] for job in jobs for sc in job["static_configs"]}
    assert compose == ROLES and all("component" in sc["labels"] for job in jobs for sc in job["static_configs"])
    monitor = yaml.safe_load(SERVICE_MONITOR.read_text())["spec"]
    for endpoint in monitor["endpoints"]:
        assert {
            "sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
            "targetLabel": "component",
        } in endpoint["relabelings"]
    (components,) = [
        e["values"] for e in monitor["selector"]["matchExpressions"] if e["key"] == "app.kubernetes.io/component"
    ]
    assert set(components) == ROLES
    for where, expr in _all_exprs():  # the values matched are those
        for _, label, op, value in _matchers(expr):
            if label == "component":
                assert set(value.split("|") if op == "Re" else [value]) <= ROLES, where


def test_every_label_value_matched_has_a_series_before_the_first_request() -> None:
    """A panel or alert matching finish_reason="abort", state="serving"... on a specdec family
    finds its series at 0 on a service that has served nothing yet (not "no data" until the first
    such event): the services pre-initialise those label values."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families as parse

    from specdec import telemetry

    fresh: dict[str, list[dict[str, str]]] = {}
    for cls in (telemetry.GatewayMetrics, telemetry.DrafterMetrics, telemetry.VerifierMetrics):
        for family in parse(generate_latest(cls(CollectorRegistry()).registry).decode()):
            for sample in family.samples:
                fresh.setdefault(sample.name, []).append(sample.labels)
    family_labels = _label_names() - {"le"}
    checked = 0
    for where, expr in _all_exprs():
        for metric, label, op, value in _matchers(expr):
            if not metric.startswith("specdec:") or label not in family_labels or metric == "specdec:build_info":
                continue  # Prometheus's `up`, a target label (namespace, component)
            assert op == "Equal", f"{where}: match specdec labels exactly ({label}{op}{value})"
            assert any(labels.get(label) == value for labels in fresh.get(metric, [])), (
                f"{where}: {metric}{{{label}={value!r}}} has no series until it first happens"
            )
            checked += 1
    assert checked >= 4


def test_readme_says_what_each_alert_means_and_what_to_do() -> None:
    """deploy/README.md has a section per alert: its meaning and what to do."""
    text = README.read_text()
    for rule in _alert_rules(ALERTS):
        section = re.search(rf"^#+ [^\n]*`{rule['alert']}`[^\n]*$(.*?)(?=^#)", text + "\n#", re.MULTILINE | re.DOTALL)
        assert section, f"deploy/README.md: no heading for {rule['alert']}"
        body = section.group(1)
        assert "**Means**:" in body and "**Do**:" in body, (
            f"deploy/README.md {rule['alert']}: what it means, what to do"
        )
