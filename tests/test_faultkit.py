"""The test-only fault plugin (tests/faultkit.py) and the hook points it uses, without a model.

- The production packages never import it, and their configs have no fault settings.
- specdec.serving.load_plugins loads nothing by default and names a malformed entry.
- Its hooks act on the real TargetEngine and DraftSession code paths: a slow step every Nth
  engine step, a slow prefill only when one starts, a slow draft step; and "abort disabled"
  really keeps TargetEngine.abort from reaching the engine's command queue (on again: it does).
- Switched at run time over its control port, acknowledged once in force; a bad field is
  refused naming it and leaves the set in force.
"""

from __future__ import annotations

import ast
import json
import urllib.error
import urllib.request
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import faultkit
import pytest

from specdec import config, serving

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION = ("specdec", "drafter", "verifier", "gateway", "benchmarks")


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The seconds each fault slept (time.sleep recorded, not slept)."""
    slept: list[float] = []
    monkeypatch.setattr(faultkit.time, "sleep", slept.append)
    return slept


def test_production_code_never_imports_the_plugin_and_has_no_fault_settings() -> None:
    for package in PRODUCTION:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                assert not any(n.split(".")[0] == "faultkit" for n in names), path
    for cls in (config.DrafterConfig, config.VerifierConfig, config.GatewayConfig):
        assert not [f.name for f in fields(cls) if "inject" in f.name or f.name.startswith("fault")], cls


def test_load_plugins_loads_nothing_by_default_and_names_a_bad_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(serving.PLUGINS_ENV, raising=False)
    assert serving.load_plugins("verifier", object()) == []
    with pytest.raises(ValueError, match="'faultkit' is not module:function"):
        serving.load_plugins("gateway", object(), "faultkit")
    calls = []
    monkeypatch.setattr(faultkit, "install", lambda name, servicer: calls.append((name, servicer)))
    servicer = object()
    monkeypatch.setenv(serving.PLUGINS_ENV, " faultkit:install ,")
    assert serving.load_plugins("drafter", servicer) == ["faultkit:install"]
    assert calls == [("drafter", servicer)]


def _bare_engine():
    """A TargetEngine, not started, over no vLLM engine: what abort and the scheduler hooks touch."""
    from prometheus_client import CollectorRegistry

    from specdec import telemetry
    from specdec.config import VerifierConfig
    from verifier.engine import TargetEngine
    from verifier.proposer import DraftBoard
    from verifier.vllm_hooks import ModelFacts

    metrics = telemetry.VerifierMetrics(CollectorRegistry())
    return TargetEngine(VerifierConfig(), None, DraftBoard(metrics=metrics), metrics, ModelFacts(100, [0], {0}))


def _queued(eng) -> list:
    out = []
    while not eng._commands.empty():
        out.append(eng._commands.get_nowait())
    return out


def test_abort_disabled_keeps_the_abort_from_the_engine_and_can_be_switched_off() -> None:
    eng = _bare_engine()
    injector = faultkit.Injector()
    injector.wrap_abort(eng)
    eng.abort("a")
    assert _queued(eng) == [("abort", "a")]  # off: the engine thread gets the abort
    injector.set(faultkit.Faults(abort_disabled=True))
    eng.abort("b")
    assert _queued(eng) == [] and injector.skipped_aborts == 1  # on: the request would run on
    injector.set(faultkit.Faults())
    eng.abort("c")
    assert _queued(eng) == [("abort", "c")]


def test_engine_step_faults_go_through_the_engines_step_hooks(sleeps: list[float]) -> None:
    from verifier.vllm_hooks import ScheduledStep

    eng = _bare_engine()
    injector = faultkit.Injector(faultkit.Faults(step_delay_ms=250, step_every=10, prefill_delay_ms=5000))
    eng.step_hooks.append(injector.engine_step)
    for _ in range(30):  # the engine thread: before the scheduler, after it, then the step count
        eng._before_schedule()
        new = 1 if eng.steps in (3, 17) else 0
        eng._on_schedule(ScheduledStep({}, {}, 0, new_requests=new, waiting=0))
        eng.steps += 1
    assert sleeps == [5.0, 0.25, 5.0, 0.25, 0.25]  # prefills at steps 4 and 18; slow steps 10, 20, 30


def test_the_token_delay_grows_with_the_steps_tokens(sleeps: list[float]) -> None:
    from verifier.vllm_hooks import ScheduledStep

    eng = _bare_engine()
    eng.step_hooks.append(faultkit.Injector(faultkit.Faults(token_delay_ms=2.0)).engine_step)
    for tokens in (1, 5, 0, 40):
        eng._before_schedule()
        eng._on_schedule(ScheduledStep({}, {}, tokens, new_requests=0, waiting=0))
    assert sleeps == [pytest.approx(0.002), pytest.approx(0.01), pytest.approx(0.08)]  # none for an empty step


def test_draft_step_faults_go_through_the_sessions_step_hooks(sleeps: list[float]) -> None:
    from drafter.sessions import NgramDraftSession

    injector = faultkit.Injector(faultkit.Faults(draft_delay_ms=100, draft_every=3))
    session = NgramDraftSession([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], gamma=8, lookahead=0, ngram_max=4, ngram_min=1)
    session.step_hooks = [injector.draft_step]
    session.started = True
    while session.ready is False or session.wants_work():
        session.step()
    assert session.steps >= 6 and sleeps == [0.1] * (session.steps // 3)


def test_the_control_port_switches_faults_with_an_acknowledgement(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    control = str(tmp_path / "drafter.faults-port")
    monkeypatch.setenv(faultkit.CONTROL_ENV, control)
    monkeypatch.setenv(faultkit.FAULTS_ENV, json.dumps({"draft_every": 5, "draft_delay_ms": 10}))
    servicer = SimpleNamespace(step_hooks=[])
    injector = faultkit.install("drafter", servicer)
    port = faultkit.control_port(control)  # written before install returned (before the service serves)
    assert servicer.step_hooks == [injector.draft_step]
    assert faultkit.state(port)["faults"]["draft_every"] == 5  # from SPECDEC_FAULTS at start
    ack = faultkit.switch(port, draft_delay_ms=250.0, draft_every=15)
    assert ack["faults"]["draft_every"] == 15 and injector.faults == faultkit.Faults(draft_delay_ms=250, draft_every=15)
    request = urllib.request.Request(f"http://127.0.0.1:{port}/faults", data=b'{"draft_evry": 1}', method="PUT")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 400 and "faults.draft_evry: unknown fault" in json.loads(err.value.read())["error"]
    with pytest.raises(ValueError, match="faults.step_every: expected int"):
        faultkit.Faults.parse({"step_every": "10"})
    assert injector.faults.draft_every == 15  # the refused set changed nothing
