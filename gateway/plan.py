"""A validated request, ready to run (`Plan`), and the namespace of an API key's requests."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.wire import pb

if TYPE_CHECKING:
    from specdec.v1.common_pb2 import SamplingParams


@dataclass
class Plan:
    """A validated request, ready to run.

    `request_id` is the client's (or one the gateway made up); `tenant` is the namespace of the
    API key that sent it (`tenant_of`), put before it on the verifier and drafter side
    (`backend_id`), so two keys' requests never share an id there."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    gamma: int
    drafter: pb.DraftMethod.ValueType  # MODEL, NGRAM or NONE
    tenant: str = ""

    @property
    def backend_id(self) -> str:
        """The id the verifier and the drafter know this request by: `<tenant>.<request_id>`."""
        return f"{self.tenant}.{self.request_id}" if self.tenant else self.request_id

    @property
    def uses_drafter(self) -> bool:
        """The plan speculates: gamma > 0 with a drafter method (else plain target decoding)."""
        return self.gamma > 0 and self.drafter != pb.DRAFT_METHOD_NONE


def tenant_of(key_id: str) -> str:
    """An API key's namespace for request ids at the verifier: `t` and 8 hex digits of the
    SHA-256 of its key id (the key id itself is already a hash of the key; "anonymous" without keys)."""
    return "t" + hashlib.sha256(key_id.encode()).hexdigest()[:8]
