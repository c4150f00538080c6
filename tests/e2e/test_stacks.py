"""SIGUSR1 makes a running service write every thread's stack to its log, and it goes on serving
(specdec.serving.serve; docs/observability.md "A service that stalls"). The tests' stall reports
(gen.stall_report, used when a request gets no answer) rely on it. The verifier is also dumped
again and again while it generates: a dump that reads the engine thread's frames while that
thread runs Python crashes it (faulthandler's dump from the signal handler did, once, in a full
run; specdec.serving.dump_stacks says why its walk cannot)."""

from __future__ import annotations

import threading

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


def test_dumps_while_the_engine_steps_leave_the_verifier_serving(services) -> None:
    verifier, gateway = services.verifier, services.gateways["mid"]
    specs = [spec([9, 10, 11, i], 96, gamma=4, ignore_eos=True) for i in range(8)]
    responses: list = []
    worker = threading.Thread(target=lambda: responses.extend(generate_all(gateway.address, specs)))
    worker.start()
    try:
        for _ in range(20):  # each waits for its dump to be whole (stall_report)
            report = stall_report(verifier)
            assert "most recent call first" in report and "not within" not in report, report[-3000:]
            assert verifier.proc.poll() is None, f"the verifier exited during a dump; {verifier.log_path}"
    finally:
        worker.join()
    assert [len(r.token_ids) for r in responses] == [96] * 8, responses
