"""deploy/k8s/overlays/cpu as shipped, run by a small kubelet (tests/deploy/kubelet.py) with a
real DNS server (dnsmasq), and driven through the gateway Service's REST port
(tests/deploy/cluster_run.py does the driving; this module checks what it reports).

What the test adds to the overlay is what a user of a 2-core node would: a kustomization on
top that names the tiny pair in the specdec-models ConfigMap and sizes the containers' CPU to
the node (a kubelet would leave a pod asking for 8 cores Pending here), plus the Secrets the
manifests expect the user to create (the API keys; with mTLS, each role's certificate). The
model volume's claim is a folder the test fills with `specdec models pull tiny`, as an admin
fills a PersistentVolume.

Checked, in one cluster:
  - every Deployment's pods become Ready through the manifests' own probes;
  - the cluster DNS answers the headless names with every Ready pod's address and the ClusterIP
    names with one address;
  - generation through the gateway Service is exact (plain vLLM's tokens);
  - scale out: one more drafter pod and verifier pod; both serve generations (their own
    /metrics) soon after they are Ready (the gateway re-resolves every resolve_every_s);
  - scale in / roll: with 8 streams in flight, one pod of each Deployment is deleted as
    Kubernetes deletes pods (endpoints first, preStop, SIGTERM, SIGKILL after the grace period):
    streams are open at SIGTERM, and every stream completes, exact, none broken, unless it
    outlives the deleted gateway's drain (a slow machine), where it may end only as the drain's
    documented bound ends it: at the drain's end, still streaming, its tokens right, with an
    error event that says so.

The mTLS variant (the overlay with components/mtls and a certificate per role) is the same test
with SPECDEC_CLUSTER_MTLS=1 (slower; run by hand: docs/deployment or deploy/README.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import vllm_reference
from kubelet import unavailable_reason
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
from gen import prompts  # noqa: E402 (tests/e2e's prompts)

MAX_TOKENS = 32
STREAM_TOKENS = 1900  # a roll's stream: as long as the tiny target allows (2048 with the prompt)
API_KEY = "sk-cluster-test"

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

# what the user of a 2-core node changes: the pair, and CPU that fits the node
KUSTOMIZATION = """\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - {overlay}
{components}
configMapGenerator:
  - name: specdec-models
    behavior: merge
    literals:
      - MODEL_PAIR=tiny
      - VERIFIER_MODEL=tiny/target
      - DRAFTER_MODEL=tiny/draft-mid
      - TOKENIZER=tiny/target
patches:
{patches}
"""
PATCH = """\
  - patch: |-
      apiVersion: apps/v1
      kind: Deployment
      metadata:
        name: {name}
      spec:
        template:
          spec:
            containers:
              - name: {name}
                resources:
                  requests: {{cpu: "1", memory: 2Gi}}
                  limits: {{cpu: "1", memory: 6Gi}}
{env}"""
KV_ENV = """\
                env:
                  - name: SPECDEC_KV_CACHE_GIB
                    value: "1"
"""


def kustomization(tmp: Path, mtls: bool) -> Path:
    folder = tmp / "kustomize"
    folder.mkdir()
    overlay = os.path.relpath(REPO / "deploy/k8s/overlays/cpu", folder)
    comps = f"components:\n  - {os.path.relpath(REPO / 'deploy/k8s/components/mtls', folder)}\n" if mtls else ""
    patches = "".join(
        PATCH.format(name=n, env=KV_ENV if n == "verifier" else "") for n in ("drafter", "verifier", "gateway")
    )
    (folder / "kustomization.yaml").write_text(KUSTOMIZATION.format(overlay=overlay, components=comps, patches=patches))
    return folder


def certificates(tmp: Path) -> dict[str, dict[str, str]]:
    """A Secret specdec-ROLE-tls per role (tls.crt, tls.key, ca.crt: cert-manager's layout) from
    `specdec certs`, each role's own certificate."""
    out = tmp / "certs"
    names = (
        ",".join(
            f"{svc}.specdec.svc.cluster.local,{svc}"
            for svc in ("gateway", "drafter", "drafter-headless", "verifier", "verifier-headless")
        )
        + ",localhost"
    )
    subprocess.run(
        [sys.executable, "-m", "specdec_cli", "certs", str(out), "--hosts", names],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    files = {p.name: p.read_text() for p in out.iterdir()}
    return {
        f"specdec-{role}-tls": {
            "tls.crt": files[f"{role}.pem"],
            "tls.key": files[f"{role}-key.pem"],
            "ca.crt": files["ca.pem"],
        }
        for role in ("gateway", "drafter", "verifier")
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_target: Path) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("cluster")
    mtls = os.environ.get("SPECDEC_CLUSTER_MTLS") == "1"
    models = tmp / "models"  # the PersistentVolume behind the specdec-models claim
    subprocess.run(
        [sys.executable, "-m", "specdec_cli", "models", "pull", "tiny"],
        check=True,
        timeout=600,
        env={**os.environ, "SPECDEC_CACHE_DIR": str(models)},
        capture_output=True,
    )
    subprocess.run(["chmod", "-R", "a+rX", str(models)], check=True)
    ps = prompts(AutoTokenizer.from_pretrained(tiny_target), 12, seed=3)
    secrets = {"specdec-api-keys": {"api-keys": API_KEY}}
    tls = None
    if mtls:
        secrets.update(certificates(tmp))
        tls = {"ca": str(tmp / "certs" / "ca.pem")}  # the gateway's users authenticate with API keys (components/mtls)
    cfg = {
        "kustomization": str(kustomization(tmp, mtls)),
        "dockerfile": str(REPO / "deploy/docker/Dockerfile"),
        "claims": {"specdec-models": str(models)},
        "secrets": secrets,
        "bin_dir": str(Path(shutil.which("specdec") or Path(sys.executable).parent / "specdec").parent),
        "log_dir": str(tmp),
        "prompts": ps,
        "max_tokens": MAX_TOKENS,
        "stream_tokens": STREAM_TOKENS,
        "api_key": API_KEY,
        "tls": tls,
    }
    (tmp / "config.json").write_text(json.dumps(cfg))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "cluster_run.py"), str(tmp / "config.json")],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=REPO,
    )
    phases = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            phases[d.pop("phase")] = d
            print(
                d.get("events", "")[-12:] if "events" in d else "",
                {k: v for k, v in d.items() if k not in ("ids", "events")},
            )
    assert proc.returncode == 0, f"{proc.stderr[-4000:]}\nlogs in {tmp}"
    ref = vllm_reference(
        tiny_target,
        [
            {"prompt_token_ids": p, "max_tokens": n, "ignore_eos": True}
            for n in (MAX_TOKENS, phases["roll"]["tokens"])  # the roll's length: cluster_run sized it
            for p in ps
        ],
    )
    phases["reference"] = {"exact": ref[: len(ps)], "roll": ref[len(ps) : len(ps) + 8]}
    return phases


def test_pods_become_ready_and_dns_answers(run) -> None:
    dns, pods = run["dns"]["answers"], run["dns"]["pods"]
    for kind in ("drafter", "verifier"):
        ips = sorted(ip for name, ip in pods.items() if name.startswith(kind + "-"))
        assert dns[f"{kind}-headless.specdec.svc.cluster.local"] == ips  # every Ready pod
        assert len(dns[f"{kind}.specdec.svc.cluster.local"]) == 1  # ClusterIP: one address
    assert len(dns["gateway.specdec.svc.cluster.local"]) == 1


def test_generation_through_the_gateway_service_is_exact(run) -> None:
    assert run["exact"]["ids"] == run["reference"]["exact"]


def test_scale_out_reaches_the_new_pods(run) -> None:
    s = run["scale-out"]
    print(f"new pods served after {s['seconds']} s; generations per pod: {s['served']}")
    for name in s["new"]:
        assert s["served"][name] > 0, s
    assert s["seconds"] < 10 * 10  # resolve_every_s (10 s by default), with a 10x bound


def test_a_roll_breaks_no_stream_inside_the_drain(run) -> None:
    """Every stream open through the roll completes, exact, unless it outlives the deleted
    gateway's drain (shutdown_timeout_s after its SIGTERM): the documented bound, the only
    place a stream may end unfinished. One cut there must have been streaming up to its cut
    (tokens in the drain's last quarter: not a stream that hung) and end with the gateway's
    error event saying so (shutdown_timeout_s), with only right tokens before it."""
    r = run["roll"]
    _, drain_s = r["window"]  # (preStop sleep, drain) in seconds
    deadline = r["sigterm"] + drain_s  # the deleted gateway's drain ends (seconds after the deletion)
    print(
        f"deleted {r['deleted']} with {r['open_at_delete']} of 8 streams open, {r['open_at_sigterm']} at SIGTERM "
        f"({r['sigterm']} s later); {r['tokens']} tokens per stream, ended {r['ended']} s after the deletion "
        f"(preStop, drain: {r['window']} s)"
    )
    for ids, ref, error, ended, last in zip(
        r["ids"], run["reference"]["roll"], r["errors"], r["ended"], r["last_tokens"], strict=True
    ):
        if error is None:
            assert ids == ref
            continue
        assert ended >= deadline - 1.0, f"cut {deadline - ended:.1f} s before the drain's end: {error}"
        assert last is not None and last >= deadline - drain_s / 4, f"no tokens since {last} s: it hung, {error}"
        # the gateway's own notice as an error event: not a closed connection, not a verifier's
        # drain passed on (those generations move to another verifier)
        assert error.startswith("error event:") and "gateway: shut down before this call" in error, error
        assert ids == ref[: len(ids)]
    assert r["open_at_sigterm"] > 0  # the drain had streams to finish: 1,900 tokens outlast a preStop sleep here
