"""The verifier does O(gamma) new target work per round, never the whole context.

The test talks to the verifier directly, acting as its own drafter: on each preview
it offers the next tokens of the known greedy output (every third block wrong at its
end), and checks the tokens the engine computed for the request at each step.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from conftest import vllm_reference

from specdec.wire import pb, rpc

PROMPT_LEN = 300
MAX_TOKENS = 48
GAMMA = 4


async def _session(address: str, prompt: list[int], reference: list[int]) -> list["pb.VerifyResponse"]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = rpc.VerifierServiceStub(channel).Verify()
        await call.write(
            pb.VerifyRequest(
                open=pb.VerifyOpen(
                    request_id="work-test",
                    prompt_token_ids=prompt,
                    sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                    gamma=GAMMA,
                )
            )
        )
        verdicts, blocks = [], 0
        while (v := await call.read()) is not grpc.aio.EOF:
            if v.preview:
                start = v.start_position + len(v.token_ids)
                offset = start - len(prompt)
                drafts = reference[offset : offset + GAMMA]
                blocks += 1
                if blocks % 3 == 0 and drafts:
                    drafts = drafts[:-1] + [(drafts[-1] + 1) % 512]
                with contextlib.suppress(grpc.aio.AioRpcError):  # the session may just have finished
                    await call.write(pb.VerifyRequest(block=pb.DraftBlock(start_position=start, token_ids=drafts)))
                continue
            verdicts.append(v)
            if v.finish_reason:
                break
        call.cancel()
        return verdicts


def test_work_per_round_is_one_plus_drafts(services, tiny_target) -> None:
    prompt = [(7 * i) % 500 + 1 for i in range(PROMPT_LEN)]
    reference = vllm_reference(
        tiny_target, [{"prompt_token_ids": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}]
    )[0]
    verdicts = asyncio.run(_session(services.verifier.address, prompt, reference))
    tokens = [t for v in verdicts for t in v.token_ids]
    assert tokens == reference
    first, rest = verdicts[0], verdicts[1:]
    assert first.computed_tokens <= PROMPT_LEN  # the prefill (less with a prefix-cache hit)
    for v in rest:
        # one new position per emitted token's predecessor: 1 + drafted, never the context
        assert v.computed_tokens == 1 + v.drafted, v
        assert v.drafted <= GAMMA
    drafted = sum(v.drafted for v in rest)
    assert drafted > MAX_TOKENS // 2, "the test needs most steps to verify drafts"
    assert any(v.accepted < v.drafted for v in rest) and any(v.accepted == v.drafted == GAMMA for v in rest)
    total = sum(v.computed_tokens for v in verdicts)
    assert total <= PROMPT_LEN + len(tokens) + drafted
    # without KV reuse each round would recompute the context: >= PROMPT_LEN per round
    assert total < 2 * PROMPT_LEN
