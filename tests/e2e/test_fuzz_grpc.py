"""Fuzzing the gRPC services with hypothesis: the gateway's GenerationSpec, the verifier's
Verify stream (VerifyOpen, then blocks, `ready`, `end` in any order) and the drafter's Draft
stream (DraftOpen, then commits in any order), on the session's real services.

Each example is built field by field from a pool of valid values and a pool of invalid ones
(NaN / infinite / out-of-range sampling values, empty or out-of-vocabulary prompts, huge
max_tokens, empty stop strings, logprobs > 20, min_tokens > max_tokens, gamma out of range,
unknown enum values), corrupting none, one or two fields, and the example knows which field
paths it corrupted. Properties:
  - a request with a corrupted field is refused with INVALID_ARGUMENT whose details start with
    the path of one of those fields ("spec.sampling.top_p: ...");
  - a request with none runs, and its answer is well formed (at most max_tokens tokens, all
    in the vocabulary, a finish reason; logprobs when asked for);
  - a message out of order on a stream (anything before `open`, a second `open`, an empty
    message) ends the call with INVALID_ARGUMENT naming what was wrong, and a drafter's or a
    verifier's hostile-but-well-typed messages (blocks and commits at bogus positions, bad
    ids, NaN timings, `end` then blocks, half-closing early) end it cleanly: OK or
    INVALID_ARGUMENT, never INTERNAL, never a hang;
  - every service process stays alive, and after the run each still serves a normal request.
Beside the random draws, every invalid value of the pools is sent once, alone on a valid
request, to the gateway (test_gateway_refuses_each_invalid_value), and a few hostile stream
cases are always tried (hypothesis `@example`).

Bounded for CI: SPECDEC_FUZZ_EXAMPLES (default 50) examples per test, derandomized, no example
database; an accepted generation is at most MAX_RUN_TOKENS tokens. A longer run, not in CI:
    SPECDEC_FUZZ_EXAMPLES=500 pytest tests/e2e/test_fuzz_grpc.py
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from gen import stall_report
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from specdec.models import resolve
from specdec.validation import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from specdec.wire import pb, rpc

MAX_EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "50"))
MAX_RUN_TOKENS = 4
TIMEOUT_S = 30.0  # one call; an accepted one generates MAX_RUN_TOKENS tokens on the tiny pair, well within it
PROBE_S = 15.0
HOLD_S = 1.0
FUZZ_SETTINGS = dict(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
TEXT_PROMPTS = ["def f(x):", "a", "\u00e9\u4e2d \U0001f600", "  x = [1, 2", "\x00"]
UNSET = object()  # an optional field left unset
STOPPED: list[str] = []  # why the verifier stopped serving, once it has (stop_if_wedged)
_ids = itertools.count()


@dataclass
class Target:
    vocab_size: int
    max_model_len: int
    max_gamma: int
    draft_vocab_size: int
    text_len: dict[str, int]  # the gateway's token count of each TEXT_PROMPTS entry


@pytest.fixture(scope="module")
def target(services) -> Target:
    with grpc.insecure_channel(services.verifier.address) as channel:
        info = rpc.VerifierServiceStub(channel).GetVerifierInfo(pb.GetVerifierInfoRequest(), timeout=30)
    with grpc.insecure_channel(services.drafters["mid"].address) as channel:
        draft = rpc.DrafterServiceStub(channel).GetDrafterInfo(pb.GetDrafterInfoRequest(), timeout=30)
    tok = AutoTokenizer.from_pretrained(resolve("tiny/target"))  # the gateways' --tokenizer
    return Target(
        info.vocab_size,
        info.max_model_len,
        info.max_gamma,
        draft.vocab_size,
        {text: len(tok.encode(text)) for text in TEXT_PROMPTS},
    )


def assert_alive(services) -> None:
    """The session's own services are running. Not services.started: earlier modules add services
    of their own to it and stop them (test_auth's gateway exits 0 on its SIGTERM)."""
    for svc in (services.verifier, *services.drafters.values(), *services.gateways.values()):
        assert svc.proc.poll() is None, f"{svc.kind} on {svc.address} died ({svc.proc.returncode}); log: {svc.log_path}"


class ServiceStopped(BaseException):
    """The services stopped serving: hypothesis lets a BaseException through at once, unshrunk
    (every later example would only time out)."""


def verifier_serves(address: str) -> str:
    """'' when the verifier generates one token for a plain session within PROBE_S, else why not."""
    open_ = pb.VerifyOpen(
        request_id=f"probe-{next(_ids)}", prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=1), gamma=0
    )
    try:
        with grpc.insecure_channel(address) as channel:
            list(rpc.VerifierServiceStub(channel).Verify(iter([pb.VerifyRequest(open=open_)]), timeout=PROBE_S))
    except grpc.RpcError as err:
        return f"{err.code().name}: {err.details()}"
    return ""


def stop_if_wedged(services, err: grpc.RpcError, where: str) -> None:
    """A call that ran out of time: when the verifier no longer serves at all, end the test now
    (ServiceStopped is not shrunk by hypothesis), instead of timing out every example after it."""
    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        why = verifier_serves(services.verifier.address)
        if why:
            STOPPED.append(
                f"{where}: no answer in {TIMEOUT_S:g} s, and the verifier no longer serves a "
                f"plain 1-token session ({why}); what the verifier is doing:\n{stall_report(services.verifier)}"
            )
            raise ServiceStopped(STOPPED[0])


@pytest.fixture(autouse=True)
def _still_serving() -> None:
    """After the verifier stopped serving, the tests after it in this module fail at once."""
    if STOPPED:
        raise ServiceStopped(f"the verifier stopped serving earlier in this module, after: {STOPPED[0]}")


# ---------------------------------------------------------------------------- examples


@dataclass
class Drawn:
    """A message and the field paths the drawing corrupted (empty: it is valid)."""

    message: Any
    invalid: set[str] = field(default_factory=set)
    max_tokens: int = 0
    logprobs: int | None = None
    prompt_len: int = 0


class Fields:
    """Draws a message's fields, each from its valid pool unless chosen to be corrupted."""

    def __init__(self, draw: Any, names: list[str], prefix: str) -> None:
        self.draw, self.prefix = draw, prefix
        # none corrupted about half the time, so that about half of the requests run
        k = draw(st.sampled_from([0, 0, 0, 1, 1, 2]))
        self.corrupt = set(draw(st.lists(st.sampled_from(names), min_size=k, max_size=k, unique=True))) if k else set()
        self.invalid: set[str] = set()

    def pick(self, name: str, valid: list[Any], invalid: list[Any], path: str | None = None) -> Any:
        if name in self.corrupt and invalid:
            self.invalid.add(f"{self.prefix}.{path or name}")
            return self.draw(st.sampled_from(invalid))
        return self.draw(st.sampled_from(valid))


SAMPLING_FIELDS = [
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "logprobs",
]
NAN, INF = math.nan, math.inf
# Fields whose values do not depend on the request: (valid, invalid); vLLM's range for
# temperature is [0, 2] (SamplingParams._verify_args), as OpenAI's is.
POOLS: dict[str, tuple[list[Any], list[Any]]] = {
    "temperature": ([0.0, 0.0, 0.5, 1.0, 2.0, 1e-9], [-0.5, -INF, NAN, INF, 2.5, 30.0, 1e30]),
    "top_p": ([UNSET, 1.0, 0.5, 1e-6], [0.0, -0.1, 1.5, NAN, INF]),
    "top_k": ([0, -1, 1, 5, 100_000], [-2, -(2**31)]),
    "presence_penalty": ([-2.0, 0.0, 1.5, 2.0], [-2.5, 3.0, NAN, INF, -INF]),
    "frequency_penalty": ([-2.0, 0.0, 1.5, 2.0], [-2.5, 3.0, NAN, INF, -INF]),
    "repetition_penalty": ([UNSET, 1.0, 0.5, 1e4], [0.0, -1.0, NAN, INF, 1e5]),
    "logprobs": ([UNSET, 0, 5, 20], [21, 2**32 - 1]),
}


def _set(message: Any, name: str, value: Any) -> None:
    if value is UNSET:
        message.ClearField(name)
    else:
        setattr(message, name, value)


def draw_sampling(
    f: Fields, vocab_size: int | None, context_left: int | None, max_tokens_optional: bool = False
) -> tuple[Any, int, int | None]:
    """A SamplingParams under f.prefix ("spec.sampling"); returns it, its max_tokens and logprobs.
    `vocab_size`: None when the service does not check stop_token_ids; `context_left`: the room
    the prompt leaves (None: the service does not check it)."""
    draw = f.draw
    sp = pb.SamplingParams()

    def pick(name: str, valid: list[Any], invalid: list[Any]) -> Any:
        return f.pick(name, valid, invalid, path=f"sampling.{name}")

    values = {name: pick(name, *pools) for name, pools in POOLS.items()}
    for name, value in values.items():
        _set(sp, name, value)
    too_long = [context_left + 1, 2**31 - 1] if context_left is not None else []
    max_tokens = pick(
        "max_tokens",
        list(range(1, MAX_RUN_TOKENS + 1)),
        [0, -1, -(2**31), *too_long] + ([] if max_tokens_optional else [UNSET]),
    )
    if max_tokens is not UNSET:
        sp.max_tokens = max_tokens
    seed = draw(st.sampled_from([UNSET, 0, 1, 2**64 - 1]))
    if seed is not UNSET:
        sp.seed = seed
    stop = pick(
        "stop",
        [[], ["\n"], ["zz", "q"], ["\u00e9\u4e2d"], ["s"] * MAX_STOP_STRINGS, ["x" * MAX_STOP_STRING_CHARS]],
        [[""], ["a", ""], ["s"] * (MAX_STOP_STRINGS + 1), ["a", "x" * (MAX_STOP_STRING_CHARS + 1)]],
    )
    bad = [i for i, s in enumerate(stop) if not s or len(s) > MAX_STOP_STRING_CHARS]
    if bad and len(stop) <= MAX_STOP_STRINGS:  # the path names the bad one
        f.invalid.discard(f"{f.prefix}.sampling.stop")
        f.invalid.add(f"{f.prefix}.sampling.stop[{bad[0]}]")
    sp.stop.extend(stop)
    mt = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else None
    if mt is not None:
        sp.min_tokens = pick("min_tokens", list(range(0, min(mt, MAX_RUN_TOKENS) + 1)), [mt + 1, 2**32 - 1])
    if vocab_size is not None:
        sp.stop_token_ids.extend(
            pick(
                "stop_token_ids",
                [[], [0], [vocab_size - 1], [0] * MAX_STOP_TOKEN_IDS],
                [[-1], [vocab_size], [5, 2**31 - 1], [0] * (MAX_STOP_TOKEN_IDS + 1)],
            )
        )
    else:
        sp.stop_token_ids.extend(draw(st.sampled_from([[], [0], [-1], [2**31 - 1]])))  # unchecked there
    logprobs = values["logprobs"]
    sp.ignore_eos = draw(st.booleans())
    sp.include_stop_str_in_output = draw(st.booleans())
    skip = draw(st.sampled_from([UNSET, True, False]))
    if skip is not UNSET:
        sp.skip_special_tokens = skip
    return sp, (max_tokens if isinstance(max_tokens, int) else 0), (None if logprobs is UNSET else logprobs)


def _prompt_ids(draw: Any, vocab_size: int) -> list[int]:
    return draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=12))


@st.composite
def generation_specs(draw: Any, t: Target) -> Drawn:
    f = Fields(draw, ["prompt", "gamma", "drafter", "request_id", *SAMPLING_FIELDS], "spec")
    spec = pb.GenerationSpec()
    prompt = f.pick("prompt", ["text", "ids"], ["empty", "bad ids", "both", "too long"], path="prompt_token_ids")
    if prompt == "empty":
        f.invalid = (f.invalid - {"spec.prompt_token_ids"}) | {"spec.prompt_text"}
    if prompt in ("text", "both"):
        spec.prompt_text = draw(st.sampled_from(TEXT_PROMPTS))
    if prompt in ("ids", "both"):
        spec.prompt_token_ids.extend(_prompt_ids(draw, t.vocab_size))
    if prompt == "bad ids":
        ids = _prompt_ids(draw, t.vocab_size)
        ids.insert(draw(st.integers(0, len(ids))), draw(st.sampled_from([-1, -(2**31), t.vocab_size, 2**31 - 1])))
        spec.prompt_token_ids.extend(ids)
    if prompt == "too long":
        spec.prompt_token_ids.extend([5] * t.max_model_len)
    prompt_len = len(spec.prompt_token_ids) if not spec.prompt_text else t.text_len[spec.prompt_text]
    sp, max_tokens, logprobs = draw_sampling(f, t.vocab_size, t.max_model_len - prompt_len, max_tokens_optional=True)
    if not sp.HasField("max_tokens"):  # the gateway's default (128) is valid, but long
        sp.max_tokens = max_tokens = MAX_RUN_TOKENS
    spec.sampling.CopyFrom(sp)
    gamma = f.pick("gamma", [UNSET, 0, 1, 4, t.max_gamma], [t.max_gamma + 1, 33, 2**32 - 1])
    if gamma is not UNSET:
        spec.gamma = gamma
    spec.drafter = f.pick("drafter", [0, 1, 2, 3], [4, 99, -1, 2**31 - 1])
    rid = f.pick("request_id", ["", "fuzz", "a.B:c_9-"], ["\x00 \u00e9", "x" * 300, "new\nline"])
    spec.request_id = f"{rid}-{next(_ids)}" if rid else ""
    return Drawn(spec, f.invalid, max_tokens, logprobs, prompt_len)


def check_refusal(err: grpc.RpcError, d: Drawn, where: str) -> None:
    details = err.details() or ""
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {err.code()} {details}"
    assert any(details.startswith(p + ":") for p in d.invalid), f"{where}: {details!r} names none of {d.invalid}"


def check_tokens(ids: list[int], logprobs: list[Any], finish: int, d: Drawn, vocab_size: int, where: str) -> None:
    assert len(ids) <= d.max_tokens, f"{where}: {len(ids)} tokens > max_tokens {d.max_tokens}"
    assert all(0 <= t < vocab_size for t in ids), f"{where}: {ids}"
    assert finish in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP), f"{where}: finish {finish}"
    if finish == pb.FINISH_REASON_LENGTH:
        assert len(ids) == d.max_tokens, f"{where}: LENGTH after {len(ids)} of {d.max_tokens}"
    if d.logprobs is not None:
        assert len(logprobs) == len(ids), f"{where}: {len(logprobs)} logprobs for {len(ids)} tokens"
        assert all(len(lp.top_token_ids) <= d.logprobs for lp in logprobs), f"{where}: {logprobs}"
    else:
        assert not logprobs, where


# ---------------------------------------------------------------------------- gateway


def _generate(stub: Any, d: Drawn, stream: bool) -> tuple[list[int], list[Any], int, Any]:
    if not stream:
        r = stub.Generate(pb.GenerateRequest(spec=d.message), timeout=TIMEOUT_S)
        return list(r.token_ids), list(r.logprobs), r.finish_reason, r.usage
    ids, logprobs, finish, usage = [], [], pb.FINISH_REASON_UNSPECIFIED, None
    for chunk in stub.GenerateStream(pb.GenerateStreamRequest(spec=d.message), timeout=TIMEOUT_S):
        assert finish == pb.FINISH_REASON_UNSPECIFIED, "a chunk after the last one"
        ids += chunk.token_ids
        logprobs += chunk.logprobs
        finish, usage = chunk.finish_reason, chunk.usage if chunk.HasField("usage") else None
    return ids, logprobs, finish, usage


def test_gateway_generation_spec_fuzz(services, target: Target) -> None:
    seen: Counter[str] = Counter()
    with grpc.insecure_channel(services.gateways["mid"].address) as channel:
        stub = rpc.GatewayServiceStub(channel)

        @settings(**FUZZ_SETTINGS)
        @given(d=generation_specs(target), stream=st.booleans())
        def run(d: Drawn, stream: bool) -> None:
            where = f"{'GenerateStream' if stream else 'Generate'}({d.message}) corrupted {sorted(d.invalid)}"
            try:
                ids, logprobs, finish, usage = _generate(stub, d, stream)
            except grpc.RpcError as err:
                seen[err.code().name] += 1
                stop_if_wedged(services, err, where)
                assert d.invalid, f"{where}: a valid request failed: {err.code()} {err.details()}"
                check_refusal(err, d, where)
                return
            finally:
                assert_alive(services)
            seen["OK"] += 1
            assert not d.invalid, f"{where}: accepted"
            check_tokens(ids, logprobs, finish, d, target.vocab_size, where)
            assert usage is not None and usage.completion_tokens == len(ids), f"{where}: {usage}"
            if not d.message.prompt_text:
                assert usage.prompt_tokens == len(d.message.prompt_token_ids), f"{where}: {usage}"

        run()
    print(f"gateway Generate: {dict(seen)}")
    assert seen["OK"] and seen["INVALID_ARGUMENT"], dict(seen)


# ---------------------------------------------------------------------------- verifier


@st.composite
def verify_opens(draw: Any, t: Target) -> Drawn:
    f = Fields(draw, ["request_id", "prompt", "gamma", *SAMPLING_FIELDS], "open")
    req = pb.VerifyOpen()
    rid = f.pick("request_id", ["fuzz", "a.B:c_9-"], ["", "\x00\u00e9", "r" * 300, "new\nline"])
    req.request_id = f"{rid}-{next(_ids)}" if rid else ""
    prompt = f.pick("prompt", ["ids"], ["empty", "bad ids"], path="prompt_token_ids")
    if prompt != "empty":
        ids = _prompt_ids(draw, t.vocab_size)
        if prompt == "bad ids":
            ids[draw(st.integers(0, len(ids) - 1))] = draw(st.sampled_from([-1, t.vocab_size, 2**31 - 1]))
        req.prompt_token_ids.extend(ids)
    sp, max_tokens, logprobs = draw_sampling(f, t.vocab_size, t.max_model_len - len(req.prompt_token_ids))
    req.sampling.CopyFrom(sp)
    req.gamma = f.pick("gamma", [0, 1, 4, t.max_gamma], [t.max_gamma + 1, 33, 2**32 - 1])
    return Drawn(req, f.invalid, max_tokens, logprobs, len(req.prompt_token_ids))


def blocks(prompt_len: int, vocab_size: int) -> st.SearchStrategy[Any]:
    """Draft blocks as a hostile drafter might send them: any position, any ids, any timing."""
    return st.builds(
        pb.DraftBlock,
        start_position=st.sampled_from([prompt_len, prompt_len + 1, prompt_len + 3, 0, 1, 2**32 - 1]),
        token_ids=st.lists(st.sampled_from([0, 1, 5, vocab_size - 1, vocab_size, -1, 2**31 - 1]), max_size=12),
        sequence=st.sampled_from([0, 1, 2**64 - 1]),
        draft_ms=st.sampled_from([0.0, 1.0, NAN, INF, -1.0]),
        final=st.booleans(),
        committed_length=st.sampled_from([0, prompt_len, prompt_len + 1, 2**32 - 1]),
    )


@st.composite
def verify_streams(draw: Any, t: Target) -> tuple[Drawn, list[Any], str]:
    """(the open, the messages in order, what the call should end with: "ok" or a details prefix)."""
    d = draw(verify_opens(t))
    n = d.prompt_len
    follow = st.one_of(
        blocks(n, t.vocab_size).map(lambda b: pb.VerifyRequest(block=b)),
        st.just(pb.VerifyRequest(end=pb.DraftEnd(reason="fuzz"))),
        st.sampled_from([0.0, 5.0, NAN, INF, -1.0, 1e30]).map(
            lambda ms: pb.VerifyRequest(ready=pb.DraftReady(prefilled_tokens=n, draft_ms_per_token=ms))
        ),
    )
    rest = draw(st.lists(follow, max_size=6))
    order = draw(
        st.sampled_from(["open first"] * 6 + ["no open", "something before open", "two opens", "empty message"])
    )
    if order == "open first":
        return d, [pb.VerifyRequest(open=d.message), *rest], "ok"
    if order == "no open":
        return d, rest, "open"
    if order == "something before open":
        return d, [pb.VerifyRequest(end=pb.DraftEnd()), pb.VerifyRequest(open=d.message), *rest], "open"
    bad = pb.VerifyRequest(open=d.message) if order == "two opens" else pb.VerifyRequest()
    cut = draw(st.integers(0, len(rest)))
    return d, [pb.VerifyRequest(open=d.message), *rest[:cut], bad, *rest[cut:]], "block"


def test_verifier_verify_stream_fuzz(services, target: Target) -> None:
    seen: Counter[str] = Counter()
    with grpc.insecure_channel(services.verifier.address) as channel:
        stub = rpc.VerifierServiceStub(channel)

        @settings(**FUZZ_SETTINGS)
        @given(example=verify_streams(target))
        def run(example: tuple[Drawn, list[Any], str]) -> None:
            d, messages, expect = example
            where = (
                f"Verify({[m.WhichOneof('kind') for m in messages]}, open={d.message}) corrupted {sorted(d.invalid)}"
            )
            ids, logprobs, finish = [], [], pb.FINISH_REASON_UNSPECIFIED
            try:
                for v in stub.Verify(iter(messages), timeout=TIMEOUT_S):
                    if v.preview:
                        continue
                    assert v.start_position == d.prompt_len + len(ids), f"{where}: verdict at {v.start_position}"
                    ids += v.token_ids
                    logprobs += v.logprobs
                    finish = v.finish_reason
            except grpc.RpcError as err:
                seen[err.code().name] += 1
                stop_if_wedged(services, err, where)
                details = err.details() or ""
                assert not (expect == "ok" and not d.invalid), (
                    f"{where}: a valid session failed: {err.code()} {details}"
                )
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {err.code()} {details}"
                if expect == "ok" or (expect == "block" and d.invalid):
                    check_refusal(err, d, where)
                else:
                    assert details.startswith(expect), f"{where}: {details!r}, expected {expect!r}"
                return
            finally:
                assert_alive(services)
            seen["OK"] += 1
            # a message out of order after `open` may come after the last verdict: then the call ends OK
            assert expect in ("ok", "block") and not d.invalid, f"{where}: accepted"
            check_tokens(ids, logprobs, finish, d, target.vocab_size, where)

        run()
    print(f"verifier Verify: {dict(seen)}")
    assert seen["OK"] and seen["INVALID_ARGUMENT"], dict(seen)


# ---------------------------------------------------------------------------- drafter


@st.composite
def draft_streams(draw: Any, t: Target) -> tuple[Drawn, list[Any], str]:
    f = Fields(draw, ["prompt", "gamma", "method", "request_id", *SAMPLING_FIELDS], "open")
    req = pb.DraftOpen(request_id=f.pick("request_id", ["", "fuzz"], ["\x00\u00e9", "d" * 300]))
    prompt = f.pick("prompt", ["ids"], ["empty", "bad ids"], path="prompt_token_ids")
    if prompt != "empty":
        ids = _prompt_ids(draw, t.draft_vocab_size)
        if prompt == "bad ids":
            ids[draw(st.integers(0, len(ids) - 1))] = draw(st.sampled_from([-1, t.draft_vocab_size, 2**31 - 1]))
        req.prompt_token_ids.extend(ids)
    sp, max_tokens, logprobs = draw_sampling(f, None, None)
    req.sampling.CopyFrom(sp)
    req.gamma = f.pick("gamma", [1, 2, 4, 8, 32], [0, 33, 2**32 - 1])
    req.method = f.pick("method", [0, 1, 2], [3, 99, -5])
    d = Drawn(req, f.invalid, max_tokens, logprobs, len(req.prompt_token_ids))
    # commits as a gateway sends them (each at the end of the context so far, or rolling back
    # into the last one's tokens; gamma 0 or in [1, 32]), or bogus ones (inside the prompt, past
    # the context, gamma out of range), which may be refused (INVALID_ARGUMENT "commit...")
    rest, context, bogus = [], d.prompt_len, False
    for _ in range(draw(st.integers(0, 6))):
        ids = draw(st.lists(st.sampled_from([0, 1, 5, t.draft_vocab_size - 1]), min_size=1, max_size=6))
        start = draw(st.sampled_from([context, context, max(d.prompt_len, context - 1), 0, 1, context + 2, 2**32 - 1]))
        gamma = draw(st.sampled_from([0, 0, 1, 4, 32, 33, 2**32 - 1]))
        if not d.prompt_len <= start <= context or gamma > 32:
            bogus = True
        else:
            context = start + len(ids)
        rest.append(
            pb.DraftRequest(
                commit=pb.DraftCommit(
                    start_position=start, token_ids=ids, gamma=gamma, accepted=draw(st.sampled_from([0, 1, 2**32 - 1]))
                )
            )
        )
    bad_commit = st.sampled_from([[-1], [t.draft_vocab_size], [1, 2**31 - 1]]).map(
        lambda ids: pb.DraftRequest(commit=pb.DraftCommit(start_position=d.prompt_len, token_ids=ids))
    )
    order = draw(
        st.sampled_from(
            ["open first"] * 6 + ["no open", "commit before open", "two opens", "empty message", "bad commit"]
        )
    )
    opened = pb.DraftRequest(open=req)
    if order == "open first":
        return d, [opened, *rest], "ok or commit" if bogus else "ok"
    if order == "no open":
        return d, rest, "open"
    if order == "commit before open":
        return (
            d,
            [pb.DraftRequest(commit=pb.DraftCommit(start_position=d.prompt_len, token_ids=[1])), opened, *rest],
            "open",
        )
    bad = {"two opens": st.just(opened), "empty message": st.just(pb.DraftRequest()), "bad commit": bad_commit}[order]
    cut = draw(st.integers(0, len(rest)))
    return d, [opened, *rest[:cut], draw(bad), *rest[cut:]], "commit"


def held_open(messages: list[Any], sent: threading.Event, answered: threading.Event) -> Iterator[Any]:
    """The messages, then the half-close only once the drafter answered something after the last
    one (at most HOLD_S later): a drafter answers a commit with a block, so the commits' blocks
    are drafted and sent while the stream is open, not cut short by the half-close."""
    yield from messages
    sent.set()
    answered.wait(HOLD_S)


def _far_commit() -> tuple[Drawn, list[Any], str]:
    """Always tried: a commit far past the context (the largest uint32 position)."""
    open_ = pb.DraftOpen(
        prompt_token_ids=[5, 6, 7], gamma=1, method=pb.DRAFT_METHOD_NGRAM, sampling=pb.SamplingParams(max_tokens=4)
    )
    far = pb.DraftCommit(start_position=2**32 - 1, token_ids=[1])
    return Drawn(open_, set(), 4, None, 3), [pb.DraftRequest(open=open_), pb.DraftRequest(commit=far)], "ok or commit"


def test_drafter_draft_stream_fuzz(services, target: Target) -> None:
    seen: Counter[str] = Counter()
    with grpc.insecure_channel(services.drafters["mid"].address) as channel:
        stub = rpc.DrafterServiceStub(channel)

        @settings(**FUZZ_SETTINGS)
        @given(example=draft_streams(target))
        @example(example=_far_commit())
        def run(example: tuple[Drawn, list[Any], str]) -> None:
            d, messages, expect = example
            where = f"Draft({[m.WhichOneof('kind') for m in messages]}, {messages}) corrupted {sorted(d.invalid)}"
            readies = 0
            sent, answered = threading.Event(), threading.Event()
            try:
                for r in stub.Draft(held_open(messages, sent, answered), timeout=TIMEOUT_S):
                    if sent.is_set():
                        answered.set()
                    if r.HasField("ready"):
                        readies += 1
                        assert readies == 1, f"{where}: a second `ready`"
                        continue
                    assert r.HasField("block"), f"{where}: {r}"
                    assert all(0 <= tok < target.draft_vocab_size for tok in r.block.token_ids), f"{where}: {r}"
            except grpc.RpcError as err:
                seen[err.code().name] += 1
                stop_if_wedged(services, err, where)
                details = err.details() or ""
                assert not (expect == "ok" and not d.invalid), (
                    f"{where}: a valid session failed: {err.code()} {details}"
                )
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {err.code()} {details}"
                if d.invalid and expect != "open":
                    check_refusal(err, d, where)
                else:
                    assert details.startswith(expect.split()[-1]), f"{where}: {details!r}, expected {expect!r}"
                return
            finally:
                answered.set()
                assert_alive(services)
            seen["OK"] += 1
            # half-closing ends the session: a bad message behind the last commit may never be read
            assert expect in ("ok", "ok or commit", "commit") and not d.invalid, f"{where}: accepted"
            # a session it accepted was answered: its `ready` at least (a drafter that sends nothing fails)
            assert readies == 1, f"{where}: the session ended OK without a `ready`"

        run()
    print(f"drafter Draft: {dict(seen)}")
    assert seen["OK"] and seen["INVALID_ARGUMENT"], dict(seen)


# ---------------------------------------------------------------------------- every invalid value


def test_gateway_refuses_each_invalid_value(services, target: Target) -> None:
    """Each invalid value of the pools above, alone on a valid request: INVALID_ARGUMENT naming
    its field (the fuzz tests draw from the pools; this goes through all of them, in order)."""

    def base() -> Any:
        return pb.GenerationSpec(prompt_token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(max_tokens=2))

    cases: list[tuple[str, Any]] = []
    for name, (_, invalid) in POOLS.items():
        for value in invalid:
            s = base()
            _set(s.sampling, name, value)
            cases.append((f"spec.sampling.{name}", s))
    for path, field_name, values in [
        ("spec.sampling.max_tokens", "max_tokens", [0, -1, -(2**31), 2**31 - 1, target.max_model_len - 3]),
        ("spec.sampling.min_tokens", "min_tokens", [3, 2**32 - 1]),
        ("spec.gamma", "gamma", [target.max_gamma + 1, 33, 2**32 - 1]),
        ("spec.drafter", "drafter", [4, 99, -1, 2**31 - 1]),
    ]:
        for value in values:
            s = base()
            _set(s if path.count(".") == 1 else s.sampling, field_name, value)
            cases.append((path, s))
    for stop, path in [([""], "spec.sampling.stop[0]"), (["a", ""], "spec.sampling.stop[1]")]:
        s = base()
        s.sampling.stop.extend(stop)
        cases.append((path, s))
    for ids in ([-1], [target.vocab_size], [5, 2**31 - 1]):
        s = base()
        s.sampling.stop_token_ids.extend(ids)
        cases.append(("spec.sampling.stop_token_ids", s))
    for ids in ([], [-1], [target.vocab_size], [5] * target.max_model_len):
        s = base()
        s.ClearField("prompt_token_ids")
        s.prompt_token_ids.extend(ids)
        cases.append(("spec.prompt_text" if not ids else "spec.prompt_token_ids", s))
    cases.sort(
        key=lambda case: case[0] == "spec.sampling.temperature"
    )  # those last (reported: they can stop the verifier)
    wrong = []
    with grpc.insecure_channel(services.gateways["mid"].address) as channel:
        stub = rpc.GatewayServiceStub(channel)
        for path, s in cases:
            where = f"{path} = {s}"
            try:
                stub.Generate(pb.GenerateRequest(spec=s), timeout=TIMEOUT_S)
                wrong.append(f"{where}: accepted")
            except grpc.RpcError as err:
                stop_if_wedged(services, err, f"{where} (after these went wrong: {wrong})")
                if err.code() != grpc.StatusCode.INVALID_ARGUMENT or not (err.details() or "").startswith(path + ":"):
                    wrong.append(f"{where}: {err.code().name} {err.details()}")
            assert_alive(services)
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------------------- still serving


def test_every_service_still_serves_after_fuzzing(services, target: Target) -> None:
    assert_alive(services)
    spec = pb.GenerationSpec(prompt_token_ids=[5, 6, 7, 8], gamma=4, sampling=pb.SamplingParams(max_tokens=8))
    for name, gw in services.gateways.items():
        with grpc.insecure_channel(gw.address) as channel:
            r = rpc.GatewayServiceStub(channel).Generate(pb.GenerateRequest(spec=spec), timeout=TIMEOUT_S)
        assert len(r.token_ids) == 8 and r.finish_reason == pb.FINISH_REASON_LENGTH, name
    with grpc.insecure_channel(services.verifier.address) as channel:
        open_ = pb.VerifyOpen(
            request_id=f"after-fuzz-{next(_ids)}",
            prompt_token_ids=[5, 6, 7],
            sampling=pb.SamplingParams(max_tokens=3),
            gamma=0,
        )
        verdicts = list(
            rpc.VerifierServiceStub(channel).Verify(iter([pb.VerifyRequest(open=open_)]), timeout=TIMEOUT_S)
        )
    assert sum(len(v.token_ids) for v in verdicts if not v.preview) == 3
    with grpc.insecure_channel(services.drafters["mid"].address) as channel:
        open_d = pb.DraftOpen(prompt_token_ids=[5, 6, 7], gamma=2, sampling=pb.SamplingParams(max_tokens=4))
        first = next(
            iter(rpc.DrafterServiceStub(channel).Draft(iter([pb.DraftRequest(open=open_d)]), timeout=TIMEOUT_S)), None
        )
    assert first is None or first.HasField("ready")
