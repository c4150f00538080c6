"""The REST bridge's request and response shaping (gateway/rest/), without services."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from gateway.client import vllm_spec_metrics
from gateway.convert import REFUSED, refuse_extras
from gateway.convert import generation_spec as build_spec
from gateway.rest.protocol import ChatRequest, CompletionRequest
from gateway.rest.routes import _validation_error
from gateway.rest.serving import CHAT, COMPLETION, LogprobsShaper
from specdec.validation import InvalidField
from specdec.wire import pb


class Tok:
    """token id n decodes to the n-th letter."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def _lp(token: int, logprob: float, rank: int, top: list[tuple[int, float]]) -> "pb.TokenLogprobs":
    return pb.TokenLogprobs(
        token_id=token, logprob=logprob, rank=rank, top_token_ids=[t for t, _ in top], top_logprobs=[v for _, v in top]
    )


def test_completion_logprobs_are_shaped_as_vllm_does() -> None:
    # position 0: the sampled token is the best; position 1: it is outside the top 2
    lps = [_lp(0, -0.1, 1, [(0, -0.1), (1, -2.5)]), _lp(3, -4.0, 5, [(1, -0.5), (2, -1.0)])]
    out = LogprobsShaper(Tok(), 2).completion(lps)
    assert out["tokens"] == ["a", "d"] and out["token_logprobs"] == pytest.approx([-0.1, -4.0])
    # the sampled token first, then the top k: k + 1 entries at most, the sampled token once
    assert list(out["top_logprobs"][0]) == ["a", "b"]
    assert list(out["top_logprobs"][1]) == ["d", "b", "c"]
    assert out["text_offset"] == [0, 1]


def test_chat_logprobs_take_the_first_k_entries() -> None:
    lps = [_lp(3, -4.0, 5, [(1, -0.5), (2, -1.0)])]
    (entry,) = LogprobsShaper(Tok(), 2).chat(lps)["content"]
    assert entry["token"] == "d" and entry["bytes"] == [ord("d")]
    assert [t["token"] for t in entry["top_logprobs"]] == ["d", "b"]  # vLLM's order: sampled first
    (entry,) = LogprobsShaper(Tok(), 0, as_ids=True).chat(lps)["content"]
    assert entry["token"] == "token_id:3" and entry["top_logprobs"] == []


def test_vllm_metrics_histogram_from_per_position_counts() -> None:
    stats = pb.SpeculationStats(
        gamma=4, speculative_steps=10, accepted_per_position=[8, 5, 2, 1], accepted_tokens=16, drafted_tokens=40
    )
    m = vllm_spec_metrics(stats)
    h = m["acceptance_histogram"]
    assert h == [2, 3, 3, 1, 1] and sum(h) == m["num_spec_steps"] == 10
    assert sum(j * n for j, n in enumerate(h)) == m["num_accepted_draft_tokens"] == 16
    assert m["draft_acceptance_rate"] == pytest.approx(0.4) and m["mean_acceptance_length"] == pytest.approx(2.6)
    assert m["num_spec_tokens"] == 4
    assert vllm_spec_metrics(pb.SpeculationStats())["acceptance_histogram"] == [0]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"min_p": 0.1}, "min_p"),
        ({"logit_bias": {"10": 5}}, "logit_bias"),
        ({"best_of": 2}, "best_of"),
        ({"priority": 3}, "priority"),
        ({"foo_bar": 1}, "foo_bar"),
        ({"use_beam_search": True}, "use_beam_search"),
    ],
)
def test_unsupported_fields_are_refused_by_name(extra: dict[str, Any], param: str) -> None:
    req = CompletionRequest(prompt="x", **extra)
    with pytest.raises(InvalidField) as info:
        refuse_extras(req)
    assert info.value.field == param  # the bridge answers 400 with this `param`
    if param in REFUSED:
        assert REFUSED[param][1] in str(info.value)  # with the reason


def test_defaults_of_refused_fields_pass() -> None:
    """Clients that send vLLM's defaults explicitly (vllm bench serve, SDKs) are served."""
    refuse_extras(
        CompletionRequest(
            prompt="x",
            min_p=0.0,
            priority=0,
            use_beam_search=False,
            logit_bias=None,
            length_penalty=1.0,
            tools=None,
            spaces_between_special_tokens=True,
        )
    )
    with pytest.raises(InvalidField):  # False is not the default 0 of priority
        refuse_extras(CompletionRequest(prompt="x", priority=False))


def test_spec_carries_every_honoured_field() -> None:
    req = CompletionRequest(
        prompt="x",
        max_tokens=9,
        temperature=0,
        top_k=5,
        seed=3,
        stop="\n",
        stop_token_ids=[7],
        ignore_eos=True,
        min_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logprobs=3,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        allowed_token_ids=[4, 5],
    )
    s = build_spec(req, [1, 2], "r").sampling
    assert (s.max_tokens, s.top_k, s.seed, list(s.stop), list(s.stop_token_ids)) == (9, 5, 3, ["\n"], [7])
    assert s.ignore_eos and s.min_tokens == 2 and s.logprobs == 3 and s.include_stop_str_in_output
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -0.5) and s.repetition_penalty == pytest.approx(1.2)
    assert s.HasField("skip_special_tokens") and not s.skip_special_tokens
    assert list(s.allowed_token_ids) == [4, 5]
    assert not build_spec(CompletionRequest(prompt="x"), [1], "r").sampling.HasField("logprobs")


def test_an_empty_allowed_token_ids_is_refused_by_name() -> None:
    """The wire's empty list means no constraint, so an explicit [] is a 400 (vLLM refuses it too)."""
    assert not build_spec(CompletionRequest(prompt="x"), [1], "r").sampling.allowed_token_ids
    with pytest.raises(InvalidField) as info:
        build_spec(CompletionRequest(prompt="x", allowed_token_ids=[]), [1], "r")
    assert info.value.field == "allowed_token_ids"


def test_chat_logprobs_fields() -> None:
    chat = dict(messages=[{"role": "user", "content": "hi"}])
    assert build_spec(ChatRequest(**chat, logprobs=True, top_logprobs=2), [1], "r").sampling.logprobs == 2
    assert build_spec(ChatRequest(**chat, logprobs=True), [1], "r").sampling.logprobs == 0
    with pytest.raises(InvalidField) as info:
        build_spec(ChatRequest(**chat, top_logprobs=2), [1], "r")
    assert info.value.field == "top_logprobs"
    with pytest.raises(InvalidField) as info:
        build_spec(ChatRequest(**chat, response_format={"type": "json_object"}), [1], "r")
    assert info.value.field == "response_format"
    assert (
        build_spec(
            ChatRequest(**chat, max_completion_tokens=5, response_format={"type": "text"}), [1], "r"
        ).sampling.max_tokens
        == 5
    )


def test_shapes_differ_in_logprobs_layout() -> None:
    assert COMPLETION.logprobs is LogprobsShaper.completion and CHAT.logprobs is LogprobsShaper.chat


class ByteTok:
    """Ids 0-255 are bytes (byte-fallback pieces), 256 is " ok": decode joins the bytes as UTF-8."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        raw = b"".join(b" ok" if i == 256 else bytes([i]) for i in ids)
        return raw.decode("utf-8", errors="replace")


def test_byte_fallback_tokens_are_named_as_vllm_names_them() -> None:
    """ "é" is two byte tokens: the first alone is incomplete (""), the second completes it."""
    shaper = LogprobsShaper(ByteTok(), 1)
    first, second = 0xC3, 0xA9
    out = shaper.completion(
        [_lp(256, -0.1, 1, [(256, -0.1)]), _lp(first, -0.2, 1, [(first, -0.2)]), _lp(second, -0.3, 1, [(second, -0.3)])]
    )
    assert out["tokens"] == [" ok", "", "é"]
    assert out["text_offset"] == [0, 3, 3]


@pytest.mark.parametrize(
    "part, kind",
    [
        ({"type": "image_url", "image_url": {"url": "http://x"}}, "'image_url'"),
        ({"text": "no type"}, "None"),
        ("hi", "None"),
    ],
)
def test_a_content_part_that_is_not_text_is_refused_by_index_and_type(part: Any, kind: str) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, part]}]}
    with pytest.raises(ValidationError) as info:
        ChatRequest.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    api = _validation_error(RequestValidationError(errors))
    assert api.param == "messages"
    assert api.message.startswith("messages.0.content: ")
    assert f"part 1 has type {kind}; only text parts" in api.message
    assert ChatRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]})


def _drained_stream(notice: str | None) -> tuple[list[dict[str, Any]], BaseException | None, bool]:
    """An EventStreamResponse whose first message's write never completes (a full socket) when
    the drain cancels its task; `notice`: what ended_by_drain says of that task. Returns the
    messages sent, the task's exception (None: it ended normally), and whether its events were
    closed (the generation ended)."""
    import asyncio

    from gateway.rest.serving import EventStreamResponse

    async def run() -> tuple[list[dict[str, Any]], BaseException | None, bool]:
        sent: list[dict[str, Any]] = []
        writing, forever = asyncio.Event(), asyncio.Event()
        closed = []

        async def events():  # noqa: ANN202 (an async generator)
            try:
                yield "data: {}\n\n"
                await forever.wait()
            finally:
                closed.append(True)

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not sent[1:]:  # the first body message
                sent.append(message)
                writing.set()
                await forever.wait()  # its write never completes
            sent.append(message)

        async def receive() -> dict[str, Any]:
            await forever.wait()  # the client never leaves
            return {"type": "http.disconnect"}

        response = EventStreamResponse(events(), 0.0, ended_by_drain=lambda task: notice if task is served else None)
        served = asyncio.ensure_future(response({"type": "http"}, receive, send))
        await asyncio.wait_for(writing.wait(), 10)
        served.cancel()  # as SessionSlots.drain cancels a call past shutdown_timeout_s
        try:
            await asyncio.wait_for(served, 10)
        except BaseException as err:  # noqa: BLE001 (what the task ended with is the result)
            return sent, err, bool(closed)
        return sent, None, bool(closed)

    return asyncio.run(run())


def test_a_rest_stream_the_drain_ends_mid_write_gets_an_error_event() -> None:
    """A stream the drain ends while one of its messages is being written (not while it waits
    for tokens, where the core's own error reaches the events) still gets the drain's notice as
    an error event, and a proper end, instead of a connection closed mid-body. A cancel that is
    not the drain's stays a cancel."""
    import asyncio
    import json

    notice = "gateway: shut down before this call finished (shutdown_timeout_s, 30 s, passed); retry"
    sent, err, closed = _drained_stream(notice)
    assert err is None and closed
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    error = json.loads(bodies[-2]["body"].decode().removeprefix("data: "))
    assert error["error"]["message"] == notice and error["error"]["code"] == "unavailable", error
    assert bodies[-1] == {"type": "http.response.body", "body": b"", "more_body": False}

    sent, err, closed = _drained_stream(None)
    assert isinstance(err, asyncio.CancelledError) and closed
    assert not any(b"shut down" in m.get("body", b"") for m in sent)
