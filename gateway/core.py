"""The gateway core's typed API: what a generation yields and how it fails.

`GatewayCore.generate(spec, ...)` (gateway/server.py) is an async generator of `Chunk`s;
it raises `GatewayError` (code, field, message) for every refusal and failure. Two thin
adapters sit on it, in the same process and event loop:

    gRPC (GatewayServicer, gateway/server.py)   GatewayError -> status code + details (+ retry-after)
    REST (gateway/rest/, OpenAI's API)          GatewayError -> HTTP status + {"error": {..., "param"}}

so an error's field crosses as a field, never as text to parse back. The REST adapter
depends only on `Core` below (a fake core in a test or a benchmark fits it).

Terms:
    chunk        what one step of the generation gives the client: text (detokenised, stop
                 strings applied), its token ids, and the step's drafted / accepted counts
    final chunk  the one whose finish_reason is set; it carries the request's usage,
                 speculation stats and timings. Every generation that ends without an error
                 ends with one.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

from specdec.wire import pb


class ErrorCode(enum.Enum):
    """Why a generation failed: the canonical codes (google.rpc.Code), which gRPC uses as they
    are and which the REST adapter maps to HTTP statuses (gateway.rest.serving.HTTP_STATUS)."""

    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class GatewayError(Exception):
    """A refused or failed generation.

    code          what kind of failure (ErrorCode)
    message       what is wrong, for the client (names no backend address)
    field         the GenerationSpec field at fault as a path ("spec.sampling.top_p",
                  "spec.stop[1]"), or None when no field is
    retry_after_s when to retry, whole seconds (RESOURCE_EXHAUSTED), or None

    str() is "field: message" (the gRPC details), or the message alone."""

    def __init__(self, code: ErrorCode, message: str, field: str | None = None,
                 retry_after_s: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.code, self.message, self.field, self.retry_after_s = code, message, field, retry_after_s


@dataclass
class Chunk:
    """What one preview or verdict gives the client (see the module's terms)."""

    text: str
    token_ids: list[int]
    drafted: int
    accepted: int
    finish_reason: int  # pb.FinishReason; FINISH_REASON_UNSPECIFIED until the final chunk
    logprobs: list["pb.TokenLogprobs"] = field(default_factory=list)  # [len(token_ids)] when asked for
    request_id: str = ""
    # the final chunk's (None / 0 on the others):
    usage: "pb.Usage | None" = None
    stats: "pb.SpeculationStats | None" = None
    first_token_ms: float = 0.0  # after validation: to the first token
    total_ms: float = 0.0  # after validation: to the end


class Core(Protocol):
    """What an adapter needs of the gateway core (GatewayCore implements it)."""

    def generate(self, spec: "pb.GenerationSpec", *, authorization: str | None = None, parent: Any = None,
                 deadline_s: float | None = None, stream: bool = False) -> AsyncGenerator[Chunk, None]:
        """The generation's chunks; raises GatewayError. `authorization`: the caller's
        "Bearer <key>" (checked when API keys are configured); `parent`: an OpenTelemetry
        context to trace under; `deadline_s`: DEADLINE_EXCEEDED after that many seconds;
        `stream`: the caller streams the chunks (its first token is timed as such)."""
        ...

    def serving(self) -> bool:
        """False once the gateway drains (shutting down): new generations are refused."""
        ...
