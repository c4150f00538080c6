"""The REST bridge's routes: an OpenAI-compatible API (FastAPI) over a gateway core, at parity
with vLLM's server.

    POST /v1/completions        OpenAI completions (+ `gamma`, `drafter`)
    POST /v1/chat/completions   OpenAI chat completions (the tokenizer's chat template)
    GET  /v1/models             the one model served
    GET  /health                200 while the gateway serves, 503 once it drains
    /metrics                    the gateway's Prometheus metrics (when given)

The bridge is the core's second adapter (the gRPC servicer is the first): it calls
`GatewayCore.generate` in-process, in the same event loop (gateway.rest.serving), and the
core stays the one place that validates values: its GatewayError naming a GenerationSpec field
("spec.sampling.top_p") becomes a 400 whose `param` names the OpenAI field (`top_p`).
Requests and their refusals: gateway.rest.protocol. (vLLM's counterpart:
vllm/entrypoints/openai/api_server.py.)

The gateway serves it beside its gRPC server (gateway.server.rest_bridge):

    app = build_app(core, core.tokenizer, "qwen-coder/target")
    server = uvicorn.Server(uvicorn.Config(app, host="0.0.0.0", port=8000, log_level="warning"))
    asyncio.create_task(server.serve())
"""

from __future__ import annotations

from concurrent.futures import Executor, ThreadPoolExecutor
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.core import Core
from gateway.rest.protocol import APIError, ChatRequest, CompletionRequest, refuse_surrogates
from gateway.rest.serving import OpenAIServing
from gateway.text import Tokenizer
from specdec.security import KeyStore

DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # GatewayConfig.max_request_mb's default


def _validation_error(err: RequestValidationError) -> APIError:
    """FastAPI's 422 as OpenAI's 400; param is the top-level field."""
    first = err.errors()[0]
    loc = list(first.get("loc", ()))[1:]  # drop "body"
    param = loc[0] if loc and isinstance(loc[0], str) else None  # not the offset of a JSON syntax error
    where = ".".join(str(p) for p in loc) if param else ""
    return APIError(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param)


# ---------------------------------------------------------------------------- the guard


class Guard:
    """ASGI middleware in front of every route: the work a request may cause before it is known.

    - The API key first: a /v1 route (and /metrics with `metrics_auth`) without a known key is
      answered 401 from its headers alone; none of its body is read, nothing is parsed,
      tokenised or templated.
    - Then the body's size: over `max_body` bytes (a Content-Length over it, or a body that
      grows past it while it is read) is answered 413 without reading the rest.
    /health stays open. Each refusal is counted in `refused` (the gateway's
    `specdec:gateway_refused_total`, by reason), when given."""

    def __init__(
        self, app: ASGIApp, keys: KeyStore | None, max_body: int, metrics_auth: bool, refused: Counter | None = None
    ) -> None:
        self.app, self.keys, self.max_body, self.metrics_auth = app, keys, max_body, metrics_auth
        self.refused = refused

    def _count(self, reason: str) -> None:
        if self.refused is not None:
            self.refused.labels(reason).inc()

    def _needs_key(self, path: str) -> bool:
        if self.keys is None or not self.keys.enabled:
            return False
        return path.startswith("/v1/") or path == "/v1" or (self.metrics_auth and path.startswith("/metrics"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if (
            self._needs_key(scope["path"])
            and self.keys is not None  # (keys is set when _needs_key is true)
            and self.keys.identify(headers.get("authorization")) is None
        ):
            err = APIError(
                401,
                "missing or unknown API key: send `Authorization: Bearer <key>`",
                None,
                "authentication_error",
                "invalid_api_key",
                {"WWW-Authenticate": "Bearer"},
            )
            self._count("unauthenticated")
            await err.response()(scope, receive, send)
            return
        too_large = APIError(
            413,
            f"the request body is larger than max_request_mb ({self.max_body / (1 << 20):g} MiB)",
            None,
            "invalid_request_error",
            "request_too_large",
        )
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            self._count("request_too_large")
            await too_large.response()(scope, receive, send)
            return
        read = 0

        async def bounded_receive() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_body:  # a chunked body that grew past the cap: FastAPI passes it on
                    self._count("request_too_large")
                    raise HTTPException(413, too_large.message)
            return message

        await self.app(scope, bounded_receive, send)


# ---------------------------------------------------------------------------- app


def build_app(
    core: Core,
    tokenizer: Tokenizer,
    model_name: str,
    keys: KeyStore | None = None,
    metrics_auth: bool = False,
    metrics_app: ASGIApp | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tokenizer_executor: Executor | None = None,
    refused: Counter | None = None,
    stream_write_timeout_s: float = 0.0,
    stream_write_timeouts: Counter | None = None,
) -> FastAPI:
    """The REST bridge over `core` (a GatewayCore, called in-process). `tokenizer` (the
    target's) renders chat templates; `model_name` is the model id the API reports and accepts.

    API keys: `keys` (the gateway's KeyStore) is checked by `Guard` before any of a request's
    body is read, for every /v1 route, and for /metrics (`metrics_app`, mounted there) when
    `metrics_auth`; /health stays open. The `Authorization` header then goes to the core with
    the call, which checks it again and applies the key's rate limits (429 from there).
    Bodies over `max_request_bytes` are answered 413. Tokenising and chat templating run on
    `tokenizer_executor` (default: one thread of its own), never on the event loop that carries
    every stream. `refused`: the gateway's refusal counter (by reason), which counts the bridge's own
    401 and 413 answers too. A streamed answer's client must take each message within
    `stream_write_timeout_s` (0: no limit; EventStreamResponse), counted in
    `stream_write_timeouts`. A client's deadline header (DEADLINE_HEADERS) becomes the
    generation's deadline."""
    executor = tokenizer_executor or ThreadPoolExecutor(1, thread_name_prefix="rest-tokenizer")
    serving = OpenAIServing(core, tokenizer, model_name, executor, stream_write_timeout_s, stream_write_timeouts)

    app = FastAPI(title="specdec OpenAI-compatible API")
    app.add_middleware(Guard, keys=keys, max_body=max_request_bytes, metrics_auth=metrics_auth, refused=refused)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return _validation_error(err).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException) -> JSONResponse:
        """Starlette's own errors (404 unknown route, 405 method, 400 unparsable body) in
        OpenAI's shape too, as vLLM's server answers them."""
        phrase = HTTPStatus(err.status_code).phrase
        return APIError(
            err.status_code,
            f"{err.detail} ({request.method} {request.url.path})",
            code=phrase.lower().replace(" ", "_"),
            headers=dict(err.headers or {}),
        ).response()

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        refuse_surrogates(req)
        return await serving.completions(req, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        refuse_surrogates(req)
        return await serving.chat(req, request)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "specdec"}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        if core.serving():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "detail": "NOT_SERVING"}, status_code=503)

    if metrics_app is not None:
        app.mount("/metrics", metrics_app)  # behind Guard's key check when metrics_auth
    return app
