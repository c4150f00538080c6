"""Fuzzing the REST bridge (gateway/rest/) in front of a real gateway, with a peer's tools.

`schemathesis` reads the bridge's own OpenAPI document (FastAPI's /openapi.json, as the
running bridge serves it) and sends requests generated from it:
  - fuzz: its positive mode (valid for the document) and negative mode (invalid for it);
  - coverage: its coverage phase (each field at and past its bounds, wrong types, missing
    required fields, and the HTTP methods a route does not serve), deterministic;
  - contract: the positive mode on the document narrowed to what the bridge accepts (docs/usage.md
    "Requests", docs/rest.md: top_p in (0, 1], penalties in [-2, 2], no unknown field, ...),
    so that nearly every request runs on the gateway: each must then answer 200, or a 400
    for one of the few cross-field rules a schema cannot state (CONTRACT_400).
A plain `hypothesis` test sends what a schema cannot describe: JSON with lone surrogates,
NaN / Infinity literals, integers past int32 and uint64, nested junk, over a valid request;
and each field is sent once just past the contract's bound (OUT_OF_CONTRACT: 400 naming it).
A request that gets no answer, when the verifier then no longer serves at all, ends the test
at once (ServiceStopped, unshrunk), and the module's later tests with it.

Properties, for every request:
  - no 5xx, ever;
  - every 4xx is OpenAI's error JSON, {"error": {"message": str, "type": str,
    "param": str | null, "code": ...}};
  - a request that runs answers 200 with a well-formed completion, or, for stream=true,
    server-sent events that end with `data: [DONE]` (or an OpenAI-shaped error event that is
    not a server error);
and afterwards the bridge still serves a normal request.

Completions go to `services.gateways["mid"]`'s own bridge. Its tokenizer (the tiny target's)
has no chat template, so that bridge answers every chat request 400 before the gateway; chat
requests go to a bridge built as tests/e2e/test_rest.py builds it (its chat template), on a
gateway core of its own in this process, on the same drafter and verifier.

Not checked: conformance to the response schema FastAPI documents (it documents 422 for bad
input where the bridge answers 400 as OpenAI does, and streams are text/event-stream).

Bounded for CI: SPECDEC_FUZZ_EXAMPLES (default 40) examples per test, derandomized (the same
requests every run), no example database. A generated max_tokens the request could really
run (<= the context length) is cut to MAX_RUN_TOKENS, and a request without one (or with
null: the gateway's default_max_tokens, 128) gets it, so an accepted request generates a few
tokens; larger values still go out, and must be 400s. A longer run, not in CI:
    SPECDEC_FUZZ_EXAMPLES=400 pytest tests/e2e/test_fuzz_rest.py
(schemathesis' pytest plugin, `schemathesis.pytest.from_fixture`, which a port known only
once the services run needs, fails on pytest 9: it sets `request.node._nodeid`; so the
operations' strategies are driven by hypothesis here, and the coverage cases by a loop.)
"""

from __future__ import annotations

import copy
import json
import math
import os
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import requests
import schemathesis
from gen import stall_report
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode, HookContext
from schemathesis.hooks import HookDispatcher, HookScope
from test_rest import CHAT_TEMPLATE, bridge, serve, tokenizer

from specdec.models.tiny import MAX_POSITIONS
from specdec.wire import pb, rpc

MODEL = "tiny/target"
MAX_EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "40"))
MAX_MODEL_LEN = MAX_POSITIONS  # the tiny target's context, which the verifier's default (vLLM's auto-fit) runs
MAX_GAMMA = 8  # tests/conftest.py
MAX_RUN_TOKENS = 4  # what an accepted fuzzed request generates at most
TIMEOUT_S = 30  # one request; a tiny generation takes well under a second
STATE: dict[str, Any] = {}  # the verifier and gateway (Services'), and why it stopped serving (stop_if_wedged)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OPERATIONS = [("POST", COMPLETIONS), ("POST", CHAT), ("GET", "/v1/models"), ("GET", "/health")]
FUZZ_SETTINGS = dict(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
# Contract mode: the 400s a request valid field by field may still get, by `param`: the rules
# between fields (echo with logprobs; top_logprobs without logprobs; continue_final_message with
# add_generation_prompt) and a text prompt that tokenises to nothing.
CONTRACT_400 = {COMPLETIONS: {"echo", "prompt"}, CHAT: {"top_logprobs", "continue_final_message"}}


# ---------------------------------------------------------------------------- bridges


@pytest.fixture(scope="module")
def vocab_size(services) -> int:
    with grpc.insecure_channel(services.verifier.address) as channel:
        return rpc.VerifierServiceStub(channel).GetVerifierInfo(pb.GetVerifierInfoRequest(), timeout=30).vocab_size


@pytest.fixture(scope="module")
def bridges(services) -> Iterator[dict[str, str]]:
    """The base URL to send each path to (module docstring)."""
    STATE.update(verifier=services.verifier, gateway=services.gateways["mid"])
    gateway = f"http://127.0.0.1:{services.gateways['mid'].rest_port}"
    with serve(bridge(services, tokenizer(CHAT_TEMPLATE))) as chat:
        yield {COMPLETIONS: gateway, CHAT: chat, "/v1/models": gateway, "/health": gateway}


@pytest.fixture(scope="module")
def served_document(bridges: dict[str, str]) -> dict[str, Any]:
    """The OpenAPI document the gateway's bridge serves."""
    r = requests.get(f"{bridges[COMPLETIONS]}/openapi.json", timeout=30)
    r.raise_for_status()
    return r.json()


def _schema(document: dict[str, Any], base_url: str) -> Any:
    schema = schemathesis.openapi.from_dict(document)
    schema.config.update(base_url=base_url)
    schema.config.generation.update(max_examples=MAX_EXAMPLES, deterministic=True, database="none")
    return schema


def _bounded(context: Any, body: Any) -> Any:
    """A schemathesis `map_body` hook: an accepted request generates at most MAX_RUN_TOKENS."""
    if not isinstance(body, dict) or context.operation.path not in (COMPLETIONS, CHAT):
        return body
    limits = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    for key in limits:
        value = body[key]
        if isinstance(value, int) and not isinstance(value, bool) and MAX_RUN_TOKENS < value <= MAX_MODEL_LEN:
            body[key] = MAX_RUN_TOKENS
    if not limits:  # completions: 16 when absent, the gateway's default (128) when null; chat: that default
        body["max_tokens"] = MAX_RUN_TOKENS
    return body


def _hooks() -> HookDispatcher:
    hooks = HookDispatcher(scope=HookScope.TEST)
    hooks.register_hook_with_name(_bounded, "map_body")
    return hooks


def contract_document(served: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """The served document narrowed to the values the bridge accepts, field by field."""
    doc = copy.deepcopy(served)
    schemas = doc["components"]["schemas"]

    def opt(s: dict[str, Any]) -> dict[str, Any]:
        return {"anyOf": [s, {"type": "null"}]}

    number = {"type": "number"}
    common = {
        "model": {"enum": [MODEL, None]},
        "max_tokens": opt({"type": "integer", "minimum": 1, "maximum": MAX_RUN_TOKENS}),
        "temperature": opt({**number, "minimum": 0, "maximum": 2}),  # vLLM's range
        # float32 on the wire: a positive double below ~1e-45 becomes 0 (and is refused as 0)
        "top_p": opt({**number, "minimum": 1e-6, "maximum": 1}),
        "top_k": opt({"type": "integer", "minimum": -1, "maximum": 10_000}),
        "stop": opt(
            {
                "anyOf": [
                    {"type": "string", "minLength": 1, "maxLength": 8},
                    {"type": "array", "maxItems": 3, "items": {"type": "string", "minLength": 1, "maxLength": 8}},
                ]
            }
        ),
        "stop_token_ids": opt(
            {"type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
        ),
        # a set of ids in the vocabulary; [] is refused (vLLM refuses it too: leave the field out)
        "allowed_token_ids": opt(
            {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
            }
        ),
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": 1},
        "presence_penalty": opt({**number, "minimum": -2, "maximum": 2}),
        "frequency_penalty": opt({**number, "minimum": -2, "maximum": 2}),
        "repetition_penalty": opt({**number, "minimum": 1e-6, "maximum": 10_000}),
        "n": {"enum": [1, None]},
        "request_id": opt({"type": "string", "pattern": "^[A-Za-z0-9._:-]{0,64}$"}),  # specdec.validation's rule
        "response_format": opt(
            {
                "type": "object",
                "properties": {"type": {"enum": ["text"]}},
                "required": ["type"],
                "additionalProperties": False,
            }
        ),
        "gamma": opt({"type": "integer", "minimum": 0, "maximum": MAX_GAMMA}),
    }
    completion = schemas["CompletionRequest"]
    completion["properties"].update(common)
    completion["properties"]["prompt"] = {
        "anyOf": [
            {"type": "string", "minLength": 1, "maxLength": 200},
            {
                "type": "array",
                "minItems": 1,
                "maxItems": 64,
                "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
            },
            {
                "type": "array",
                "minItems": 1,
                "maxItems": 1,
                "items": {"type": "string", "minLength": 1, "maxLength": 200},
            },
        ]
    }
    completion["properties"]["logprobs"] = opt({"type": "integer", "minimum": 0, "maximum": 20})
    chat = schemas["ChatRequest"]
    chat["properties"].update(common)
    chat["properties"]["max_completion_tokens"] = common["max_tokens"]
    chat["properties"]["messages"]["maxItems"] = 4
    chat["properties"]["chat_template_kwargs"] = opt({"type": "object", "maxProperties": 0})
    schemas["ChatMessage"]["properties"]["role"] = {"enum": ["system", "user", "assistant"]}
    for model in (completion, chat, schemas["ChatMessage"], schemas["TextPart"], schemas["StreamOptions"]):
        model["additionalProperties"] = False  # the bridge refuses fields it does not know
    return doc


# ---------------------------------------------------------------------------- checks


def assert_openai_error(body: Any, where: str) -> dict[str, Any]:
    """`body` is OpenAI's error JSON; returns its `error` object."""
    assert isinstance(body, dict) and set(body) == {"error"}, f"{where}: not OpenAI's error shape: {body!r}"
    err = body["error"]
    assert isinstance(err, dict), f"{where}: {body!r}"
    assert {"message", "type", "param", "code"} <= set(err), f"{where}: missing keys: {body!r}"
    assert isinstance(err["message"], str) and err["message"], f"{where}: {body!r}"
    assert isinstance(err["type"], str) and err["type"], f"{where}: {body!r}"
    assert err["param"] is None or isinstance(err["param"], str), f"{where}: {body!r}"
    assert err["code"] is None or isinstance(err["code"], (str, int)), f"{where}: {body!r}"
    return err


def _events(text: str) -> list[Any]:
    """The `data:` payloads of a server-sent event stream, JSON-decoded ([DONE] kept as a str)."""
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), f"not a server-sent event: {block!r}"
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def check_answer(
    method: str, path: str, status: int, content_type: str, text: str, where: str
) -> dict[str, Any] | None:
    """The properties every answer of the bridge has (module docstring); returns the error
    object of a 4xx."""
    assert status < 500, f"{where}: {status} {text[:2000]}"
    if status >= 400:
        return assert_openai_error(json.loads(text), where)
    if path not in (COMPLETIONS, CHAT) or method != "POST":
        return None
    assert status == 200, f"{where}: {status} {text[:2000]}"
    kind = "text_completion" if path == COMPLETIONS else "chat.completion"
    if content_type.startswith("text/event-stream"):
        events = _events(text)
        assert events and (events[-1] == "[DONE]" or "error" in events[-1]), f"{where}: {events[-3:]}"
        if events[-1] != "[DONE]":
            err = assert_openai_error(events[-1], where)
            assert err["type"] != "server_error", f"{where}: the stream failed: {err}"
        for e in events[:-1]:
            assert e["object"] in (kind, f"{kind}.chunk"), f"{where}: {e}"
        return None
    body = json.loads(text)
    assert body["object"] == kind and len(body["choices"]) == 1, f"{where}: {body}"
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], f"{where}: {usage}"
    assert usage["completion_tokens"] <= MAX_RUN_TOKENS, f"{where}: {usage}"
    assert body["choices"][0]["finish_reason"] in ("length", "stop"), f"{where}: {body['choices']}"
    return None


class ServiceStopped(BaseException):
    """The services stopped serving: hypothesis lets a BaseException through at once, unshrunk
    (every later example would only time out)."""


def stop_if_wedged(where: str) -> None:
    """A request that got no answer in TIMEOUT_S: when the verifier behind the bridge no longer
    serves at all, end the test now (ServiceStopped is not shrunk by hypothesis) instead of timing
    out every example after it; the tests after it in this module then fail at once."""
    open_ = pb.VerifyOpen(
        request_id=f"probe-{uuid.uuid4().hex}",
        prompt_token_ids=[5, 6, 7],
        sampling=pb.SamplingParams(max_tokens=1),
        gamma=0,
    )
    try:
        with grpc.insecure_channel(STATE["verifier"].address) as channel:
            list(rpc.VerifierServiceStub(channel).Verify(iter([pb.VerifyRequest(open=open_)]), timeout=15))
    except grpc.RpcError as err:
        STATE["stopped"] = (
            f"{where}: no answer in {TIMEOUT_S} s, and the verifier no longer serves a plain 1-token "
            f"session ({err.code().name}); what the verifier and the gateway are doing:\n"
            + "\n".join(stall_report(svc) for svc in (STATE["verifier"], STATE["gateway"]))
        )
        raise ServiceStopped(STATE["stopped"]) from None


def _still_serving() -> None:
    if STATE.get("stopped"):
        raise ServiceStopped(f"the verifier stopped serving earlier in this module, after: {STATE['stopped']}")


def _post(url: str, data: str | bytes, where: str) -> requests.Response:
    _still_serving()
    try:
        return requests.post(url, data=data, headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
    except requests.Timeout:
        stop_if_wedged(where)
        raise


def _call(case: Any, seen: Counter[str]) -> dict[str, Any] | None:
    where = f"{case.method} {case.path} body={case.body!r}"[:3000]
    _still_serving()
    try:
        response = case.call(timeout=TIMEOUT_S)
    except requests.Timeout:
        stop_if_wedged(where)
        raise
    content_type = (response.headers.get("content-type") or [""])[0]  # schemathesis: name -> [values]
    seen[f"{response.status_code} {content_type.split(';')[0]}"] += 1
    return check_answer(case.method, case.path, response.status_code, content_type, response.text, where)


# ---------------------------------------------------------------------------- schemathesis


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_bridge_schema_fuzz(
    served_document: dict[str, Any], bridges: dict[str, str], path: str, mode: GenerationMode
) -> None:
    """Every request schemathesis generates from the served document, valid for it (positive)
    or not (negative), gets a 2xx or an OpenAI-shaped 4xx, never a 5xx."""
    operation = _schema(served_document, bridges[path])[path]["POST"]
    seen: Counter[str] = Counter()

    @settings(**FUZZ_SETTINGS)
    @given(case=operation.as_strategy(mode, hooks=_hooks()))
    def run(case: Any) -> None:
        _call(case, seen)

    run()
    print(f"POST {path} {mode.value}: {sum(seen.values())} requests, {dict(seen)}")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_bridge_contract_fuzz(
    served_document: dict[str, Any], bridges: dict[str, str], vocab_size: int, path: str
) -> None:
    """Requests valid field by field run: 200, or a 400 for a rule between fields (CONTRACT_400)."""
    operation = _schema(contract_document(served_document, vocab_size), bridges[path])[path]["POST"]
    seen: Counter[str] = Counter()

    @settings(**FUZZ_SETTINGS)
    @given(case=operation.as_strategy(GenerationMode.POSITIVE, hooks=_hooks()))
    def run(case: Any) -> None:
        err = _call(case, seen)
        if err is not None:
            assert err["param"] in CONTRACT_400[path], f"a valid request refused: {case.body!r}: {err}"

    run()
    print(f"POST {path} contract: {sum(seen.values())} requests, {dict(seen)}")
    assert sum(n for k, n in seen.items() if k.startswith("200 ")) >= sum(seen.values()) // 2, dict(seen)


@pytest.mark.parametrize("method, path", OPERATIONS)
def test_bridge_schema_coverage(
    served_document: dict[str, Any], bridges: dict[str, str], method: str, path: str
) -> None:
    """schemathesis' coverage phase on the served document (deterministic; a few hundred
    requests per generating route, nearly all answered 400 at once)."""
    schema = _schema(served_document, bridges[path])
    operation = schema[path][method]
    cases = list(
        schema.iter_coverage_cases(
            operation,
            generation_modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
            generation_config=schema.config.generation_for(operation=operation),
        )
    )
    assert cases
    seen: Counter[str] = Counter()
    for case in cases:
        if isinstance(case.body, dict):
            case.body = _bounded(HookContext(operation=operation), case.body)
        _call(case, seen)
    print(f"{method} {path} coverage: {sum(seen.values())} requests, {dict(seen)}")


# ---------------------------------------------------------------------------- raw JSON

# Values a JSON body can carry that the document does not describe: lone surrogates (\\u
# escapes that are not Unicode), NaN and Infinity literals (Python's json module reads them),
# integers past int32 and uint64, nested junk, the wrong type; and a few harmless values.
HOSTILE = st.one_of(
    st.sampled_from(["\ud800", "a\udfffb", "", "\x00", "x" * 10_000, "\u202e\ufeff", "ok"]),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 5e-324, 0.5]),
    st.sampled_from([-1, 0, 1, 2**31, -(2**31) - 1, 2**32, 2**63, 2**64, -(2**64), 10**40]),
    st.lists(st.sampled_from([-1, 2**31, 2**40, 10**30, 0, 5, 50_000]), max_size=4),
    st.lists(st.sampled_from(["\ud800", "", "ok"]), max_size=3),
    st.sampled_from([None, True, False, [], {}, [[]], {"a": {"b": [None]}}, {"\ud800": 1}, {"type": "\ud800"}]),
)
COMPLETION_FIELDS = [
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "echo",
    "n",
    "stream",
    "stream_options",
    "user",
    "request_id",
    "gamma",
    "drafter",
    "model",
    "response_format",
    "return_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "ignore_eos",
    "suffix",
    "min_p",
    "logit_bias",
    "\ud800",
]
CHAT_FIELDS = [
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "chat_template_kwargs",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "echo",
    "add_special_tokens",
    "tools",
    "chat_template",
    "temperature",
    "stop",
    "seed",
    "stream",
    "request_id",
    "user",
]
MESSAGES = st.one_of(
    HOSTILE,
    st.sampled_from(
        [
            [{"role": "user", "content": "\ud800"}],
            [{"role": "\ud800", "content": "hi"}],
            [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            [{"role": "user"}],
            [{"role": "assistant", "content": None}],
            [{"content": "no role"}],
            [{"role": "user", "content": "hi", "\ud800": 1}],
        ]
    ),
)


@st.composite
def raw_requests(draw: Any) -> tuple[str, str]:
    """A valid request with one to three fields set to HOSTILE values, as JSON text."""
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    if path == COMPLETIONS:
        body: dict[str, Any] = {"model": MODEL, "prompt": "def f(x):", "max_tokens": MAX_RUN_TOKENS, "temperature": 0}
        fields = COMPLETION_FIELDS
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": MAX_RUN_TOKENS}
        fields = CHAT_FIELDS
    for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        value = draw(MESSAGES if name == "messages" else HOSTILE)
        if name in ("max_tokens", "max_completion_tokens") and (value is None or isinstance(value, int)):
            value = (
                value if value is not None and (value <= MAX_RUN_TOKENS or value > MAX_MODEL_LEN) else MAX_RUN_TOKENS
            )
        body[name] = value
    # ensure_ascii: a lone surrogate goes out as a \\ud800 escape (valid JSON text, not Unicode)
    return path, json.dumps(body, allow_nan=True, ensure_ascii=True)


@settings(**FUZZ_SETTINGS)
@given(request_=raw_requests())
def test_bridge_raw_json_fuzz(bridges: dict[str, str], request_: tuple[str, str]) -> None:
    path, data = request_
    where = f"POST {path} {data[:2000]}"
    r = _post(bridges[path] + path, data, where)
    check_answer("POST", path, r.status_code, r.headers.get("content-type", ""), r.text, where)


@pytest.mark.parametrize(
    "path, data",
    [
        (COMPLETIONS, b'{"prompt": "x", "max_tokens": 4'),  # truncated JSON
        (COMPLETIONS, b"\xff\xfe not utf-8"),
        (COMPLETIONS, b"[]"),
        (COMPLETIONS, b"null"),
        (COMPLETIONS, b'"prompt"'),
        (COMPLETIONS, b'{"prompt": "\\ud800", "max_tokens": 4}'),
        (COMPLETIONS, b'{"prompt": [-1], "max_tokens": 4}'),
        (COMPLETIONS, b'{"prompt": [4294967296], "max_tokens": 4}'),
        (COMPLETIONS, b'{"prompt": [5, 6], "max_tokens": 4, "echo": true, "stop": ["\\udfff"]}'),
        (COMPLETIONS, b'{"prompt": "x", "max_tokens": 4, "temperature": NaN}'),
        (COMPLETIONS, b"{" * 5000 + b"}" * 5000),  # not JSON
        (COMPLETIONS, b'{"prompt": "x", "max_tokens": 4, "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),  # deep
        (CHAT, b"{}"),
        (CHAT, b'{"messages": []}'),
        (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "documents": [{"\\ud800": "x"}]}'),
        # the refused `chat_template`, passed to the template another way
        (
            CHAT,
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
            b'"chat_template_kwargs": {"chat_template": "{{ messages[0].content }}"}}',
        ),
    ],
)
def test_bridge_malformed_bodies(bridges: dict[str, str], path: str, data: bytes) -> None:
    r = requests.post(bridges[path] + path, data=data, headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
    check_answer("POST", path, r.status_code, r.headers.get("content-type", ""), r.text, f"POST {path} {data[:200]!r}")
    assert r.status_code == 400


@pytest.mark.parametrize(
    "method, path, headers, data",
    [
        ("GET", COMPLETIONS, {}, None),  # wrong method
        ("PUT", CHAT, {}, None),
        ("POST", "/v1/nowhere", {"content-type": "application/json"}, b"{}"),  # unknown route
        ("POST", COMPLETIONS, {"content-type": "text/plain"}, b'{"prompt": "x"}'),  # wrong content type
        ("POST", COMPLETIONS, {"content-type": "application/x-www-form-urlencoded"}, b"prompt=x"),
        ("POST", COMPLETIONS, {"content-type": "multipart/form-data; boundary=zz"}, b"--zz\r\nbroken"),
        ("POST", COMPLETIONS, {"content-type": "application/json"}, b"\x00\x00\x00\x00\x00"),
    ],
)
def test_bridge_http_errors_are_openai_shaped(
    bridges: dict[str, str], method: str, path: str, headers: dict[str, str], data: bytes | None
) -> None:
    r = requests.request(method, bridges[COMPLETIONS] + path, data=data, headers=headers, timeout=TIMEOUT_S)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert_openai_error(r.json(), f"{method} {path}")


# One value just outside what the bridge accepts, per field, on a valid request: 400 naming the
# field. The contract test's document stops at these bounds; this steps over each, once.
# temperature last: one above 2 (vLLM's bound) that got through would stop the verifier (reported).
OUT_OF_CONTRACT = [
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0),
    ("logprobs", 21),
    ("n", 2),
    ("gamma", MAX_GAMMA + 1),
    ("max_tokens", 0),
    ("max_tokens", MAX_MODEL_LEN),
    ("min_tokens", MAX_RUN_TOKENS + 1),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [10**6]),
    ("stop", [""]),
    ("prompt", []),
    ("prompt", [-1]),
    ("prompt", [""]),
    ("drafter", "bogus"),
    ("model", "other"),
    ("response_format", {"type": "json_object"}),
    ("temperature", -0.5),
    ("temperature", 2.5),
    ("temperature", 30.0),
    ("temperature", 1e300),
]


@pytest.mark.parametrize("field_name, value", OUT_OF_CONTRACT, ids=[f"{k}={v!r}"[:40] for k, v in OUT_OF_CONTRACT])
def test_bridge_refuses_each_out_of_contract_value(bridges: dict[str, str], field_name: str, value: Any) -> None:
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": MAX_RUN_TOKENS, "temperature": 0, field_name: value}
    where = f"POST {COMPLETIONS} {body}"
    r = _post(bridges[COMPLETIONS] + COMPLETIONS, json.dumps(body), where)
    err = check_answer("POST", COMPLETIONS, r.status_code, r.headers.get("content-type", ""), r.text, where)
    assert err is not None and r.status_code in (400, 404), f"{where}: accepted: {r.text[:300]}"
    assert err["param"] == field_name, f"{where}: {err}"


def test_bridge_still_serves_after_fuzzing(bridges: dict[str, str]) -> None:
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
    r = _post(f"{bridges[COMPLETIONS]}{COMPLETIONS}", json.dumps(body), "after the fuzzing")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    body = {"model": MODEL, "messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 4}
    r = _post(f"{bridges[CHAT]}{CHAT}", json.dumps(body), "after the fuzzing")
    assert r.status_code == 200, r.text
