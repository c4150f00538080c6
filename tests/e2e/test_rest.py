"""The OpenAI-compatible REST bridge (gateway/rest/) on a real gateway core (its pools on the
session's drafter and verifier), driven by the official `openai` client."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from gateway.core import GatewayCore
from gateway.rest.routes import build_app
from specdec import telemetry
from specdec.config import GatewayConfig
from specdec.models import resolve
from specdec_cli.launch import free_port

MODEL = "tiny/target"
PROMPT = "def add(a, b):\n    return"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]


@contextmanager
def serve(make_app: Callable[[], Any]) -> Iterator[str]:
    """Serve the app `make_app()` makes (in uvicorn's event loop) with uvicorn on a free port in
    a background thread; yields the base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app, factory=True, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def tokenizer(chat_template: str | None = None) -> Any:
    tok = AutoTokenizer.from_pretrained(resolve(MODEL))
    tok.chat_template = chat_template  # the tiny tokenizer has none
    return tok


def bridge(services: Any, tok: Any, pair: str = "mid") -> Callable[[], Any]:
    """What makes a REST bridge on a GatewayCore of its own, on the drafter of the session's
    `pair` and its verifier, with the gateway's default settings; `tok` (the target's tokenizer)
    is the core's and renders chat templates.
    Made in the serving loop (the core's replica pools run there); the core closes with it."""

    def make() -> Any:
        cfg = GatewayConfig(
            tokenizer=MODEL,
            drafter_address=services.drafters[pair].address,
            verifier_address=services.verifier.address,
            rest_port=0,
            metrics_port=0,
        )
        core = GatewayCore(cfg, telemetry.GatewayMetrics(CollectorRegistry()), tok)
        app = build_app(core, tok, MODEL, tokenizer_executor=core.tokenizer_executor)

        @asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[None]:
            yield
            await core.close()

        app.router.lifespan_context = lifespan
        return app

    return make


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def base_url(services) -> Iterator[str]:
    with serve(bridge(services, tokenizer(CHAT_TEMPLATE))) as url:
        yield url


@pytest.fixture(scope="module")
def api(base_url: str) -> openai.OpenAI:
    return client(base_url)


def speculation(usage: Any) -> dict[str, Any]:
    return usage.model_extra["speculation"]


def test_completion_and_stream_agree(api: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"gamma": 4})
    full = api.completions.create(**kw)
    assert full.object == "text_completion" and full.model == MODEL and full.id
    (choice,) = full.choices
    assert choice.index == 0 and choice.finish_reason in ("length", "stop") and choice.logprobs is None
    u = full.usage
    assert 0 < u.completion_tokens <= 24 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    stats = speculation(u)
    assert stats["gamma"] == 4 and stats["drafter"] == "model" and stats["target_steps"] > 0

    chunks = list(api.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert all(c.object == "text_completion" and len(c.choices) == 1 and c.usage is None for c in body)
    assert "".join(c.choices[0].text for c in body) == choice.text  # greedy: token for token
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == [choice.finish_reason]
    assert last.choices == [] and last.usage.completion_tokens == u.completion_tokens
    assert speculation(last.usage)["gamma"] == 4


def test_completion_token_id_prompt_and_stop(api: openai.OpenAI) -> None:
    r = api.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    first = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    # the stop string: the printable character of the output whose first occurrence is latest,
    # so the stopped text is a non-empty, strict prefix (the premise is asserted, never skipped)
    firsts = {c: first.index(c) for c in set(first) if c.isprintable() and not c.isspace() and c != "\ufffd"}
    assert firsts, f"the premise: the greedy output has a printable character: {first!r}"
    stop = max(firsts, key=firsts.__getitem__)
    r = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == first[: first.index(stop)]


def test_chat_and_stream_agree(api: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    full = api.chat.completions.create(**kw)
    assert full.object == "chat.completion"
    (choice,) = full.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    assert full.usage.completion_tokens > 0 and "gamma" in speculation(full.usage)

    chunks = list(api.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert "".join(c.choices[0].delta.content or "" for c in body) == choice.message.content
    assert body[-1].choices[0].finish_reason == choice.finish_reason
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens


def test_models_and_health(api: openai.OpenAI, base_url: str) -> None:
    assert [(m.id, m.owned_by) for m in api.models.list().data] == [(MODEL, "specdec")]
    r = httpx.get(f"{base_url}/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.mark.parametrize("stream", [False, True])
def test_bad_top_p_names_the_field(api: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, top_p=1.5, stream=stream)
    assert info.value.body["param"] == "top_p" and info.value.body["type"] == "invalid_request_error"
    assert "top_p" in info.value.body["message"]


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"n": 2}, "n"),
        ({"extra_body": {"drafter": "bogus"}}, "drafter"),
        ({"extra_body": {"gamma": 99}}, "gamma"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"extra_body": {"allowed_token_ids": [5, 10**6]}}, "allowed_token_ids"),  # outside the vocabulary
        ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
    ],
)
def test_bad_requests_are_400(api: openai.OpenAI, kw: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(**{"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **kw})
    assert info.value.body["param"] == param, info.value.body


def test_chat_without_template_is_400(services) -> None:
    with serve(bridge(services, tokenizer())) as url:
        with pytest.raises(openai.BadRequestError, match="chat template"):
            client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)


def test_the_gateway_serves_the_bridge_and_metrics(services) -> None:
    """`specdec serve gateway` runs the bridge itself (port --rest-port), /metrics included."""
    gw = services.gateways["mid"]
    url = f"http://127.0.0.1:{gw.rest_port}"
    c = client(url)
    assert [m.id for m in c.models.list().data] == ["tiny/target"]
    done = c.completions.create(model="tiny/target", prompt="def f(x):", max_tokens=8, temperature=0.0)
    assert done.usage.completion_tokens == 8
    text = httpx.get(f"{url}/metrics/", timeout=10).text
    assert "specdec:spec_decode_num_drafts_total" in text
    assert 'specdec:build_info{service="gateway"' in text  # the gateway's registry: no drafter/verifier families
    assert "specdec:verifier_" not in text and "specdec:drafter_sessions" not in text
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
