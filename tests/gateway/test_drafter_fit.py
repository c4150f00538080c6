"""The gateway meets its verifier and drafters: its tokenizer and each draft model must fit the
target (specdec.models.compat, from GetVerifierInfo / GetDrafterInfo). Fakes stand in for the
pools and stubs: only the gateway's decisions run."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from gateway.core import GatewayCore
from gateway.plan import Plan
from specdec import telemetry
from specdec.config import GatewayConfig
from specdec.models import compat
from specdec.wire import pb


class FakeStub:
    """GetVerifierInfo / GetDrafterInfo answering `info`; counts the calls."""

    def __init__(self, info) -> None:
        self.info, self.calls = info, 0

    async def GetVerifierInfo(self, *args, **kwargs):  # noqa: N802
        self.calls += 1
        return self.info

    async def GetDrafterInfo(self, *args, **kwargs):  # noqa: N802
        self.calls += 1
        await asyncio.sleep(0)  # a real call yields to the loop: other requests come in meanwhile
        return self.info


class FakePool:
    """Replicas by address, chosen in order (the first not excluded; an affinity key changes
    nothing: these prompts are short); all serving."""

    def __init__(self, replicas: list[SimpleNamespace]) -> None:
        self.replicas = replicas

    def start(self) -> None:
        pass

    def serving(self) -> int:
        return len(self.replicas)

    async def close(self, grace_s: float = 0.0) -> None:
        pass

    def choose(self, exclude=frozenset(), key=None):
        return next((r for r in self.replicas if r.address not in exclude), None)

    async def pick(self, timeout_s, exclude=frozenset(), key=None):
        return self.choose(exclude, key)

    async def checked(self, timeout_s):
        return True


def replica(address: str, info) -> SimpleNamespace:
    return SimpleNamespace(address=address, stub=FakeStub(info), in_flight=0)


@pytest.fixture
def target(tiny_target) -> compat.Vocabulary:
    return compat.from_folder(tiny_target, "tiny/target")


def servicer(tiny_target, verifier_vocab: compat.Vocabulary, drafters: list[SimpleNamespace]) -> GatewayCore:
    """A real GatewayCore whose pools are fakes (no channels)."""
    info = pb.GetVerifierInfoResponse(
        model="tiny/target",
        vocab_size=verifier_vocab.vocab_size,
        max_model_len=2048,
        max_gamma=8,
        vocabulary=compat.to_pb(verifier_vocab),
    )
    pools = (FakePool([replica("verifier", info)]), FakePool(drafters))
    return GatewayCore(
        GatewayConfig(tokenizer="tiny/target"),
        telemetry.GatewayMetrics(CollectorRegistry()),
        AutoTokenizer.from_pretrained(tiny_target),
        pools=lambda cfg: pools,
    )


def drafter_info(vocab: compat.Vocabulary) -> "pb.GetDrafterInfoResponse":
    return pb.GetDrafterInfoResponse(model=vocab.model, vocab_size=vocab.vocab_size, vocabulary=compat.to_pb(vocab))


def plan(method: int) -> Plan:
    return Plan("r", [1, 2, 3], pb.SamplingParams(max_tokens=4), 4, method)


def test_a_drafter_that_does_not_fit_is_passed_over_once_logged(tiny_target, target, caplog) -> None:
    other = replace(target, model="other", fingerprint="0" * 16, tokenizer_size=513, vocab_size=513)
    padded = replace(target, model="padded", vocab_size=576)  # same vocabulary, more rows: fits
    bad, good = replica("bad:1", drafter_info(other)), replica("good:2", drafter_info(padded))
    s = servicer(tiny_target, target, [bad, good])

    async def run():
        await s.target_info()
        return await asyncio.gather(*(s._fitting_drafter() for _ in range(3)))  # at once: one check each

    with caplog.at_level(logging.ERROR, logger="specdec.gateway"):
        chosen = asyncio.run(run())
    assert list(chosen) == [good, good, good]
    assert (bad.stub.calls, good.stub.calls) == (1, 1)  # asked once per replica
    refusals = [r.getMessage() for r in caplog.records if r.name == "specdec.gateway"]  # not OpenTelemetry's
    assert refusals == [
        "drafter bad:1 refused: draft 'other' does not fit target 'tiny/target': different "
        "vocabularies (512 vs 513 tokens; tokenizer fingerprints "
        f"{target.fingerprint} vs 0000000000000000)"
    ]


def test_with_no_drafter_that_fits_a_model_request_decodes_plainly_and_ngram_still_drafts(tiny_target, target) -> None:
    """The n-gram drafter has no model: a drafter whose model does not fit still serves it."""
    bad = replica("bad:1", drafter_info(replace(target, model="other-eos", eos_token_id=1)))
    s = servicer(tiny_target, target, [bad])

    async def run():
        await s.target_info()
        return (
            await s._generation(plan(pb.DRAFT_METHOD_MODEL), None),
            await s._generation(plan(pb.DRAFT_METHOD_NGRAM), None),
        )

    model_run, ngram_run = asyncio.run(run())
    assert model_run.relay.stub is None  # the generation decodes plainly
    assert ngram_run.relay.stub is bad.stub


def test_a_drafter_or_verifier_that_sends_no_vocabulary_is_not_checked(tiny_target, target) -> None:
    old = replica("old:1", pb.GetDrafterInfoResponse(model="old", vocab_size=512))
    s = servicer(tiny_target, target, [old])
    assert asyncio.run(s.target_info()).vocab_size == 512
    assert asyncio.run(s._fitting_drafter()) is old


def test_a_gateway_tokenizer_that_does_not_fit_the_verifier_is_refused(tiny_target, target) -> None:
    s = servicer(tiny_target, replace(target, model="tiny/target", bos_token_id=5), [])
    with pytest.raises(
        compat.IncompatibleModels,
        match="gateway tokenizer 'tiny/target' does not fit target 'tiny/target': BOS token id 5 vs 0",
    ):
        asyncio.run(s.target_info())
