"""Whether a draft model fits a target: their vocabularies and special tokens, checked where
the parts meet (`specdec up`, a drafter started with `--target`, and the gateway when it meets
a verifier or a drafter, through GetVerifierInfo / GetDrafterInfo's `vocabulary`).

Terms:
    vocabulary     what a model's tokenizer maps tokens to: `tokenizer_size` ids (added tokens
                   included), identified by `fingerprint`, the sha256 of its sorted token -> id
                   map. Two models share a vocabulary when their fingerprints are equal.
    embedding rows `vocab_size` of the model's config: the rows of its embedding and output
                   layers, at least tokenizer_size. Rows past tokenizer_size are padding
                   (Qwen2.5-7B has 152064 rows, Qwen2.5-0.5B 151936, one tokenizer of 151665).
    special ids    BOS, EOS and pad of the tokenizer: the ids a request starts with, stops at
                   and pads with; they must be the same ids in both models.

The rule (`mismatch`): the fingerprints must be equal, the special ids equal, and each model
must have a row for every token (rows >= tokenizer_size). Different padding is accepted: the
drafter never proposes a padding id (it drafts among its tokenizer's ids only, see
drafter.sessions.ModelDraftSession), so every draft lies in the target's vocabulary. vLLM's own
`draft_model` method refuses different row counts unless `use_heterogeneous_vocab` is set
(`vllm/config/speculative.py: verify_equal_vocab_size_if_draft_model`); there the drafter runs
inside the engine and indexes the target's rows directly, here only token ids cross.
The n-gram drafter has no model and no vocabulary of its own: it is never checked.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.errors import UserError

SPECIALS = ("bos", "eos", "pad")


@dataclass(frozen=True)
class Vocabulary:
    """One model's vocabulary facts (see module docstring); `vocab_size` 0: no model (a gateway's
    tokenizer), so no rows to check."""

    model: str  # the reference it was loaded from, for messages
    vocab_size: int
    tokenizer_size: int
    fingerprint: str
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


class IncompatibleModels(UserError):
    """A draft (or a gateway's tokenizer) whose vocabulary does not fit the target's."""


def fingerprint(tokenizer: Any) -> str:
    """sha256 (hex, first 16 digits) of the tokenizer's token -> id map, added tokens included."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def from_tokenizer(tokenizer: Any, model: str, vocab_size: int = 0) -> Vocabulary:
    """The facts of a loaded tokenizer; `vocab_size` the model's embedding rows (0: no model)."""
    return Vocabulary(
        model=model,
        vocab_size=int(vocab_size),
        tokenizer_size=len(tokenizer),
        fingerprint=fingerprint(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def from_folder(folder: Path, model: str, with_rows: bool = True) -> Vocabulary:
    """The facts of the checkpoint in `folder` (its tokenizer, and its config's vocab_size when
    `with_rows`); `model` names it in messages."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = 0
    if with_rows:
        config = AutoConfig.from_pretrained(folder)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        rows = int(getattr(text, "vocab_size", 0) or 0)
    return from_tokenizer(tokenizer, model, rows)


def mismatch(target: Vocabulary, draft: Vocabulary, draft_role: str = "draft") -> str | None:
    """None when `draft` fits `target`; else one line naming both models and the difference.
    `draft_role` names the other part in the line ("draft", "gateway tokenizer")."""
    head = f"{draft_role} {draft.model!r} does not fit target {target.model!r}"
    if target.fingerprint != draft.fingerprint:
        sizes = (
            f"{target.tokenizer_size} tokens each"
            if target.tokenizer_size == draft.tokenizer_size
            else f"{target.tokenizer_size} vs {draft.tokenizer_size} tokens"
        )
        return (
            f"{head}: different vocabularies ({sizes}; tokenizer fingerprints {target.fingerprint} vs "
            f"{draft.fingerprint})"
        )
    for name in SPECIALS:
        t, d = getattr(target, f"{name}_token_id"), getattr(draft, f"{name}_token_id")
        if t != d:
            return f"{head}: {name.upper()} token id {t} vs {d}"
    for facts in (target, draft):
        if facts.vocab_size and facts.vocab_size < facts.tokenizer_size:
            return f"{head}: {facts.model!r} has {facts.vocab_size} embedding rows for {facts.tokenizer_size} tokens"
    return None


def check(target: Vocabulary, draft: Vocabulary, draft_role: str = "draft") -> None:
    """Raise IncompatibleModels with `mismatch`'s line unless `draft` fits `target`."""
    line = mismatch(target, draft, draft_role)
    if line:
        raise IncompatibleModels(
            line, "serve a draft made for this target (same tokenizer), or the n-gram drafter, which needs no model"
        )


def to_pb(facts: Vocabulary) -> Any:
    """The wire form (specdec.v1.Vocabulary) of `facts`."""
    from specdec.wire import pb

    msg = pb.Vocabulary(vocab_size=facts.vocab_size, tokenizer_size=facts.tokenizer_size, fingerprint=facts.fingerprint)
    for name in SPECIALS:
        value = getattr(facts, f"{name}_token_id")
        if value is not None:
            setattr(msg, f"{name}_token_id", value)
    return msg


def from_pb(msg: Any, model: str) -> Vocabulary | None:
    """`facts` from a specdec.v1.Vocabulary; None when the peer sent none (an older peer, or no
    model: nothing to check)."""
    if not msg.fingerprint:
        return None
    return Vocabulary(
        model=model,
        vocab_size=msg.vocab_size,
        tokenizer_size=msg.tokenizer_size,
        fingerprint=msg.fingerprint,
        **{f"{n}_token_id": getattr(msg, f"{n}_token_id") if msg.HasField(f"{n}_token_id") else None for n in SPECIALS},
    )
