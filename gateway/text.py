"""Incremental detokenisation with stop sequences."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Turns verified token ids into text deltas, ending at the first stop sequence.

    Text that could still be the start of a stop sequence, or that ends in an
    incomplete UTF-8 character, is held back until the next tokens decide it.
    """

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the new text (empty when held back)."""
        self.ids.extend(token_ids)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hold = 0
        for stop in self.stops:
            at = full.find(stop)
            if at >= 0:
                full, self.stopped, final = full[:at], True, True
        if not final:
            if full.endswith("\ufffd"):
                hold = 1
            for stop in self.stops:  # longest suffix of the text that begins a stop sequence
                for n in range(min(len(stop) - 1, len(full)), 0, -1):
                    if full.endswith(stop[:n]):
                        hold = max(hold, n)
                        break
        visible = full[: len(full) - hold]
        delta = visible[len(self.emitted) :] if visible.startswith(self.emitted) else ""
        self.emitted = visible if visible.startswith(self.emitted) else self.emitted
        return delta
