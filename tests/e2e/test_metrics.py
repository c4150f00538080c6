"""Prometheus /metrics on every service: scraped, parsed, moving as requests run, and each
service's own (its families and the shared ones, none of the other services')."""

from __future__ import annotations

from gen import generate_all, scrape, scrape_families, spec
from prometheus_client import CollectorRegistry

from gateway.client import GatewayClient
from specdec import __version__, telemetry

METRICS = {
    "gateway": telemetry.GatewayMetrics,
    "drafter": telemetry.DrafterMetrics,
    "verifier": telemetry.VerifierMetrics,
}


def _own_families(service: str) -> set[str]:
    """The families a service's metrics class defines (family names, as scraped)."""
    return {m.name for m in METRICS[service](CollectorRegistry()).registry.collect()}


def test_metrics_move(services) -> None:
    gw, dr, ve = services.gateways["mid"], services.drafters["mid"], services.verifier
    before = {name: scrape(s.metrics_port) for name, s in (("gw", gw), ("dr", dr), ("ve", ve))}
    responses = generate_all(gw.address, [spec([5, 6, 7, 8], 40, gamma=4, ignore_eos=True) for _ in range(4)])
    after = {name: scrape(s.metrics_port) for name, s in (("gw", gw), ("dr", dr), ("ve", ve))}

    def moved(svc: str, name: str) -> float:
        return after[svc].get(name, 0.0) - before[svc].get(name, 0.0)

    drafted = sum(r.stats.drafted_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    assert moved("gw", "specdec:spec_decode_num_draft_tokens_total") == drafted
    assert moved("gw", "specdec:spec_decode_num_accepted_tokens_total") == accepted
    assert moved("gw", "specdec:generation_tokens_total") == 160
    assert moved("gw", "specdec:requests_total{finish_reason=length}") == 4
    assert moved("gw", "specdec:round_stage_seconds_count{stage=verify}") == sum(
        r.stats.target_steps + 1 for r in responses
    )
    assert moved("gw", "specdec:spec_decode_num_accepted_tokens_per_pos_total{position=0}") > 0
    assert after["gw"]["specdec:requests_running"] == 0
    assert moved("gw", "specdec:e2e_request_latency_seconds_count") == 4  # unary calls: no first-token time
    assert moved("gw", "specdec:time_to_first_token_seconds_count") == 0
    assert moved("dr", "specdec:drafter_blocks_total") > 0
    assert moved("ve", "specdec:verifier_engine_steps_total") > 0
    assert moved("ve", "specdec:verifier_computed_tokens_total") >= 160


def test_vllms_own_spec_decode_counts_agree_with_the_gateways(services) -> None:
    """The verifier keeps vLLM's own spec-decode stats on (its scheduler's SpecDecodingStats,
    exported under vLLM's names): over the same requests (this verifier serves nothing else
    meanwhile) they equal the sums of the responses' SpeculationStats and the gateway's
    specdec:spec_decode_* counters, to the token and per draft position."""
    gw, ve = services.gateways["mid"], services.verifier
    before = {"gw": scrape(gw.metrics_port), "ve": scrape(ve.metrics_port)}
    specs = [
        spec([5, 6, 7, 8], 40, gamma=4, ignore_eos=True),
        spec([9, 10, 11], 30, gamma=2, ignore_eos=True),
        spec([5, 6, 7, 8], 25, gamma=3, ignore_eos=True),
    ]
    responses = generate_all(gw.address, specs)
    after = {"gw": scrape(gw.metrics_port), "ve": scrape(ve.metrics_port)}

    def moved(svc: str, name: str) -> float:
        return after[svc].get(name, 0.0) - before[svc].get(name, 0.0)

    drafts = sum(r.stats.speculative_steps for r in responses)
    drafted = sum(r.stats.drafted_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    assert drafts > 0 and drafted > 0  # the requests speculated: the comparison says something
    for svc, prefix in (("ve", "vllm:"), ("gw", "specdec:")):
        assert moved(svc, f"{prefix}spec_decode_num_drafts_total") == drafts, svc
        assert moved(svc, f"{prefix}spec_decode_num_draft_tokens_total") == drafted, svc
        assert moved(svc, f"{prefix}spec_decode_num_accepted_tokens_total") == accepted, svc
    for position in range(4):
        ours = sum(
            r.stats.accepted_per_position[position] for r in responses if len(r.stats.accepted_per_position) > position
        )
        name = f"spec_decode_num_accepted_tokens_per_pos_total{{position={position}}}"
        assert moved("ve", "vllm:" + name) == ours == moved("gw", "specdec:" + name), position


def test_a_stream_records_its_time_to_first_token_and_its_end(services) -> None:
    """GenerateStream: one first-token time (arrival to the first chunk with tokens) and one
    end-to-end time, the first no later than the second."""
    gw = services.gateways["mid"]
    before = scrape(gw.metrics_port)
    with GatewayClient(gw.address, timeout_s=300) as client:
        chunks = list(client.stream(spec([5, 6, 7, 8], 12, gamma=4, ignore_eos=True)))
    after = scrape(gw.metrics_port)
    assert sum(len(c.token_ids) for c in chunks) == 12

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("specdec:time_to_first_token_seconds_count") == 1
    assert moved("specdec:e2e_request_latency_seconds_count") == 1
    assert 0 < moved("specdec:time_to_first_token_seconds_sum") <= moved("specdec:e2e_request_latency_seconds_sum")


def test_each_service_exports_only_its_own_families(services) -> None:
    running = {"gateway": services.gateways["mid"], "drafter": services.drafters["mid"], "verifier": services.verifier}
    for service, svc in running.items():
        families = scrape_families(svc.metrics_port)
        # specdec's families, and vLLM's spec-decode counters on the verifier (its metrics class has them)
        own = {f for f in families if f.startswith(("specdec:", "vllm:"))}
        assert own == _own_families(service) | {"specdec:build_info"}, service
        assert any(f.startswith("process_") for f in families) and any(f.startswith("python_gc_") for f in families)
        assert scrape(svc.metrics_port)[f"specdec:build_info{{service={service},version={__version__}}}"] == 1
