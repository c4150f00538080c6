"""Test-only fault injection for the real services: a plugin the e2e stacks load, switched at run time.

Production code never imports this module and has no fault settings. A service loads it only
when started with `SPECDEC_PLUGINS=faultkit:install` and this folder on its PYTHONPATH
(tests/conftest.py's `Services` does both for every verifier and drafter it starts);
specdec.serving.load_plugins then calls `install(service, servicer)`, which hooks:

    verifier  TargetEngine.step_hooks (a slow step, a slow prefill), and wraps
              TargetEngine.abort (the "abort disabled" fault)
    drafter   DrafterServicer.step_hooks (a slow draft step, a slow prefill chunk)

Faults (all off by default; see `Faults`), set three ways:
    - at start: `SPECDEC_FAULTS` holds a JSON object of Faults fields (a whole stack, e.g. to
      show a test fails with the verifier's abort disabled, docs/testing-faults.md);
    - at run time: with `SPECDEC_FAULTS_CONTROL=PATH` the service listens on 127.0.0.1, on a
      port the system picks (so no other process can take it first), and writes that port to
      PATH before it serves; there it answers `PUT /faults` (a JSON object of Faults fields,
      replacing the whole set) and `GET /faults`. The answer comes once the new set is in force
      (the hooks read it on their next call), so a test that waits for it never needs to sleep:
      `switch(control_port(PATH), ...)`;
    - `trace_file` in the set (verifier): spans the verifier ends from then on are also written
      to that JSON-lines file (specdec.telemetry's exporter), so a test tracing its own requests
      can share the session's verifier; "" stops it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("specdec.faultkit")

PLUGIN = "faultkit:install"
FAULTS_ENV = "SPECDEC_FAULTS"
CONTROL_ENV = "SPECDEC_FAULTS_CONTROL"


@dataclass(frozen=True)
class Faults:
    """One set of faults; a service applies the fields of its kind and ignores the rest.

    step_delay_ms, step_every   verifier: sleep step_delay_ms in every step_every-th engine step,
                                before its scheduler runs (0: never)
    prefill_delay_ms            verifier: sleep this long in every engine step that starts a new
                                request's prefill (a long prompt, a queue)
    token_delay_ms              verifier: sleep token_delay_ms x the tokens each engine step
                                computes, once scheduled (a step whose cost grows with its batch,
                                as a saturated verifier's does: adaptive gamma backs off)
    abort_disabled              verifier: a call that ends unfinished (cancelled, past its
                                deadline) does not abort its engine request, which runs on
    draft_delay_ms, draft_every drafter: sleep draft_delay_ms in every draft_every-th draft
                                step of each session (0: never)
    draft_prefill_delay_ms      drafter: sleep this long after every prefill chunk (a drafter
                                slower to prefill than its target: a long prompt, a queue)
    trace_file                  verifier: also export its spans to this JSON-lines file ("": no)
    """

    step_delay_ms: float = 0.0
    step_every: int = 0
    prefill_delay_ms: float = 0.0
    token_delay_ms: float = 0.0
    abort_disabled: bool = False
    draft_delay_ms: float = 0.0
    draft_every: int = 0
    draft_prefill_delay_ms: float = 0.0
    trace_file: str = ""

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Faults:
        """A set from a JSON object; an unknown or mistyped field raises ValueError naming it."""
        known = {f.name: f for f in fields(cls)}
        for name, value in data.items():
            if name not in known:
                raise ValueError(f"faults.{name}: unknown fault (known: {', '.join(known)})")
            kind = type(known[name].default)
            if not isinstance(value, kind) and not (kind is float and isinstance(value, int)):
                raise ValueError(f"faults.{name}: expected {kind.__name__}, got {value!r}")
        return cls(**data)


class Injector:
    """The faults in force in one service process, and what they did (`skipped_aborts`)."""

    def __init__(self, faults: Faults | None = None) -> None:
        self.faults = faults or Faults()  # replaced whole (one reference store), read by the hooks
        self.skipped_aborts = 0
        self._spans: Any = None  # the JSON-lines exporter of faults.trace_file, when set

    def set(self, faults: Faults) -> dict[str, Any]:
        if faults.trace_file != self.faults.trace_file:
            self._switch_trace_file(faults.trace_file)
        self.faults = faults
        return self.state()

    def state(self) -> dict[str, Any]:
        return {"faults": asdict(self.faults), "skipped_aborts": self.skipped_aborts}

    # ---- the hooks --------------------------------------------------------------------------
    def engine_step(self, step: int, scheduled: Any) -> None:
        """TargetEngine.step_hooks: the slow step (before scheduling), the slow prefill and the
        per-token cost (after)."""
        f = self.faults
        if scheduled is None:
            if f.step_every and f.step_delay_ms and step % f.step_every == 0:
                time.sleep(f.step_delay_ms / 1e3)
            return
        if f.prefill_delay_ms and scheduled.new_requests:
            time.sleep(f.prefill_delay_ms / 1e3)
        if f.token_delay_ms and scheduled.total_tokens:
            time.sleep(f.token_delay_ms * scheduled.total_tokens / 1e3)

    def draft_step(self, session: Any) -> None:
        """DrafterServicer.step_hooks: the slow prefill chunk (`ready` not yet), the slow draft step."""
        f = self.faults
        if not session.ready:
            if f.draft_prefill_delay_ms:
                time.sleep(f.draft_prefill_delay_ms / 1e3)
            return
        if f.draft_every and f.draft_delay_ms and session.steps % f.draft_every == 0:
            time.sleep(f.draft_delay_ms / 1e3)

    def wrap_abort(self, engine: Any) -> None:
        """Replace `engine.abort` (on this instance only) by one that drops the call while
        abort_disabled is set: the engine request of a call that ended runs on."""
        original = engine.abort

        def abort(request_id: str) -> None:
            if self.faults.abort_disabled:
                self.skipped_aborts += 1
                return
            original(request_id)

        engine.abort = abort

    # ---- spans ------------------------------------------------------------------------------
    def _switch_trace_file(self, path: str) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import SpanProcessor
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        from specdec.telemetry import JsonLinesExporter

        if self._spans is None:  # one processor for the process, forwarding to the current file
            injector = self

            class Forward(SpanProcessor):
                def on_end(self, span: Any) -> None:
                    current = injector._spans_to
                    if current is not None:
                        current.on_end(span)

            self._spans_to: Any = None
            self._spans = Forward()
            trace.get_tracer_provider().add_span_processor(self._spans)  # type: ignore[attr-defined]  # the SDK's TracerProvider has it; the API's type does not
        old, self._spans_to = self._spans_to, SimpleSpanProcessor(JsonLinesExporter(path)) if path else None
        if old is not None:
            old.shutdown()  # closes the previous file


def _serve_control(injector: Injector, path: str) -> ThreadingHTTPServer:
    """Serve the control port (module docstring) and write its number to `path`."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(200, injector.state())

        def do_PUT(self) -> None:  # noqa: N802
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
                faults = Faults.parse(body)
            except ValueError as err:  # json.JSONDecodeError is a ValueError
                self._answer(400, {"error": str(err)})
                return
            state = injector.set(faults)
            log.warning("faults now %s", state["faults"])
            self._answer(200, state)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, name="faultkit", daemon=True).start()
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, path)  # whole or absent: a reader never sees half a number
    return server


def install(service: str, servicer: Any) -> Injector:
    """The plugin (specdec.serving.load_plugins): hook `servicer` (module docstring)."""
    injector = Injector(Faults.parse(json.loads(os.environ.get(FAULTS_ENV) or "{}")))
    if injector.faults.trace_file:
        injector._switch_trace_file(injector.faults.trace_file)
    if service == "verifier":
        servicer.engine.step_hooks.append(injector.engine_step)
        injector.wrap_abort(servicer.engine)
    elif service == "drafter":
        servicer.step_hooks.append(injector.draft_step)
    control = os.environ.get(CONTROL_ENV)
    port = _serve_control(injector, control).server_address[1] if control else "none"
    log.warning("faultkit installed in the %s: %s (control port %s)", service, asdict(injector.faults), port)
    return injector


# ---- the tests' side -----------------------------------------------------------------------------
def control_port(path: str) -> int:
    """The control port a service wrote to `path` (SPECDEC_FAULTS_CONTROL); it is there once
    the service serves (the plugin is installed before the server starts)."""
    with open(path) as f:
        return int(f.read())


def switch(port: int, **faults: Any) -> dict[str, Any]:
    """Put this set of faults in force in the service listening on `port` (the others off), and
    return its acknowledgement once it is in force; raises if the service disagrees."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/faults",
        data=json.dumps(faults).encode(),
        method="PUT",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        state = json.loads(answer.read())
    expected = asdict(Faults.parse(faults))
    if state["faults"] != expected:
        raise AssertionError(f"faults not in force: asked {expected}, service has {state['faults']}")
    return dict(state)


def state(port: int) -> dict[str, Any]:
    """The faults in force in the service listening on `port`, and `skipped_aborts`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/faults", timeout=30) as answer:
        return dict(json.loads(answer.read()))
