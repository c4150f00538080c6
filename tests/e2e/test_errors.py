"""Bad input gets INVALID_ARGUMENT naming the field, and every service keeps serving."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from gen import spec

from specdec.wire import pb, rpc

GOOD = [5, 6, 7, 8]


def _gateway_error(address: str, s: "pb.GenerationSpec") -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            rpc.GatewayServiceStub(channel).Generate(pb.GenerateRequest(spec=s), timeout=60)
    return info.value


BAD_REQUESTS = {
    "empty prompt": (pb.GenerationSpec(sampling=pb.SamplingParams(max_tokens=4)), "spec.prompt_text"),
    "token id past vocab": (spec([5, 512], 4), "spec.prompt_token_ids"),
    "negative token id": (spec([-1, 5], 4), "spec.prompt_token_ids"),
    "max_tokens zero": (spec(GOOD, 0), "spec.sampling.max_tokens"),
    "max_tokens negative": (spec(GOOD, -3), "spec.sampling.max_tokens"),
    "max_tokens past context": (spec(GOOD, 4096), "spec.sampling.max_tokens"),
    "gamma too large": (spec(GOOD, 4, gamma=99), "spec.gamma"),
    "negative temperature": (spec(GOOD, 4, temperature=-0.5), "spec.sampling.temperature"),
    "top_p zero": (spec(GOOD, 4, top_p=0.0), "spec.sampling.top_p"),
    "top_p above one": (spec(GOOD, 4, top_p=1.5), "spec.sampling.top_p"),
    "allowed token id past vocab": (spec(GOOD, 4, allowed_token_ids=[5, 512]), "spec.sampling.allowed_token_ids"),
    "unknown drafter": (
        pb.GenerationSpec(prompt_token_ids=GOOD, sampling=pb.SamplingParams(max_tokens=4), drafter=99),
        "spec.drafter",
    ),
    "both prompts": (
        pb.GenerationSpec(prompt_text="x", prompt_token_ids=GOOD, sampling=pb.SamplingParams(max_tokens=4)),
        "spec.prompt_token_ids",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_gateway_rejects_bad_input(services, gateway_address: str, case: str) -> None:
    bad, field = BAD_REQUESTS[case]
    err = _gateway_error(gateway_address, bad)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(field + ":"), err.details()


def test_gateway_still_serves_after_bad_input(services, gateway_address: str) -> None:
    for bad, _ in BAD_REQUESTS.values():
        _gateway_error(gateway_address, bad)
    with grpc.insecure_channel(gateway_address) as channel:
        r = rpc.GatewayServiceStub(channel).Generate(pb.GenerateRequest(spec=spec(GOOD, 8, gamma=4)), timeout=60)
    assert len(r.token_ids) == 8


async def _verify_session(address: str, messages: list["pb.VerifyRequest"]) -> tuple[grpc.StatusCode, str, int]:
    """Send messages on one Verify stream; return (status, details, verdicts read)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = rpc.VerifierServiceStub(channel).Verify()
        for m in messages:
            await call.write(m)
        n = 0
        try:
            while (v := await call.read()) is not grpc.aio.EOF:
                n += 1
                if v.finish_reason:
                    break
        except grpc.aio.AioRpcError as err:
            return err.code(), err.details(), n
        call.cancel()
        return grpc.StatusCode.OK, "", n


def _open(**kw) -> "pb.VerifyRequest":
    args = {"request_id": "x", "prompt_token_ids": GOOD, "sampling": pb.SamplingParams(max_tokens=300), "gamma": 2}
    args.update(kw)
    return pb.VerifyRequest(open=pb.VerifyOpen(**args))


@pytest.mark.parametrize(
    "messages,field",
    [
        ([pb.VerifyRequest(block=pb.DraftBlock(start_position=4, token_ids=[1]))], "open"),
        ([_open(request_id="")], "open.request_id"),
        ([_open(prompt_token_ids=[9999])], "open.prompt_token_ids"),
        ([_open(gamma=64)], "open.gamma"),
        (
            [_open(sampling=pb.SamplingParams(max_tokens=8, allowed_token_ids=[5, 9999]))],
            "open.sampling.allowed_token_ids",
        ),
    ],
)
def test_verifier_rejects_bad_input(services, messages, field: str) -> None:
    code, details, _ = asyncio.run(_verify_session(services.verifier.address, messages))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(field + ":"), details


def test_verifier_drops_a_bad_block_and_the_session_goes_on(services) -> None:
    """A block is a drafter's, relayed: one with an id outside the vocabulary is dropped (the
    session goes on without drafts), never INVALID_ARGUMENT (tests/e2e/test_hostile_drafter.py)."""
    code, _, n = asyncio.run(
        _verify_session(
            services.verifier.address,
            [
                _open(request_id="bad-block", sampling=pb.SamplingParams(max_tokens=5)),
                pb.VerifyRequest(block=pb.DraftBlock(start_position=5, token_ids=[4, 70000])),
            ],
        )
    )
    assert code == grpc.StatusCode.OK and n >= 5


def test_verifier_still_serves_after_bad_input(services) -> None:
    code, _, n = asyncio.run(
        _verify_session(
            services.verifier.address,
            [_open(request_id="ok-after-bad", sampling=pb.SamplingParams(max_tokens=5), gamma=0)],
        )
    )
    assert code == grpc.StatusCode.OK and n == 5


@pytest.mark.parametrize(
    "bad,field", [({"method": 99}, "open.method"), ({"cache_scope": "t" * 65}, "open.cache_scope")]
)
def test_drafter_rejects_bad_input(services, bad: dict, field: str) -> None:
    async def run() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(services.drafters["mid"].address) as channel:
            call = rpc.DrafterServiceStub(channel).Draft()
            args = {"prompt_token_ids": GOOD, "gamma": 2, "sampling": pb.SamplingParams(max_tokens=4), **bad}
            await call.write(pb.DraftRequest(open=pb.DraftOpen(**args)))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            return info.value

    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(field + ":"), err.details()


def test_verifier_errors_keep_their_status(services, gateway_address: str) -> None:
    """A request id already running in the verifier: the gateway passes INVALID_ARGUMENT on."""

    async def run() -> tuple[object, object]:
        async with grpc.aio.insecure_channel(gateway_address) as channel:
            stub = rpc.GatewayServiceStub(channel)
            long = stub.GenerateStream(
                pb.GenerateStreamRequest(spec=spec(GOOD, 600, gamma=2, ignore_eos=True, request_id="dup"))
            )
            first_chunk = await long.read()  # the first request is in the verifier now (no timer involved)
            second = stub.Generate(pb.GenerateRequest(spec=spec(GOOD, 4, request_id="dup")), timeout=60)
            second = (await asyncio.gather(second, return_exceptions=True))[0]
            tokens = list(first_chunk.token_ids)
            while (chunk := await long.read()) is not grpc.aio.EOF:
                tokens.extend(chunk.token_ids)
            return tokens, second

    first, second = asyncio.run(run())
    assert len(first) == 600
    assert isinstance(second, grpc.aio.AioRpcError) and second.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert second.details().startswith("verifier: open.request_id:"), second.details()
