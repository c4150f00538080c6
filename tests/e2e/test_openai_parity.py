"""The REST bridge (gateway/rest/) against vLLM's own OpenAI server, field by field.

Each honoured field goes, in the same request body, to vLLM's server (plain target, no
speculation: tests/e2e/openai_reference.py) and to the bridge in front of the "mid"
gateway (speculation on); greedy outputs must be equal (text, finish_reason,
completion_tokens), log-probabilities equal to 1e-4. Sampled requests are not expected
to match across engines (different random streams): they are checked for shape only.
Fields the bridge does not honour must be refused (400, OpenAI's error shape, `param`
naming the field), never silently ignored; every field of vLLM's request models is either
declared by the bridge or listed in gateway.convert.REFUSED.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from gen import stall_report
from openai_reference import log_tail, vllm_openai_server
from test_rest import CHAT_TEMPLATE, MESSAGES, MODEL, bridge, serve, tokenizer

from specdec.models import resolve

PROMPT = "def add(a, b):\n    return"
# vLLM's greedy output for this prompt ends with EOS after 14 tokens (the tiny target rarely emits it)
EOS_PROMPT = "            try:\n"
EOS_AFTER = 14
MAX_TOKENS = 24
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)
ID = {COMPLETIONS: "cmpl", CHAT: "chat"}
REQUEST_TIMEOUT_S = 30  # a greedy 24-token request takes well under a second; a dead verifier hangs it
LOGPROB_TOL = 1e-4
SPEC_KEYS = (
    "mean_acceptance_length",
    "draft_acceptance_rate",
    "acceptance_histogram",
    "num_spec_steps",
    "num_accepted_draft_tokens",
    "num_draft_tokens",
    "num_spec_tokens",
)


# ---------------------------------------------------------------------------- servers


@dataclass(frozen=True)
class Servers:
    vllm: str  # base URL of vLLM's OpenAI server
    specdec: str  # base URL of the bridge
    services: Any  # conftest's Services: the processes behind the bridge

    def dead(self) -> str | None:
        """Which specdec service this module uses has exited (its log's tail), if any: every later
        request would hang. (Other modules stop services of their own on purpose.)"""
        used = [self.services.verifier, self.services.drafters["mid"], self.services.gateways["mid"]]
        for svc in used:
            if svc.proc.poll() is not None:
                return f"{svc.kind} on {svc.address} exited with {svc.proc.returncode}; {svc.log_path}:\n" + (
                    log_tail(svc.log_path) if svc.log_path else ""
                )
        return None


@pytest.fixture(scope="module")
def vllm_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's OpenAI server on the tiny target; the specdec services start while it loads."""
    with vllm_openai_server(
        resolve(MODEL),
        tmp_path_factory.mktemp("vllm-openai"),
        chat_template=CHAT_TEMPLATE,
        while_starting=lambda: request.getfixturevalue("services"),
    ) as server:
        print(f"\nvLLM OpenAI server ready {server.startup_s:.1f} s after launch")
        yield server.url


@pytest.fixture(scope="module")
def servers(vllm_url: str, services) -> Iterator[Servers]:
    with serve(bridge(services, tokenizer(CHAT_TEMPLATE))) as url:
        yield Servers(vllm_url, url, services)


# ---------------------------------------------------------------------------- helpers


def body(endpoint: str, **fields: Any) -> dict[str, Any]:
    """A greedy request: PROMPT (completions) or MESSAGES (chat), MAX_TOKENS, temperature 0."""
    base: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0}
    base.update({"prompt": PROMPT} if endpoint == COMPLETIONS else {"messages": MESSAGES})
    base.update(fields)
    return {k: v for k, v in base.items() if v is not None}  # a None drops a default (max_tokens)


def post(base_url: str, endpoint: str, payload: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base_url}{endpoint}", json=payload, timeout=REQUEST_TIMEOUT_S)


def ok(base_url: str, endpoint: str, payload: dict[str, Any], who: str) -> dict[str, Any]:
    r = post(base_url, endpoint, payload)
    assert r.status_code == 200, f"{who} answered {r.status_code} to {payload}: {r.text[:2000]}"
    return r.json()


def both(s: Servers, endpoint: str, payload: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(vLLM's answer, the bridge's answer) to the same request; vLLM first."""
    return ok(s.vllm, endpoint, payload, "vLLM"), specdec_ok(s, endpoint, payload)


_HUNG: list[str] = []  # set when a specdec request timed out: later ones would hang too


def specdec_ok(s: Servers, endpoint: str, payload: dict[str, Any]) -> dict[str, Any]:
    """The bridge's 200 answer. Fails at once, saying why, when a specdec service has died or
    an earlier request hung (a verifier whose engine failed stays up but answers nothing)."""
    if (dead := s.dead()) is not None:
        pytest.fail(f"a specdec service died before this test: {dead}")
    if _HUNG:
        pytest.fail(f"an earlier specdec request hung, so this one would too: {_HUNG[0]}")
    try:
        return ok(s.specdec, endpoint, payload, "specdec")
    except httpx.TimeoutException:
        verifier = s.services.verifier
        log = log_tail(verifier.log_path, 200_000).splitlines()
        errors = [line for line in log if "Error" in line or "ERROR" in line]
        _HUNG.append(
            f"{payload} got no answer in {REQUEST_TIMEOUT_S} s; verifier log {verifier.log_path}, "
            "its errors:\n"
            + "\n".join(line[:400] for line in errors[-6:])
            + "\nwhat the verifier and the gateway are doing:\n"
            + "\n".join(stall_report(svc) for svc in (verifier, s.services.gateways["mid"]))
        )
        pytest.fail(_HUNG[-1])


def text(r: dict[str, Any]) -> str:
    choice = r["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def outcome(r: dict[str, Any]) -> tuple[str, str, int]:
    """What greedy parity compares: the text, the finish reason, the completion tokens."""
    return text(r), r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]


def assert_same(v: dict[str, Any], s: dict[str, Any], what: str = "") -> None:
    assert outcome(s) == outcome(v), f"{what}: specdec (text, finish, tokens) differs from vLLM's"


def drafted(r: dict[str, Any]) -> int:
    """Draft tokens verified for a specdec answer: vLLM's name, or specdec's own (usage.speculation)."""
    spec = (r.get("metrics") or {}).get("speculative_decoding")
    if spec is not None:
        return spec["num_draft_tokens"]
    return r["usage"]["speculation"]["drafted_tokens"]


def sse(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of a server-sent-events answer, up to [DONE] (which must end it)."""
    assert response.status_code == 200, response.text[:2000]
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def vllm_shape(endpoint: str, r: dict[str, Any], stream: bool = False) -> None:
    """The answer parses as vLLM's own response model."""
    if endpoint == COMPLETIONS:
        from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionStreamResponse

        (CompletionStreamResponse if stream else CompletionResponse).model_validate(r)
    else:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponse,
            ChatCompletionStreamResponse,
        )

        (ChatCompletionStreamResponse if stream else ChatCompletionResponse).model_validate(r)


# ---------------------------------------------------------------------------- honoured fields: greedy parity


# (case id, endpoints, extra fields); each is compared with vLLM's answer to the same body
PARITY_CASES = [
    ("plain", ENDPOINTS, {}),
    ("top_k", ENDPOINTS, {"top_k": 5}),
    ("seed", ENDPOINTS, {"seed": 7}),
    ("frequency_penalty", ENDPOINTS, {"frequency_penalty": 1.0}),
    ("presence_penalty", ENDPOINTS, {"presence_penalty": 1.0}),
    ("repetition_penalty", ENDPOINTS, {"repetition_penalty": 1.3}),
    ("min_tokens", (COMPLETIONS,), {"prompt": EOS_PROMPT, "min_tokens": 20}),
    ("min_tokens", (CHAT,), {"min_tokens": 20, "max_tokens": 24}),
    ("echo", (COMPLETIONS,), {"echo": True}),
    ("echo", (CHAT,), {"echo": True, "messages": [*MESSAGES, {"role": "assistant", "content": "    return"}]}),
    ("max_completion_tokens", (CHAT,), {"max_tokens": None, "max_completion_tokens": 10}),
    ("response_format text", ENDPOINTS, {"response_format": {"type": "text"}}),
    ("n=1", ENDPOINTS, {"n": 1}),
    ("user", ENDPOINTS, {"user": "user-1234"}),
    (
        "skip_special_tokens=false",
        (COMPLETIONS,),
        {"prompt": EOS_PROMPT, "ignore_eos": True, "skip_special_tokens": False},
    ),
    (
        "skip_special_tokens=true",
        (COMPLETIONS,),
        {"prompt": EOS_PROMPT, "ignore_eos": True, "skip_special_tokens": True},
    ),
    ("skip_special_tokens=false", (CHAT,), {"skip_special_tokens": False}),
]


@pytest.mark.parametrize(
    "endpoint, extra",
    [pytest.param(e, extra, id=f"{name}-{ID[e]}") for name, eps, extra in PARITY_CASES for e in eps],
)
def test_honoured_field_matches_vllm(servers: Servers, endpoint: str, extra: dict[str, Any]) -> None:
    payload = body(endpoint, **extra)
    v, s = both(servers, endpoint, payload)
    vllm_shape(endpoint, s)
    assert_same(v, s, str(extra))
    if extra.get("max_completion_tokens"):
        assert s["usage"]["completion_tokens"] == extra["max_completion_tokens"]
    if "min_tokens" in extra:
        assert v["usage"]["completion_tokens"] >= extra["min_tokens"]
    if extra.get("skip_special_tokens") is False and endpoint == COMPLETIONS:
        assert "<|endoftext|>" in text(v)  # the premise: EOS is in the output, and shown


def test_penalties_change_the_output(servers: Servers) -> None:
    """The premise of the penalty cases: vLLM's output with them differs from plain greedy."""
    plain = text(ok(servers.vllm, COMPLETIONS, body(COMPLETIONS), "vLLM"))
    for field, value in (("frequency_penalty", 1.0), ("presence_penalty", 1.0), ("repetition_penalty", 1.3)):
        assert text(ok(servers.vllm, COMPLETIONS, body(COMPLETIONS, **{field: value}), "vLLM")) != plain, field


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=ID.get)
def test_ignore_eos(servers: Servers, endpoint: str) -> None:
    extra: dict[str, Any] = {"prompt": EOS_PROMPT} if endpoint == COMPLETIONS else {}
    if endpoint == COMPLETIONS:  # the premise: without ignore_eos, vLLM stops early on EOS
        v = ok(servers.vllm, endpoint, body(endpoint, **extra), "vLLM")
        assert (v["choices"][0]["finish_reason"], v["usage"]["completion_tokens"]) == ("stop", EOS_AFTER)
    # chat: no chat prompt found where the tiny target emits EOS early; the field is still compared
    v, s = both(servers, endpoint, body(endpoint, ignore_eos=True, **extra))
    assert v["usage"]["completion_tokens"] == MAX_TOKENS
    assert s["usage"]["completion_tokens"] == MAX_TOKENS
    assert_same(v, s, "ignore_eos")


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=ID.get)
def test_stop_token_ids(servers: Servers, endpoint: str) -> None:
    first = ok(servers.vllm, endpoint, body(endpoint, return_token_ids=True), "vLLM")
    ids = first["choices"][0]["token_ids"]
    first_at = {}
    for i, t in enumerate(ids):
        first_at.setdefault(t, i)
    stop_id = max(first_at, key=first_at.__getitem__)  # the token that first shows up last
    assert first_at[stop_id] >= 1, ids
    v, s = both(servers, endpoint, body(endpoint, stop_token_ids=[stop_id]))
    assert v["choices"][0]["finish_reason"] == "stop" and v["usage"]["completion_tokens"] == first_at[stop_id] + 1
    assert_same(v, s, f"stop_token_ids=[{stop_id}]")


def _stop_string(output: str) -> str:
    """A one-character stop string from `output` whose first occurrence is as late as possible."""
    firsts = {c: output.index(c) for c in set(output) if c.isprintable() and not c.isspace() and c != "\ufffd"}
    assert firsts, repr(output)
    return max(firsts, key=firsts.__getitem__)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=ID.get)
def test_stop_and_include_stop_str_in_output(servers: Servers, endpoint: str, include: bool) -> None:
    plain = text(ok(servers.vllm, endpoint, body(endpoint), "vLLM"))
    stop = _stop_string(plain)
    v, s = both(servers, endpoint, body(endpoint, stop=[stop], include_stop_str_in_output=include))
    expected = plain[: plain.index(stop)] + (stop if include else "")
    assert (text(v), v["choices"][0]["finish_reason"]) == (expected, "stop")  # the premise
    assert_same(v, s, f"stop={stop!r} include_stop_str_in_output={include}")


# ---------------------------------------------------------------------------- logprobs


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, abs_tol=LOGPROB_TOL)


@pytest.mark.parametrize("k", [0, 2, 5])
def test_completion_logprobs_match_vllm(servers: Servers, k: int) -> None:
    v, s = both(servers, COMPLETIONS, body(COMPLETIONS, logprobs=k))
    assert drafted(s) > 0, "the bridge's request should have run with speculation"
    vl, sl = v["choices"][0]["logprobs"], s["choices"][0]["logprobs"]
    assert sl is not None, "specdec returned no logprobs"
    n = v["usage"]["completion_tokens"]
    assert len(vl["token_logprobs"]) == n, "the premise: one entry per generated token"
    problems = []  # every mismatch at once: values, then token strings
    for key in ("token_logprobs", "tokens", "top_logprobs", "text_offset"):
        if len(sl[key]) != n:
            problems.append(f"{key}: {len(sl[key])} entries, vLLM {n}")
    for i, (a, b) in enumerate(zip(sl["token_logprobs"], vl["token_logprobs"], strict=False)):  # lengths compared above
        if not _close(a, b):
            problems.append(f"token_logprobs[{i}]: specdec {a} vLLM {b}")
    for i, (a, b) in enumerate(zip(sl["top_logprobs"], vl["top_logprobs"], strict=False)):  # lengths compared above
        # keyed by token text, as in vLLM (tokens decoding alike share one key)
        if sorted(a) != sorted(b) or not all(_close(a[t], b[t]) for t in b):
            problems.append(f"top_logprobs[{i}]: specdec {a} vLLM {b}")
    if sl["tokens"] != vl["tokens"]:
        problems.append(f"tokens: specdec {sl['tokens']} vLLM {vl['tokens']}")
    if sl["text_offset"] != vl["text_offset"]:
        problems.append(f"text_offset: specdec {sl['text_offset']} vLLM {vl['text_offset']}")
    if outcome(s) != outcome(v):
        problems.append(f"(text, finish, tokens): specdec {outcome(s)} vLLM {outcome(v)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("k", [0, 2, 5])
def test_chat_logprobs_match_vllm(servers: Servers, k: int) -> None:
    v, s = both(servers, CHAT, body(CHAT, logprobs=True, top_logprobs=k))
    assert drafted(s) > 0, "the bridge's request should have run with speculation"
    assert s["choices"][0]["logprobs"] is not None, "specdec returned no logprobs"
    vc, sc = v["choices"][0]["logprobs"]["content"], s["choices"][0]["logprobs"]["content"]
    assert len(vc) == v["usage"]["completion_tokens"], "the premise: one entry per generated token"
    problems = [] if len(sc) == len(vc) else [f"content: {len(sc)} entries, vLLM {len(vc)}"]
    for i, (a, b) in enumerate(zip(sc, vc, strict=False)):  # lengths compared above
        if not _close(a["logprob"], b["logprob"]):
            problems.append(f"content[{i}].logprob: specdec {a['logprob']} vLLM {b['logprob']}")
        av, bv = [t["logprob"] for t in a["top_logprobs"]], [t["logprob"] for t in b["top_logprobs"]]
        if av != pytest.approx(bv, abs=LOGPROB_TOL):
            problems.append(f"content[{i}].top_logprobs values: specdec {av} vLLM {bv}")
        if (a["token"], a.get("bytes")) != (b["token"], b.get("bytes")):
            problems.append(
                f"content[{i}] token: specdec {a['token']!r} {a.get('bytes')} vLLM {b['token']!r} {b.get('bytes')}"
            )
        at = [(t["token"], t.get("bytes")) for t in a["top_logprobs"]]
        bt = [(t["token"], t.get("bytes")) for t in b["top_logprobs"]]
        if at != bt:
            problems.append(f"content[{i}].top_logprobs tokens: specdec {at} vLLM {bt}")
    if outcome(s) != outcome(v):
        problems.append(f"(text, finish, tokens): specdec {outcome(s)} vLLM {outcome(v)}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------- refused fields


REFUSALS = [
    ("min_p", 0.1),
    ("foo_bar", 1),
    ("n", 2),
    ("logit_bias", {"10": 5}),
    ("best_of", 2),  # not a vLLM 0.32 field: unknown
]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=ID.get)
@pytest.mark.parametrize("field, value", REFUSALS, ids=[f for f, _ in REFUSALS])
def test_refused_field_is_400(servers: Servers, endpoint: str, field: str, value: Any, stream: bool) -> None:
    payload = body(endpoint, temperature=0.8, seed=7, stream=stream, **{field: value})
    r = post(servers.specdec, endpoint, payload)  # refused before the gateway: no service needed
    assert r.status_code == 400, f"{field}={value!r}: {r.status_code} {r.text[:1000]}"
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["param"] == field, error
    assert isinstance(error["message"], str) and field in error["message"], error
    if field == "min_p":
        assert "speculative" in error["message"], error  # says why


# ---------------------------------------------------------------------------- completeness (no server)


def _reason(entry: Any) -> Any:
    """REFUSED's value: a reason string, or a tuple whose last item is the reason."""
    return entry[-1] if isinstance(entry, tuple) else entry


@pytest.mark.parametrize("which", ["completions", "chat"])
def test_every_vllm_field_is_declared_or_refused(which: str) -> None:
    from gateway import convert
    from gateway.rest import protocol as rest

    if which == "completions":
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as Theirs

        ours = rest.CompletionRequest
    else:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as Theirs

        ours = rest.ChatRequest
    refused: dict[str, Any] = convert.REFUSED
    missing = sorted(set(Theirs.model_fields) - set(ours.model_fields) - set(refused))
    assert not missing, f"vLLM {which} fields neither declared by the bridge nor in gateway.convert.REFUSED: {missing}"
    for name in set(Theirs.model_fields) & set(refused):
        assert isinstance(_reason(refused[name]), str) and _reason(refused[name]), f"REFUSED[{name!r}] has no reason"
    both_ways = sorted(set(ours.model_fields) & set(refused))
    assert not both_ways, f"declared and refused at once: {both_ways}"


# ---------------------------------------------------------------------------- speculation metrics


def check_spec_metrics(r: dict[str, Any]) -> dict[str, Any]:
    """metrics.speculative_decoding under vLLM's names, consistent in itself and with usage.speculation."""
    from vllm.entrypoints.generate.base.protocol import PerRequestMetrics

    assert r.get("metrics") and r["metrics"].get("speculative_decoding"), f"no metrics.speculative_decoding: {r}"
    PerRequestMetrics.model_validate(r["metrics"])  # vLLM's own model of it
    m = r["metrics"]["speculative_decoding"]
    assert set(SPEC_KEYS) <= set(m), sorted(m)
    hist, steps = m["acceptance_histogram"], m["num_spec_steps"]
    accepted, drafts = m["num_accepted_draft_tokens"], m["num_draft_tokens"]
    assert drafts > 0 and steps > 0, m
    assert len(hist) == m["num_spec_tokens"] + 1, m
    assert sum(hist) == steps, m
    assert sum(j * h for j, h in enumerate(hist)) == accepted, m
    assert 0 <= accepted <= drafts <= steps * m["num_spec_tokens"], m
    assert math.isclose(m["draft_acceptance_rate"], accepted / drafts, rel_tol=1e-6), m
    assert math.isclose(m["mean_acceptance_length"], 1 + accepted / steps, rel_tol=1e-6), m
    alias = r["usage"].get("speculation")
    assert alias is not None, "usage.speculation (the alias) is gone"
    assert (alias["accepted_tokens"], alias["drafted_tokens"]) == (accepted, drafts), (alias, m)
    assert (
        alias.get("speculative_steps", steps) == steps
        and alias.get("gamma", m["num_spec_tokens"]) == m["num_spec_tokens"]
    ), (alias, m)
    return m


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=ID.get)
def test_spec_metrics_in_response(servers: Servers, endpoint: str) -> None:
    r = specdec_ok(servers, endpoint, body(endpoint))
    check_spec_metrics(r)
    vllm_shape(endpoint, r)


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=ID.get)
def test_spec_metrics_in_stream_usage_chunk(servers: Servers, endpoint: str) -> None:
    full = specdec_ok(servers, endpoint, body(endpoint))
    payload = body(endpoint, stream=True, stream_options={"include_usage": True})
    events = sse(post(servers.specdec, endpoint, payload))
    *chunks, last = events
    for c in events:
        vllm_shape(endpoint, c, stream=True)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == full["usage"]["completion_tokens"]
    m = check_spec_metrics(last)
    assert all(not c.get("metrics") for c in chunks), "metrics belong on the final usage chunk only"
    assert m["num_spec_tokens"] == full["metrics"]["speculative_decoding"]["num_spec_tokens"]
    # vLLM (no speculation) sends the same usage chunk, without metrics
    v = sse(post(servers.vllm, endpoint, payload))
    assert v[-1]["choices"] == [] and v[-1]["usage"]["completion_tokens"] == last["usage"]["completion_tokens"]


# ---------------------------------------------------------------------------- sampled requests
# Last in the file: sampling with top_k has crashed the verifier's engine (vLLM's rejection
# sampler on CPU), which leaves the session's services unable to answer the tests after it.


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=ID.get)
@pytest.mark.parametrize(
    "extra", [{"temperature": 0.8, "seed": 7}, {"top_k": 5, "temperature": 0.8, "seed": 7}], ids=["seed", "top_k"]
)
def test_sampled_requests_are_well_formed(servers: Servers, endpoint: str, extra: dict[str, Any]) -> None:
    """Sampling is not compared across engines (different random streams): 200 and shape only."""
    v, s = both(servers, endpoint, body(endpoint, **extra))
    for r in (v, s):
        vllm_shape(endpoint, r)
        assert isinstance(text(r), str) and r["choices"][0]["finish_reason"] in ("length", "stop")
        assert 0 < r["usage"]["completion_tokens"] <= MAX_TOKENS


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=ID.get)
def test_top_k_1_sampling_is_greedy(servers: Servers, endpoint: str) -> None:
    """top_k 1 makes sampling argmax: deterministic, so comparable with vLLM, and greedy only if
    top_k is honoured (at temperature 0.8 without it, the output would differ)."""
    v, s = both(servers, endpoint, body(endpoint, top_k=1, temperature=0.8, seed=7))
    assert outcome(v) == outcome(ok(servers.vllm, endpoint, body(endpoint), "vLLM"))  # the premise
    assert_same(v, s, "top_k=1 temperature=0.8")
