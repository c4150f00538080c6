"""The drafter's prefix cache: the draft model's keys/values of finished sessions, reused by
new sessions whose prompt starts with the same tokens.

A chat's next turn resends the whole conversation, an editor's next completion the same file,
an agent its growing transcript. The target's vLLM engine computes such a shared prefix once
(its prefix cache); a drafter without one prefilled it again for every request, and a request
whose prompt the drafter was still prefilling decoded without drafts: on the qwen-coder pair,
one core each, the second request for the same 6,000-token prompt got its target prefix from
vLLM's cache in ~3 s, and no draft in 64 tokens (docs/performance.md, "The drafter's prefix
cache"). With this cache a new session copies the matching keys/values (one memory copy, on
the drafter's worker thread, where its prefill would have run) and prefills only the rest.

Terms:
    entry     a finished session's context[:cached] (the prompt, the verified tokens and any
              drafts past them: the tokens whose keys/values its cache holds) and those
              keys/values, one (keys, values) pair per layer, [1, kv heads, >= len, dim];
              they are views of the session's own buffers, which nothing writes to any more
    match     the longest common prefix of a new prompt and an entry's tokens, at most the
              prompt's length - 1 (a session feeds the prompt's last token with its first
              draft step); reused when at least `min_tokens` long
    budget    bytes the entries' buffers hold at most; storing evicts the least recently used
              (stored or matched) entries first. An entry whose tokens begin another's is
              dropped: the longer one answers every match it would.
    scope     DraftOpen.cache_scope (the gateway sends its API key's tenant): a session matches
              only entries and sessions of its own scope, so the reused count (DraftReady) and
              the drafts' timing tell no tenant what another's prompts start with

The keys/values depend only on the draft model and the tokens (not on a request's sampling),
so any session's entry serves any later prompt. Prefilled in other chunks, they may differ in
the last float bits from a fresh prefill's: drafts, never the output, can differ.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Shortest match worth reusing (tokens): below it, the copy and the bookkeeping save little.
MIN_REUSE_TOKENS = 32

LayerKV = tuple[torch.Tensor, torch.Tensor]  # (keys, values), [1, kv heads, length, dim] each


@dataclass(frozen=True)
class Prefix:
    """A match: the first `tokens` tokens of a prompt, and their keys/values per layer
    ([1, kv heads, >= tokens, dim]: read the first `tokens` slots; never write to them)."""

    tokens: int
    layers: list[LayerKV]


@dataclass
class _Entry:
    tokens: np.ndarray  # [length] int64
    layers: list[LayerKV]
    nbytes: int  # of the buffers the layers are views of
    scope: str  # DraftOpen.cache_scope of the session it came from


def _buffer_bytes(layers: list[LayerKV]) -> int:
    """Bytes of the storage behind `layers`: what keeping the views alive holds."""
    return sum(t.untyped_storage().nbytes() for kv in layers for t in kv)


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    """Entries of finished sessions within `budget_bytes` (see the module's terms); safe to call
    from any thread. `budget_bytes` 0: off (stores nothing, matches nothing)."""

    def __init__(self, budget_bytes: int, min_tokens: int = MIN_REUSE_TOKENS) -> None:
        self.budget_bytes = budget_bytes
        self.min_tokens = max(1, min_tokens)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next_key = 0
        self._lock = threading.Lock()
        self.held_bytes = 0  # of the entries' buffers

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def lookup(self, prompt: Sequence[int] | np.ndarray, scope: str = "") -> Prefix | None:
        """The longest match for `prompt` among the entries of `scope` (module's terms), or None
        when none reaches min_tokens."""
        most = len(prompt) - 1
        if self.budget_bytes <= 0 or most < self.min_tokens:
            return None
        want = np.asarray(prompt[:most], dtype=np.int64)
        with self._lock:
            best, best_key = 0, -1
            for key, entry in self._entries.items():
                if entry.scope != scope:
                    continue
                n = common_prefix(entry.tokens, want)
                if n > best:
                    best, best_key = n, key
            if best < self.min_tokens:
                return None
            self._entries.move_to_end(best_key)  # recently used
            return Prefix(best, self._entries[best_key].layers)

    def store(self, tokens: Sequence[int], layers: list[LayerKV], scope: str = "") -> bool:
        """Keep `layers` (per layer, keys/values of `tokens`, [1, kv heads, >= len(tokens), dim],
        views that nothing writes to any more) as an entry of `scope`; whether it was kept. Not
        kept: fewer than min_tokens tokens, over the whole budget, or the tokens begin an entry of
        the scope already held (that entry is then the most recently used)."""
        if self.budget_bytes <= 0 or len(tokens) < self.min_tokens or not layers:
            return False
        new = _Entry(np.asarray(tokens, dtype=np.int64), [(k, v) for k, v in layers], _buffer_bytes(layers), scope)
        if new.nbytes > self.budget_bytes:
            return False
        with self._lock:
            for key, entry in list(self._entries.items()):
                if entry.scope != scope:
                    continue
                n = common_prefix(entry.tokens, new.tokens)
                if n == len(new.tokens):  # held already (as the start of this entry)
                    self._entries.move_to_end(key)
                    return False
                if n == len(entry.tokens):  # the new entry answers every match this one would
                    self._drop(key)
            self._entries[self._next_key] = new
            self._next_key += 1
            self.held_bytes += new.nbytes
            while self.held_bytes > self.budget_bytes:
                self._drop(next(iter(self._entries)))
            return True

    def _drop(self, key: int) -> None:
        self.held_bytes -= self._entries.pop(key).nbytes
