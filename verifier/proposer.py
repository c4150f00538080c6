"""External drafts into vLLM: the draft board and the `custom_class` proposer.

vLLM's V1 engine calls `ExternalDraftProposer.propose` at the end of every step, for
the next step. It must never wait: it returns, for each row of the batch, the draft
tokens that are already on the board and consistent with that row's current context,
else []. vLLM then verifies them in its next step with its own scheduler, KV cache
(no recompute of verified tokens) and rejection sampler (one-hot q, which is exact).

Terms:
    chain      per request, the draft tokens received so far: chain[i] is the drafter's
               token for position chain_start + i
    proposal   the tokens handed to vLLM for a context of length L: chain[L - chain_start:]
               (at most gamma), valid only when the chain agrees with the context up to L
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class _Entry:
    gamma: int
    prompt_len: int
    max_tokens: int
    chain_start: int = 0
    chain: list[int] = field(default_factory=list)
    # context length -> tokens proposed for it (read back when the verdict arrives)
    proposals: dict[int, list[int]] = field(default_factory=dict)


class DraftBoard:
    """Thread-safe drafts by engine request id, shared by the gRPC side and the proposer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self.max_model_len = 1 << 30

    def register(self, req_id: str, gamma: int, prompt_len: int, max_tokens: int) -> None:
        with self._lock:
            self._entries[req_id] = _Entry(gamma, prompt_len, max_tokens)

    def unregister(self, req_id: str) -> None:
        with self._lock:
            self._entries.pop(req_id, None)

    def offer(self, req_id: str, start: int, tokens: list[int]) -> None:
        """Add a block: it extends the chain when contiguous, else replaces it (a re-draft)."""
        with self._lock:
            e = self._entries.get(req_id)
            if e is None or e.gamma == 0:
                return
            if e.chain and start == e.chain_start + len(e.chain):
                e.chain.extend(tokens)
            elif e.chain and e.chain_start <= start < e.chain_start + len(e.chain):
                del e.chain[start - e.chain_start :]
                e.chain.extend(tokens)
            else:
                e.chain_start, e.chain = start, list(tokens)

    def propose(self, req_id: str, context: np.ndarray, k_max: int) -> list[int]:
        """Drafts for a request whose context (prompt + generated) is `context` [L]."""
        with self._lock:
            e = self._entries.get(req_id)
            if e is None or not e.chain:
                return []
            length = len(context)
            offset = length - e.chain_start
            if offset < 0 or offset >= len(e.chain):
                if offset >= len(e.chain):
                    e.chain = []
                return []
            if offset and not np.array_equal(context[e.chain_start : length], e.chain[:offset]):
                e.chain = []  # the target disagreed: wait for the drafter's re-draft
                return []
            # drop what is now verified context
            del e.chain[:offset]
            e.chain_start = length
            remaining = e.prompt_len + e.max_tokens - length - 1  # tokens still to come after the bonus
            room = self.max_model_len - length - 1
            n = max(0, min(e.gamma, k_max, remaining, room, len(e.chain)))
            drafts = e.chain[:n]
            if drafts:
                e.proposals[length] = drafts
            return drafts

    def take_proposal(self, req_id: str, length: int) -> list[int]:
        """The drafts proposed when the context had `length` tokens (forgotten after)."""
        with self._lock:
            e = self._entries.get(req_id)
            if e is None:
                return []
            stale = [k for k in e.proposals if k < length]
            for k in stale:
                del e.proposals[k]
            return e.proposals.pop(length, [])


BOARD = DraftBoard()


def _find_runner() -> Any:
    """The model runner that is constructing us (vLLM passes only vllm_config)."""
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if candidate is not None and type(candidate).__name__.endswith("ModelRunner"):
            return candidate
        frame = frame.f_back
    raise RuntimeError("ExternalDraftProposer must be built by a vLLM model runner")


class ExternalDraftProposer:
    """vLLM `custom_class` proposer reading drafts from `BOARD` (engine must run in-process)."""

    def __init__(self, vllm_config: Any) -> None:
        self.k_max = int(vllm_config.speculative_config.num_speculative_tokens)
        self.runner = _find_runner()
        self.board = BOARD

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the drafts come from the drafter service."""

    def propose(
        self,
        # [batch_size][tokens sampled this step]; empty for a partial prefill chunk
        sampled_token_ids: list[list[int]],
        # [max_num_reqs]: context length of each row
        num_tokens_no_spec: np.ndarray,
        # [max_num_reqs, max_model_len]: each row's token ids
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
        **kwargs: Any,
    ) -> list[list[int]]:
        req_ids = self.runner.input_batch.req_ids
        drafts: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:
                drafts.append([])
                continue
            length = int(num_tokens_no_spec[row])
            drafts.append(self.board.propose(req_ids[row], token_ids_cpu[row, :length], self.k_max))
        return drafts
