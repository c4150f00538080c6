"""Shared fixtures: the tiny model pair, real services on loopback, a vLLM reference.

The end-to-end tests run the real services (separate processes, real vLLM on CPU)
on the tiny pair. One verifier serves all gateways (and the modules that need it slow or
faulty: they switch its faults at run time, `injected`); each drafter serves one draft
model and has its own gateway:
    "mid"   draft-mid (agrees often, not always)   "same" draft-same (agrees always)
    "far"   draft-far (agrees rarely)

Test tiers (docs/contributing.md): every test gets exactly one of the markers `unit` or
`e2e`, applied here by folder (pytest_collection_modifyitems), and real-model tests also
carry `slow`:
    unit  no model, no vLLM import, no service: runs in seconds (`make test-unit`)
    e2e   real services, vLLM, or the tiny models: everything under tests/e2e, the modules in
          E2E_MODULES, any test using a fixture in E2E_FIXTURES, and tests marked `e2e` by hand
    slow  the real (qwen) pair, kept out of the default suite (`make test-slow`)
A unit-only run fails if vLLM got imported or a service was started (the guards below), so
a test that needs either cannot hide in the fast tier.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import faultkit
import grpc
import pytest

from specdec.errors import exit_status
from specdec.models import resolve
from specdec_cli.launch import Service, free_port, start_service, stop_all

TESTS = Path(__file__).resolve().parent
# Folders (under tests/) whose tests all start services or vLLM.
E2E_FOLDERS = ("e2e",)
# Modules outside those folders that start services, import vLLM, or load a model throughout.
E2E_MODULES = (
    "benchmarks/test_bench.py",  # `specdec bench`: the three services and a vLLM baseline
    "benchmarks/test_link.py",  # `specdec bench-link`: the services across network namespaces
    "deploy/test_cluster.py",  # deploy/k8s run by a small kubelet: the services in pods
    "drafter/test_half_open.py",  # the real DrafterServicer on the tiny draft model
    "drafter/test_sessions.py",  # the tiny draft model, loaded with transformers
    "test_packaging.py",  # a fresh venv serving the drafter and the gateway
    "test_readme_commands.py",  # the README's commands, services included
    "verifier/test_engine_failure.py",  # a verifier servicer over a fake vLLM engine, vLLM's SamplingParams
)
# Fixtures that bring up services, build the tiny models, or run vLLM.
E2E_FIXTURES = frozenset({"services", "default_services", "stack", "gateway_address", "tiny_target", "tiny_cache"})
DRAFTS = {"mid": "tiny/draft-mid", "same": "tiny/draft-same", "far": "tiny/draft-far"}
MAX_GAMMA = 8
# The fixed-gamma verifier's draft-wait margin: a step that waits for a drafter that never
# answers waits this long (tests/e2e/test_hostile_drafter.py bounds waits by it).
DRAFT_WAIT_MARGIN_MS = 2000
# What CXX names for every verifier and drafter started here: no C++ compiler, as in the
# verifier-cpu and drafter images (deploy/docker/Dockerfile installs none). A service that asks
# inductor to compile C++ (torch.compile on the CPU) fails here as it would there
# (tests/e2e/test_logprob_ranks.py).
NO_CXX = "/nonexistent/specdec-tests-no-c++"


def _tier(item: pytest.Item) -> str:
    """'e2e' or 'unit' for one collected test (module docstring)."""
    rel = Path(str(item.path)).resolve().relative_to(TESTS).as_posix()
    if (
        rel.split("/")[0] in E2E_FOLDERS
        or rel in E2E_MODULES
        or E2E_FIXTURES & set(item.fixturenames)
        or item.get_closest_marker("e2e")
        or item.get_closest_marker("slow")
    ):
        return "e2e"
    return "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(_tier(item))


@pytest.fixture(autouse=True)
def _unit_tier_starts_no_service(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `unit` test that starts a service is misfiled: fail it, naming the fix."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(kind: str, *args: object, **kwargs: object) -> Service:
        raise AssertionError(
            f"a unit test started a {kind} service: add its module to E2E_MODULES in tests/conftest.py "
            "or mark the test `e2e`"
        )

    monkeypatch.setattr("specdec_cli.launch.start_service", refuse)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run of only `unit` tests must not have imported vLLM (module docstring)."""
    items = getattr(session, "items", [])
    if items and all(item.get_closest_marker("e2e") is None for item in items) and "vllm" in sys.modules:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(
            "\nunit tier: vLLM was imported; move the test that imports it to the e2e tier "
            "(tests/conftest.py E2E_MODULES, or @pytest.mark.e2e)",
            file=sys.stderr,
        )


# The session-scoped stacks' own services (`services`, `default_services`: their verifier, drafters
# and gateways, not the ones a module adds to them and stops): none is ever stopped before the
# session ends, so one that exits has crashed. Where it did, for every later test that needs it:
SESSION_SERVICES: list[Service] = []
_CRASHES: dict[int, tuple[Service, str]] = {}  # a crashed session service's pid -> it, the test it exited during
SESSION_FIXTURES = frozenset({"services", "default_services", "stack", "gateway_address"})
LOG_TAIL_LINES = 40


def _log_tail(svc: Service, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of `svc`'s log (where a crash says why)."""
    if svc.log_path is None or not svc.log_path.exists():
        return "(no log)"
    with open(svc.log_path, "rb") as log:
        log.seek(max(0, log.seek(0, os.SEEK_END) - 64 * 1024))
        return "\n".join(log.read().decode(errors="replace").splitlines()[-lines:])


def _crashed() -> list[Service]:
    """The session stacks' own services that have exited."""
    return [svc for svc in SESSION_SERVICES if svc.proc.poll() is not None]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Record the test during which a session service exited: the test that crashed it, or ran
    when it crashed. Every later test only finds it gone (`_session_services_alive`)."""
    yield
    for svc in _crashed():
        _CRASHES.setdefault(svc.proc.pid, (svc, item.nodeid))


@pytest.fixture(autouse=True)
def _session_services_alive(request: pytest.FixtureRequest) -> None:
    """A test that needs a session stack whose service has crashed fails at once, naming the
    service, the test it exited during and its log's last lines: not by timing out against a
    closed port (a CI run whose verifier crashed failed 43 tests with `Connection refused` and
    not a word of why)."""
    if not SESSION_FIXTURES & set(request.fixturenames):
        return
    for svc in _crashed():
        during = _CRASHES[svc.proc.pid][1] if svc.proc.pid in _CRASHES else "an earlier test's setup or teardown"
        pytest.fail(
            f"the session's {svc.kind} {svc.address} exited with {exit_status(svc.proc.returncode)} "
            f"during {during}; the last lines of its log {svc.log_path}:\n{_log_tail(svc)}",
            pytrace=False,
        )


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Each session service that crashed, once, with its log's last lines (the failures above
    only name it)."""
    for svc, during in _CRASHES.values():
        terminalreporter.section(f"the session's {svc.kind} crashed during {during}", sep="-")
        terminalreporter.line(f"{exit_status(svc.proc.returncode)}; {svc.log_path}:\n{_log_tail(svc)}")


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    return resolve("tiny/target")


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("service-logs")


class Services:
    """Handles to the running services of the session. Every verifier and drafter started here
    loads the test-only fault plugin (tests/faultkit.py, docs/testing-faults.md) with all faults
    off (or those of SPECDEC_FAULTS) and a control port: `injected(svc, ...)` switches them.
    Every verifier and drafter runs without a C++ compiler (NO_CXX), as their CPU images do."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = env or {}
        self.started: list[Service] = []
        self.verifier: Service | None = None
        self.gateways: dict[str, Service] = {}
        self.drafters: dict[str, Service] = {}
        self.defaults = False  # True: every service runs with its default settings (default_services)
        self._gateway_drafters: list[tuple[Service, str]] = []  # (gateway, its --drafter-address)

    def _start(self, kind: str, args: list[str]) -> Service:
        env = dict(self.env)
        port = free_port()
        control = ""
        if kind in ("verifier", "drafter"):  # the test-only fault plugin, all faults off (tests/faultkit.py)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            control = str(self.log_dir / f"{kind}-{port}.faults-port")
            env.update(
                {
                    "SPECDEC_PLUGINS": faultkit.PLUGIN,
                    faultkit.CONTROL_ENV: control,
                    "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p),
                }
            )
        if kind in ("verifier", "drafter"):
            env.setdefault("CXX", NO_CXX)
        svc = start_service(kind, port, args, self.log_dir, env=env, metrics_port=free_port())
        svc.faults_control = control  # type: ignore[attr-defined]  # a test-side attribute: where `injected` finds the port
        self.started.append(svc)
        return svc

    def start_verifier(self) -> Service:
        return self._start(
            "verifier",
            # --no-adaptive-gamma: the tests verify the acceptance rule at every requested gamma. With
            # adaptive gamma the tiny target, whose step cost is mostly per token, would rightly
            # verify few drafts under the suites' concurrency (its budgets: tests/verifier/test_budget.py).
            # --draft-wait-margin-ms: for the same reason every step waits for its drafts (up to
            # draft_wait_ms): the tiny target steps faster than the tiny drafter drafts, so the pace
            # cap would rightly skip most of them (the cap: tests/verifier/test_proposer.py,
            # tests/e2e/test_slow_prefill.py).
            [
                "--model",
                "tiny/target",
                "--max-gamma",
                str(MAX_GAMMA),
                "--threads",
                "1",
                "--max-num-seqs",
                "64",
                "--no-adaptive-gamma",
                "--draft-wait-margin-ms",
                str(DRAFT_WAIT_MARGIN_MS),
            ],
        )

    def start_pair(self, draft: str, verifier: Service) -> tuple[Service, Service]:
        """A drafter serving `draft` and a gateway that uses it and `verifier`."""
        # unquantised: draft-same must stay the target's twin (alpha 1); int8 drafting runs in tests/benchmarks
        drafter = self._start("drafter", ["--model", draft, "--threads", "1", "--quantize", "none"])
        return drafter, self.start_gateway(drafter.address, verifier.address)

    def start_gateway(self, drafter_address: str, verifier_address: str, extra: tuple[str, ...] = ()) -> Service:
        rest_port = free_port()
        svc = self._start(
            "gateway",
            [
                "--tokenizer",
                "tiny/target",
                "--drafter-address",
                drafter_address,
                "--verifier-address",
                verifier_address,
                "--rest-port",
                str(rest_port),
                *extra,
            ],
        )
        svc.rest_port = rest_port
        self._gateway_drafters.append((svc, drafter_address))
        return svc

    def ready(self, timeout_s: float = 300) -> None:
        """Wait until every service started here serves, and every gateway started here counts
        its drafters started here as serving. A gateway health-checks its drafters every
        health_every_s; a request that comes before it has seen its drafter serve runs as plain
        decoding ("no drafter replica serves"). A drafter that loads after the gateway's first
        check (a module's own drafters beside the session's verifier, already up) would make a
        test's first request do so (seen: test_tracing's clean phase without a draft span)."""
        for svc in self.started:
            svc.wait_ready(timeout_s)
        ours = {svc.address for svc in self.started if svc.kind == "drafter"}
        for gateway, spec in self._gateway_drafters:
            wanted = [a for a in spec.split(",") if a in ours]
            if wanted and gateway.proc.poll() is None:
                wait_drafters_seen(gateway, len(wanted), timeout_s)

    def own(self) -> list[Service]:
        """The stack's verifier, drafters and gateways (not the services a module added to it)."""
        return [svc for svc in (self.verifier, *self.drafters.values(), *self.gateways.values()) if svc is not None]

    def stop(self) -> None:
        stop_all(reversed(self.started))  # together: the session's dozen services exit in parallel


def wait_drafters_seen(gateway: Service, count: int, timeout_s: float) -> None:
    """Wait until `gateway`'s specdec:gateway_replicas{pool="drafter",state="serving"} reaches
    `count` (its drafters' pool has seen them answer SERVING)."""
    if str(TESTS / "e2e") not in sys.path:  # a run of only tests/deploy, say (as test_cluster.py does)
        sys.path.insert(0, str(TESTS / "e2e"))
    from gen import scrape, wait_for  # tests/e2e's client helpers

    serving = "specdec:gateway_replicas{pool=drafter,state=serving}"
    wait_for(
        lambda: scrape(gateway.metrics_port).get(serving, 0.0) >= count,
        timeout_s,
        f"gateway {gateway.address} sees its {count} drafter(s) serving",
    )


@contextlib.contextmanager
def injected(svc: Service, **faults: Any) -> Iterator[dict[str, Any]]:
    """Put `faults` (tests/faultkit.py's Faults fields) in force in `svc`, a verifier or drafter a
    `Services` started, for the body of the `with`; then restore the set it had. Both switches
    return once the service acknowledges them (no sleep)."""
    port = faultkit.control_port(svc.faults_control)  # type: ignore[attr-defined]  # set by Services._start
    before = faultkit.state(port)["faults"]
    try:
        yield faultkit.switch(port, **faults)
    finally:
        faultkit.switch(port, **before)


def _forget_session_services(stack: Services) -> None:
    """`stack` is stopping: its services' exits are no crash."""
    for svc in stack.own():
        if svc in SESSION_SERVICES:
            SESSION_SERVICES.remove(svc)


@pytest.fixture(scope="session")
def services(tiny_target: Path, log_dir: Path) -> Iterator[Services]:
    s = Services(log_dir)
    try:
        s.verifier = s.start_verifier()
        for name, draft in DRAFTS.items():
            s.drafters[name], s.gateways[name] = s.start_pair(draft, s.verifier)
        s.ready()
        SESSION_SERVICES.extend(s.own())
        yield s
    finally:
        _forget_session_services(s)
        s.stop()


@pytest.fixture(scope="session")
def default_services(tiny_target: Path, log_dir: Path) -> Iterator[Services]:
    """The configuration a user gets: every service with its default settings (adaptive gamma,
    the drafters' pace cap, branches and hold all on); only the model and one thread each are
    set. The greedy and sampling exactness suites run on this stack as well as on `services`,
    whose verifier fixes gamma to isolate the acceptance rule at every requested gamma."""
    s = Services(log_dir)
    s.defaults = True
    try:
        s.verifier = s._start("verifier", ["--model", "tiny/target", "--threads", "1"])
        for name, draft in DRAFTS.items():
            s.drafters[name] = s._start("drafter", ["--model", draft, "--threads", "1"])
            s.gateways[name] = s.start_gateway(s.drafters[name].address, s.verifier.address)
        s.ready()
        SESSION_SERVICES.extend(s.own())
        yield s
    finally:
        _forget_session_services(s)
        s.stop()


@contextlib.contextmanager
def one_setting_stack(log_dir: Path, *verifier_args: str) -> Iterator[Services]:
    """A module's own stack that isolates verifier settings: one verifier (`--model tiny/target
    --threads 1` and `verifier_args`, every other setting its default), a drafter of tiny/draft-mid
    with its defaults, and a gateway (`gateways["mid"]`)."""
    s = Services(log_dir)
    s.defaults = True
    try:
        s.verifier = s._start("verifier", ["--model", "tiny/target", "--threads", "1", *verifier_args])
        s.drafters["mid"] = s._start("drafter", ["--model", "tiny/draft-mid", "--threads", "1"])
        s.gateways["mid"] = s.start_gateway(s.drafters["mid"].address, s.verifier.address)
        s.ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(params=["fixed-gamma", "defaults"])
def stack(request: pytest.FixtureRequest) -> Services:
    """Each exactness test once per stack: `services` (fixed gamma: the mechanism at every
    gamma) and `default_services` (what a user runs)."""
    return request.getfixturevalue("services" if request.param == "fixed-gamma" else "default_services")


@pytest.fixture(scope="session")
def gateway_address(services: Services) -> str:
    return services.gateways["mid"].address


@pytest.fixture
def aio_channel_factory():
    """Make grpc.aio channels inside a test's event loop."""
    return lambda address: grpc.aio.insecure_channel(address)


class ReferenceWorker:
    """A plain vLLM engine serving one model for the whole session (tests/e2e/vllm_reference.py):
    one cold start per model per session, however many modules ask for references."""

    def __init__(self, model: Path, dtype: str | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS / "e2e" / "vllm_reference.py"), str(model), *([dtype] if dtype else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self._stderr: list[str] = []
        threading.Thread(target=lambda: self._stderr.extend(self.proc.stderr or []), daemon=True).start()

    def generate(self, requests: list[dict]) -> list[list[int]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(requests) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except OSError:
            line = ""
        if not line:
            raise RuntimeError("the vLLM reference worker died:\n" + "".join(self._stderr)[-4000:])
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_REFERENCES: dict[str, ReferenceWorker] = {}
_REFERENCE_LOCK = threading.Lock()


def vllm_reference(model: Path, requests: list[dict], dtype: str | None = None) -> list[list[int]]:
    """Token ids a plain vLLM engine (no speculation) generates for each request (the session's
    ReferenceWorker for `model` at `dtype`, started on first use; None: the verifier's default
    dtype for the model here)."""
    key = f"{model}@{dtype}"
    with _REFERENCE_LOCK:
        worker = _REFERENCES.get(key)
        if worker is None or worker.proc.poll() is not None:
            worker = _REFERENCES[key] = ReferenceWorker(model, dtype)
        return worker.generate(requests)


@pytest.fixture(scope="session", autouse=True)
def _reference_workers() -> Iterator[None]:
    """Stop the session's reference engines at its end."""
    yield
    for worker in _REFERENCES.values():
        worker.close()
    _REFERENCES.clear()


RunModule = Callable[..., str]


@pytest.fixture
def run_module() -> RunModule:
    """run_module(module, *args): `python -m module args` in this interpreter (the working
    directory the tests run in, the repository's root as the docs run them); its stdout, once
    it exited 0 (the benchmark modules' tests)."""

    def run(module: str, *args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    return run
