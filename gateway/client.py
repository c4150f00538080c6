"""The gateway's client: the one place that builds a `GenerationSpec` and calls
specdec.v1.GatewayService, in a sync and an async flavour.

The CLI (`specdec generate`, `specdec demo`), the REST bridge, `specdec bench` and the
end-to-end tests all go through it, so a new request field or call option is added here
once. Calls wait for the gateway to be ready (`wait_for_ready`) and carry a deadline.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc

from specdec.stats import SpecStats
from specdec.wire import draft_method, draft_method_name, pb, rpc

DEFAULT_TIMEOUT_S = 3600.0


def generation_spec(
    prompt: str | Sequence[int],
    *,
    gamma: int | None = None,
    drafter: str = "",
    request_id: str = "",
    **sampling: Any,
) -> "pb.GenerationSpec":
    """A GenerationSpec: a text prompt or token ids, and `sampling`, any specdec.v1.SamplingParams
    fields by their proto names (temperature, top_p, max_tokens, stop, ...; they mean what vLLM's
    SamplingParams of the same names mean: protos/specdec/v1/common.proto). None or a field left
    out keeps it unset: the gateway's defaults (max_tokens, gamma, drafter) or plain sampling's
    (greedy, top_p 1, no seed, logprobs none, skip_special_tokens true). A new proto field is
    accepted here as it is. `drafter` is a method name ("model", "ngram", "none"); ValueError
    names the known ones, and an unknown sampling field."""
    try:
        params = pb.SamplingParams(**{name: value for name, value in sampling.items() if value is not None})
    except ValueError as err:  # protobuf: "Protocol message SamplingParams has no "x" field."
        raise ValueError(f"generation_spec: {err}") from None
    spec = pb.GenerationSpec(sampling=params, drafter=draft_method(drafter), request_id=request_id)
    if isinstance(prompt, str):
        spec.prompt_text = prompt
    else:
        spec.prompt_token_ids.extend(int(t) for t in prompt)
    if gamma is not None:
        spec.gamma = gamma
    return spec


def stats_dict(stats: "pb.SpeculationStats") -> dict[str, Any]:
    """A request's speculation statistics as JSON-ready dict (proto field names, zeros kept;
    the drafter method by its user-facing name)."""
    from google.protobuf.json_format import MessageToDict

    out = MessageToDict(stats, always_print_fields_with_no_presence=True, preserving_proto_field_name=True)
    out["drafter"] = draft_method_name(stats.drafter) or "none"
    return out


def vllm_spec_metrics(stats: "pb.SpeculationStats") -> dict[str, Any]:
    """A request's speculation under vLLM's per-request names (vLLM's SpeculativeDecodingMetrics,
    `metrics.speculative_decoding` of its OpenAI responses), read from the one accumulator
    (specdec.stats.SpecStats.vllm_metrics, which defines each figure):

        num_spec_steps            target steps that verified drafts (our speculative_steps)
        num_draft_tokens          draft tokens verified (drafted_tokens)
        num_accepted_draft_tokens draft tokens accepted (accepted_tokens)
        acceptance_histogram      [num_spec_tokens + 1]: [j] = steps that accepted exactly j drafts
        mean_acceptance_length    1 + accepted / spec steps (the bonus token counted)
        draft_acceptance_rate     accepted / drafted
        num_spec_tokens           the request's gamma
    """
    return SpecStats.from_pb(stats).vllm_metrics()


def _channel_options() -> list[tuple[str, Any]]:
    """The services' own client options (message sizes, keepalive), at their defaults."""
    from specdec.config import GatewayConfig
    from specdec.security import grpc_options

    return grpc_options(GatewayConfig(), server=False)


def _credentials(tls_ca: str, tls_cert: str, tls_key: str) -> grpc.ChannelCredentials | None:
    """TLS credentials when any TLS file is given (the CA verifies the gateway; cert + key: mTLS)."""
    if not (tls_ca or tls_cert or tls_key):
        return None
    from specdec.security import channel_credentials

    return channel_credentials(tls_ca, tls_cert, tls_key)


def _auth(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class GatewayClient:
    """Blocking client, for scripts, the CLI and benchmarks. One channel per client.

    `tls_ca` (and `tls_cert` + `tls_key` for mTLS): connect with TLS; `api_key`: sent as
    `authorization: Bearer KEY` with every call."""

    def __init__(
        self,
        address: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        api_key: str | None = None,
    ) -> None:
        creds = _credentials(tls_ca, tls_cert, tls_key)
        self.channel = (
            grpc.secure_channel(address, creds, options=_channel_options())
            if creds
            else grpc.insecure_channel(address, options=_channel_options())
        )
        self.stub = rpc.GatewayServiceStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = _auth(api_key)

    def generate(self, spec: "pb.GenerationSpec") -> "pb.GenerateResponse":
        return self.stub.Generate(
            pb.GenerateRequest(spec=spec), wait_for_ready=True, timeout=self.timeout_s, metadata=self.metadata
        )

    def stream(self, spec: "pb.GenerationSpec") -> Iterator["pb.GenerateStreamResponse"]:
        """Chunks as the gateway sends them; the last one carries the finish reason, usage and stats."""
        return self.stub.GenerateStream(
            pb.GenerateStreamRequest(spec=spec), wait_for_ready=True, timeout=self.timeout_s, metadata=self.metadata
        )

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGatewayClient:
    """asyncio client, for the REST bridge and concurrent tests. Make it inside the event
    loop that uses it (a grpc.aio channel belongs to one loop). TLS and `api_key` as in
    GatewayClient; a call's own `metadata` (the REST bridge forwards its caller's key) wins."""

    def __init__(
        self,
        address: str,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        wait_for_ready: bool = True,
        *,
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        api_key: str | None = None,
    ) -> None:
        creds = _credentials(tls_ca, tls_cert, tls_key)
        self.channel = (
            grpc.aio.secure_channel(address, creds, options=_channel_options())
            if creds
            else grpc.aio.insecure_channel(address, options=_channel_options())
        )
        self.stub = rpc.GatewayServiceStub(self.channel)
        self.timeout_s = timeout_s
        self.wait_for_ready = wait_for_ready
        self.metadata = _auth(api_key)

    async def generate(
        self,
        spec: "pb.GenerationSpec",
        metadata: Any = None,
        timeout_s: float | None = None,
    ) -> "pb.GenerateResponse":
        """Generate; `timeout_s`: this call's deadline (None: the client's timeout_s)."""
        return await self.stub.Generate(
            pb.GenerateRequest(spec=spec),
            timeout=timeout_s or self.timeout_s,
            wait_for_ready=self.wait_for_ready,
            metadata=metadata or self.metadata,
        )

    def stream(
        self,
        spec: "pb.GenerationSpec",
        metadata: Any = None,
        timeout_s: float | None = None,
    ) -> grpc.aio.UnaryStreamCall[pb.GenerateStreamRequest, pb.GenerateStreamResponse]:
        """The GenerateStream call: `await call.read()` or `async for chunk in call`; cancel() stops it.
        `timeout_s`: this call's deadline (None: the client's timeout_s)."""
        return self.stub.GenerateStream(
            pb.GenerateStreamRequest(spec=spec),
            timeout=timeout_s or self.timeout_s,
            wait_for_ready=self.wait_for_ready,
            metadata=metadata or self.metadata,
        )

    async def chunks(self, spec: "pb.GenerationSpec") -> AsyncIterator["pb.GenerateStreamResponse"]:
        async for chunk in self.stream(spec):
            yield chunk

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncGatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
