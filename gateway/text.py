"""Incremental detokenisation with stop sequences, as vLLM's detokenizer does it."""

from __future__ import annotations

from typing import Any, TypeAlias

# A Hugging Face tokenizer (transformers' AutoTokenizer.from_pretrained, or a test's stand-in). Any at this
# one boundary: transformers types decode() as `str | list[str]` (batches) and encode() not at all, so each
# use types what it reads (a str from decode of one sequence, token ids from encode).
Tokenizer: TypeAlias = Any


class TextStream:
    """Turns verified token ids into text deltas, ending at the first stop sequence.

    Text that could still be the start of a stop sequence, or that ends in an
    incomplete UTF-8 character, is held back until the next tokens decide it.

    `include_stop`: keep the stop sequence that ended the text (vLLM's
    include_stop_str_in_output), and the text of a stop token (see `add`).
    `skip_special_tokens`: leave special tokens' text out (vLLM's default).
    """

    def __init__(
        self, tokenizer: Tokenizer, stops: list[str], include_stop: bool = False, skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    def add(self, token_ids: list[int], final: bool = False, stop_token: bool = False) -> str:
        """Append tokens; return the new text (empty when held back). `stop_token`: the last of
        `token_ids` is the end-of-sequence or stop token id that ended the generation; as in
        vLLM, its text is left out unless include_stop.

        When a stop sequence ends the text, `kept` says how many of `token_ids` the output
        keeps: up to the one that completes the stop sequence, as vLLM counts them (the
        target may have verified more in the same step). Otherwise all of them.
        """
        self.kept = len(token_ids)
        if stop_token and not self.include_stop:
            token_ids = token_ids[:-1]
        before = len(self.ids)
        self.ids.extend(token_ids)
        full = self._decode(self.ids)
        for stop in self.stops:
            at = full.find(stop)
            if at >= 0:
                full, self.stopped, final = full[: at + len(stop) if self.include_stop else at], True, True
        if self.stopped:
            self.kept = self._tokens_to_stop(before)
            del self.ids[before + self.kept :]
        # an incomplete UTF-8 character (U+FFFD at the end of everything decoded) waits for its
        # next bytes, and is never output if they do not come; once other text follows it (a
        # stop sequence included) it is final (vLLM's detokenizer does the same)
        hold = 0 if self.stopped else len(full) - len(full.rstrip("\ufffd"))
        if not final:
            for stop in self.stops:  # longest suffix of the text that begins a stop sequence
                for n in range(min(len(stop) - 1, len(full)), 0, -1):
                    if full.endswith(stop[:n]):
                        hold = max(hold, n)
                        break
        visible = full[: len(full) - hold]
        delta = visible[len(self.emitted) :] if visible.startswith(self.emitted) else ""
        self.emitted = visible if visible.startswith(self.emitted) else self.emitted
        return delta

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return text

    def _tokens_to_stop(self, before: int) -> int:
        """How many tokens after `before` the text needs to contain a stop sequence."""
        for n in range(before + 1, len(self.ids) + 1):
            text = self._decode(self.ids[:n])
            if any(stop in text for stop in self.stops):
                return n - before
        return len(self.ids) - before
