"""SIGUSR1 makes a running service write every thread's stack to its log, and it goes on serving
(specdec.serving.serve; docs/observability.md "A service that stalls"). The tests' stall reports
(gen.stall_report, used when a request gets no answer) rely on it."""

from __future__ import annotations

from gen import generate_all, spec, stall_report


def test_sigusr1_dumps_every_thread_and_the_services_go_on(services) -> None:
    verifier, drafter, gateway = services.verifier, services.drafters["mid"], services.gateways["mid"]
    reports = {svc.kind: stall_report(svc) for svc in (verifier, drafter, gateway)}
    for kind, report in reports.items():
        assert "most recent call first" in report, f"{kind}: no stack dump:\n{report}"
        assert "not within" not in report, f"{kind}: the dump did not settle:\n{report}"
    # the verifier's engine thread (its step loop) and its gauges are in the report
    assert "verifier/engine.py" in reports["verifier"] and "_loop" in reports["verifier"], reports["verifier"]
    assert "specdec:verifier_engine_running" in reports["verifier"], reports["verifier"][:2000]
    # each still serves: a generation through all three
    for svc in (verifier, drafter, gateway):
        assert svc.proc.poll() is None, f"{svc.kind} exited after SIGUSR1 ({svc.proc.returncode}); {svc.log_path}"
    (response,) = generate_all(gateway.address, [spec([5, 6, 7, 8], 8, gamma=4, ignore_eos=True)])
    assert len(response.token_ids) == 8 and response.stats.drafted_tokens > 0, response
