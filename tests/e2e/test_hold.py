"""The drafter service honours a hold (DraftCommit.hold), on the session's real drafter.

The gateway sends `hold` when the verifier's adaptive gamma backs a request off; a verdict
that adds no token carries it in an empty commit. The drafter must take such a commit (no
error: an INVALID_ARGUMENT there used to end the session in a fallback), draft nothing while
held, and draft again from the committed context once released. Adaptive gamma's decision
itself is tested in tests/verifier/test_budget.py, the gateway's relay of it in
tests/gateway/test_generation.py.
"""

from __future__ import annotations

import asyncio

import grpc

from specdec.wire import pb, rpc

PROMPT = [11, 12, 13, 14, 15]


def test_a_held_session_takes_empty_commits_and_drafts_again_when_released(services) -> None:
    async def run() -> tuple[list["pb.DraftBlock"], "pb.DraftBlock"]:
        async with grpc.aio.insecure_channel(services.drafters["mid"].address) as channel:
            call = rpc.DrafterServiceStub(channel).Draft()
            await call.write(
                pb.DraftRequest(
                    open=pb.DraftOpen(
                        request_id="held", prompt_token_ids=PROMPT, gamma=2, sampling=pb.SamplingParams(max_tokens=64)
                    )
                )
            )
            assert (await call.read()).HasField("ready")
            await call.write(pb.DraftRequest(commit=pb.DraftCommit(start_position=5, token_ids=[20])))
            first = [(await call.read()).block]  # drafts from position 6
            # held: an empty commit (only the hold), then one with the target's next token
            await call.write(pb.DraftRequest(commit=pb.DraftCommit(start_position=6, hold=True)))
            await call.write(pb.DraftRequest(commit=pb.DraftCommit(start_position=6, token_ids=[21], hold=True)))
            # released with one more token: the next block starts past it, drafted from it
            await call.write(pb.DraftRequest(commit=pb.DraftCommit(start_position=7, token_ids=[22])))
            while True:
                msg = await call.read()
                assert msg is not grpc.aio.EOF
                if msg.block.committed_length == 8 and msg.block.token_ids:
                    break
                first.append(msg.block)
            await call.done_writing()
            return first, msg.block

    before, after = asyncio.run(run())
    assert before[0].start_position == 6 and before[0].token_ids
    assert after.start_position == 8  # drafted from the released context: no error, no fallback
    assert not any(b.committed_length > 6 for b in before)  # nothing drafted while held
