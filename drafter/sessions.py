"""Draft sessions: one per generation, holding the drafter's view of the sequence.

Terms:
    context     committed tokens followed by the drafter's own not-yet-verified drafts
    committed   how many leading tokens of `context` the target has verified
    window      how far past `committed` the drafter may draft: gamma + lookahead.
                `lookahead` lets the drafter keep drafting while a block is verified.
    sent        tokens of `context` already sent to the caller in blocks
    prefill     feeding the prompt through the draft model, in chunks of `prefill_chunk`
                tokens, from `open` on: it runs while the target is queued and prefills,
                so the first draft needs one draft step after the first commit
    ready       the prefill is done; announced once (a `Ready`), before any block

A commit (position s, verified tokens T) makes the committed context
context[:s] + T. Drafts that agree with T are kept; at the first disagreement the
drafts are dropped and the model's KV cache is rolled back to the agreeing prefix,
never recomputed from scratch.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from specdec.acceptance import sparse_q, target_distribution


@dataclass
class Draft:
    """One drafted token: its id, q(token), and the sparse q it was sampled from (or None: one-hot)."""

    token_id: int
    prob: float
    support: tuple[list[int], list[float]] | None


@dataclass
class Ready:
    """The session's prompt is in the draft model's cache: it can draft from the first commit on."""

    prefilled_tokens: int
    prefill_ms: float


@dataclass
class BlockOut:
    """A block ready to send: drafts starting at `start_position`."""

    start_position: int
    drafts: list[Draft]
    draft_ms: float
    final: bool = False  # nothing more is drafted until the next commit
    committed_length: int = 0  # the committed context it was drafted from


class DraftSession:
    """Shared bookkeeping of a draft session; subclasses implement `_next_token`."""

    def __init__(
        self, prompt: list[int], gamma: int, lookahead: int, flush_ms: float = 50.0, prefill_chunk: int = 128
    ) -> None:
        self.context: list[int] = list(prompt)
        self.committed = len(prompt)
        self.sent = len(prompt)
        self.gamma = gamma
        self.lookahead = lookahead
        self.flush_ms = flush_ms
        self.prefill_chunk = prefill_chunk
        self.lock = threading.Lock()
        self.closed = False
        self.started = False  # drafting starts with the first commit (the target's first token)
        self.ready = False  # the prefill is done and announced
        self.prefill_ms = 0.0
        self.exhausted = False  # the method has nothing more to propose for this context
        self._pending: list[Draft] = []
        self._pending_since = 0.0
        self._pending_ms = 0.0
        self.steps = 0
        self.last_token_ms = 0.0  # compute time of the token the latest draft step drafted (0: none)
        # fault injection (tests, drills): sleep inject_delay_ms in every inject_every-th step
        self.inject_delay_ms = 0.0
        self.inject_every = 0

    @property
    def window(self) -> int:
        return self.gamma + self.lookahead

    def wants_work(self) -> bool:
        if self.closed:
            return False
        if not self.ready:
            return True  # the prefill, or just the `Ready` announcing it
        if not self.started:
            return False
        return not self.exhausted and len(self.context) - self.committed < self.window

    def urgent(self) -> bool:
        """Whether the verifier is (about to be) waiting for this session's drafts: the target
        has produced its first token (the session started) and fewer than gamma drafts lie past
        the committed context. A prefill before the first commit is not urgent: it overlaps the
        target's own prefill, and drafts other verifiers are waiting for come first."""
        return self.started and self.wants_work() and (not self.ready or len(self.context) - self.committed < self.gamma)

    def commit(self, start: int, tokens: list[int], gamma: int = 0) -> None:
        """Apply a target verdict: context[:start] + tokens is now verified."""
        with self.lock:
            self.started = True
            if gamma:
                self.gamma = gamma
            end = start + len(tokens)
            agree = 0
            while agree < len(tokens) and start + agree < len(self.context) and self.context[start + agree] == tokens[agree]:
                agree += 1
            if agree < len(tokens):
                keep = start + agree  # drafts past here are wrong
                self.context = self.context[:keep] + list(tokens[agree:])
                self._rollback(keep)
                self._pending.clear()
                self.sent = len(self.context)
            else:  # unsent drafts the target has now verified need not be sent
                covered = min(len(self._pending), max(0, end - self.sent))
                del self._pending[:covered]
                self.sent += covered
            self.committed = max(self.committed, end)
            self.sent = max(self.sent, self.committed)
            self.exhausted = False  # the context grew: the method may propose again

    def step(self) -> BlockOut | Ready | None:
        """One unit of work: a prefill chunk (a `Ready` after the last one), or one draft token
        (if the window allows) with a block when one is due."""
        with self.lock:
            if not self.ready:
                t0 = time.perf_counter()
                if self._needs_warmup():
                    self._warmup(self.prefill_chunk)
                self.prefill_ms += (time.perf_counter() - t0) * 1e3
                if self._needs_warmup():
                    return None
                self.ready = True
                return Ready(len(self.context), self.prefill_ms)
            if not self.wants_work():
                return self._flush(force=True)
            self.last_token_ms = 0.0
            t0 = time.perf_counter()
            draft = self._next_token()
            self.steps += 1
            if self.inject_every and self.steps % self.inject_every == 0:
                time.sleep(self.inject_delay_ms / 1e3)
            if draft is None:
                self.exhausted = True
                # an empty block tells the verifier not to wait for drafts at this position
                return self._flush(force=True) or BlockOut(self.sent, [], 0.0, True, self.committed)
            if not self._pending:
                self._pending_since = t0
                self._pending_ms = 0.0
            self.context.append(draft.token_id)
            self._pending.append(draft)
            step_s = time.perf_counter() - t0
            self.last_token_ms = step_s * 1e3
            self._pending_ms += step_s * 1e3
            return self._flush(force=not self.wants_work())

    def _flush(self, force: bool) -> BlockOut | None:
        """Send pending drafts when forced (nothing more to draft), at gamma of them, or
        when the first has waited flush_ms (a slow drafter streams token by token)."""
        if not self._pending:
            return None
        waited_ms = (time.perf_counter() - self._pending_since) * 1e3
        if not force and len(self._pending) < self.gamma and waited_ms < self.flush_ms:
            return None
        block = BlockOut(self.sent, self._pending, self._pending_ms, final=force, committed_length=self.committed)
        self.sent += len(self._pending)
        self._pending = []
        return block

    def _next_token(self) -> Draft | None:
        raise NotImplementedError

    def _needs_warmup(self) -> bool:
        """Whether there is work to do before the first commit (e.g. the prompt's KV cache)."""
        return False

    def _warmup(self, chunk: int) -> None:
        """Do up to `chunk` tokens of that work (it runs while the target prefills)."""

    def _rollback(self, keep: int) -> None:
        """Forget model state past the first `keep` tokens of the context."""

    def close(self) -> None:
        self.closed = True


class ModelDraftSession(DraftSession):
    """Drafts with a causal LM, keeping its KV cache across rounds.

    `cached` counts context tokens whose keys/values are in the cache; each step feeds
    only context[cached:] (one token in steady state, a few after a commit).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        prompt: list[int],
        gamma: int,
        lookahead: int,
        temperature: float,
        top_k: int,
        top_p: float,
        seed: int | None,
        q_top_k: int,
        prefill_chunk: int = 128,
    ) -> None:
        super().__init__(prompt, gamma, lookahead, prefill_chunk=prefill_chunk)
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache()
        self.cached = 0
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.q_top_k = q_top_k
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        self.forward_tokens = 0  # tokens run through the draft model (work counter)

    @torch.inference_mode()
    def _forward(self, upto: int) -> torch.Tensor:
        """Feed context[cached:upto] through the model; return the last position's logits [vocab]."""
        new = self.context[self.cached : upto]
        # [1, len(new)] -> logits [1, len(new), vocab]
        out = self.model(
            input_ids=torch.tensor([new], dtype=torch.long),
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.cached = upto
        self.forward_tokens += len(new)
        return out.logits[0, -1]

    def _needs_warmup(self) -> bool:
        return self.cached < len(self.context) - 1

    def _warmup(self, chunk: int) -> None:
        # the prompt's KV cache, all but the last token (fed with the first drafted step)
        self._forward(min(self.cached + max(1, chunk), len(self.context) - 1))

    @torch.inference_mode()
    def _next_token(self) -> Draft | None:
        logits = self._forward(len(self.context))  # [vocab]
        if self.temperature == 0:
            return Draft(int(logits.argmax()), 1.0, None)
        probs = target_distribution(logits, self.temperature, self.top_k, self.top_p)
        ids, q = sparse_q(probs, self.q_top_k)
        pick = int(torch.multinomial(q, 1, generator=self.generator))
        return Draft(int(ids[pick]), float(q[pick]), (ids.tolist(), q.tolist()))

    def _rollback(self, keep: int) -> None:
        if self.cached > keep:
            self.cache.crop(keep)
            self.cached = keep


class NgramDraftSession(DraftSession):
    """Model-free prompt lookup: propose what followed the latest earlier occurrence
    of the context's last n tokens (n from ngram_max down to ngram_min)."""

    def __init__(self, prompt: list[int], gamma: int, lookahead: int, ngram_max: int, ngram_min: int) -> None:
        super().__init__(prompt, gamma, lookahead)
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def _next_token(self) -> Draft | None:
        ctx = self.context
        for n in range(min(self.ngram_max, len(ctx) - 1), self.ngram_min - 1, -1):
            suffix = ctx[-n:]
            for start in range(len(ctx) - n - 1, -1, -1):
                if ctx[start : start + n] == suffix:
                    return Draft(ctx[start + n], 1.0, None)
        return None
