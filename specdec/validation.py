"""Request validation shared by the three services.

Every check raises `InvalidField(field, message)`; servers turn it into gRPC
INVALID_ARGUMENT with the message "<field>: <message>", so a client always learns
which field was wrong, and the service keeps serving.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from specdec.config import MAX_GAMMA_LIMIT, MAX_LOGPROBS

# ---- bounds on what a client may send (docs/security.md lists them with the tests that check them)

# Stop strings per request, and the longest one (characters). The gateway scans every stop string
# on every chunk it streams, so both bound its work per chunk (OpenAI allows 4 stop strings).
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
# stop_token_ids per request (each is also checked against the vocabulary).
MAX_STOP_TOKEN_IDS = 256
# allowed_token_ids per request (each is also checked against the vocabulary): room for any
# subset of a 150k-token vocabulary, about 1 MiB on the wire.
MAX_ALLOWED_TOKEN_IDS = 1 << 18
# A client's request id: at most this many characters, each one of REQUEST_ID_CHARS (no spaces,
# newlines or control characters: the id is written into logs and trace spans as it is).
MAX_REQUEST_ID_CHARS = 128
REQUEST_ID_CHARS = "A-Z a-z 0-9 . _ : -"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]+")
# Room the gateway adds to a client's id on the verifier and drafter side: its tenant prefix
# (`t<8 hex>.`) and a migration's `-m<N>` suffix.
BACKEND_REQUEST_ID_EXTRA = 32


class InvalidField(ValueError):
    """A request field failed validation."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class OverLimit(ValueError):
    """A well-formed request needs more than a server's setting allows (RESOURCE_EXHAUSTED);
    the message names the setting."""


def check_token_ids(field: str, ids: Sequence[int], vocab_size: int, allow_empty: bool = False) -> None:
    """Token ids must be non-empty (unless allowed) and lie in [0, vocab_size)."""
    if not ids and not allow_empty:
        raise InvalidField(field, "must not be empty")
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidField(field, f"token id {t} at index {i} is outside the vocabulary [0, {vocab_size})")


def check_request_id(field: str, request_id: str, limit: int = MAX_REQUEST_ID_CHARS) -> None:
    """A request id: 1 to `limit` characters from REQUEST_ID_CHARS."""
    if not request_id:
        raise InvalidField(field, "must not be empty")
    if len(request_id) > limit:
        raise InvalidField(field, f"{len(request_id)} characters, more than the {limit} allowed")
    if not _REQUEST_ID.fullmatch(request_id):
        bad = next(c for c in request_id if not _REQUEST_ID.fullmatch(c))
        raise InvalidField(field, f"character {bad!r} is not allowed (only {REQUEST_ID_CHARS})")


def check_gamma(field: str, gamma: int, max_gamma: int) -> None:
    if not 0 <= gamma <= min(max_gamma, MAX_GAMMA_LIMIT):
        raise InvalidField(field, f"{gamma} is out of range [0, {min(max_gamma, MAX_GAMMA_LIMIT)}]")


def check_sizes(field: str, sampling: Any) -> None:
    """The size bounds of a specdec.v1.SamplingParams, which need nothing of the model: stop
    strings (count, each non-empty and at most MAX_STOP_STRING_CHARS), stop_token_ids and
    allowed_token_ids (count)."""
    if len(sampling.stop) > MAX_STOP_STRINGS:
        raise InvalidField(
            f"{field}.stop", f"{len(sampling.stop)} stop strings, more than the {MAX_STOP_STRINGS} allowed"
        )
    for i, s in enumerate(sampling.stop):
        if not s:
            raise InvalidField(f"{field}.stop[{i}]", "must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidField(
                f"{field}.stop[{i}]", f"{len(s)} characters, more than the {MAX_STOP_STRING_CHARS} allowed"
            )
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidField(
            f"{field}.stop_token_ids", f"{len(sampling.stop_token_ids)} ids, more than the {MAX_STOP_TOKEN_IDS} allowed"
        )
    if len(sampling.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
        raise InvalidField(
            f"{field}.allowed_token_ids",
            f"{len(sampling.allowed_token_ids)} ids, more than the {MAX_ALLOWED_TOKEN_IDS} allowed",
        )


def check_sampling(
    field: str,
    sampling: Any,
    prompt_len: int | None = None,
    max_model_len: int | None = None,
    vocab_size: int | None = None,
) -> None:
    """Check a specdec.v1.SamplingParams; `max_tokens` must be set by the caller's defaults first.
    `vocab_size` bounds stop_token_ids and allowed_token_ids when given."""
    if not 0.0 <= sampling.temperature <= 2.0:  # vLLM's range (and OpenAI's); NaN fails it too
        raise InvalidField(f"{field}.temperature", f"{sampling.temperature} must be in [0, 2]")
    if sampling.HasField("top_p") and not 0.0 < sampling.top_p <= 1.0:
        raise InvalidField(f"{field}.top_p", f"{sampling.top_p} must be in (0, 1]")
    if sampling.top_k < -1:
        raise InvalidField(f"{field}.top_k", f"{sampling.top_k} must be -1, 0 (off) or positive")
    if not sampling.HasField("max_tokens"):
        raise InvalidField(f"{field}.max_tokens", "must be set")
    if sampling.max_tokens <= 0:
        raise InvalidField(f"{field}.max_tokens", f"{sampling.max_tokens} must be > 0")
    if prompt_len is not None and max_model_len is not None and prompt_len + sampling.max_tokens > max_model_len:
        raise InvalidField(
            f"{field}.max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's "
            f"context of {max_model_len} tokens",
        )
    check_sizes(field, sampling)
    for name in ("presence_penalty", "frequency_penalty"):  # vLLM's and OpenAI's range
        value = getattr(sampling, name)
        if not -2.0 <= value <= 2.0:
            raise InvalidField(f"{field}.{name}", f"{value} must be in [-2, 2]")
    if sampling.HasField("repetition_penalty") and not 0.0 < sampling.repetition_penalty <= 1e4:
        raise InvalidField(f"{field}.repetition_penalty", f"{sampling.repetition_penalty} must be > 0")
    if sampling.min_tokens > sampling.max_tokens:
        raise InvalidField(
            f"{field}.min_tokens", f"{sampling.min_tokens} must be <= max_tokens ({sampling.max_tokens})"
        )
    if vocab_size is not None:
        check_token_ids(f"{field}.stop_token_ids", sampling.stop_token_ids, vocab_size, allow_empty=True)
        check_token_ids(f"{field}.allowed_token_ids", sampling.allowed_token_ids, vocab_size, allow_empty=True)
    if sampling.HasField("logprobs") and sampling.logprobs > MAX_LOGPROBS:
        raise InvalidField(f"{field}.logprobs", f"{sampling.logprobs} is more than the {MAX_LOGPROBS} allowed")


# ---- draft blocks: a drafter is untrusted input (the gateway relays, the verifier defends) ----
#
# A correct drafter (drafter.sessions) sends blocks of at most gamma tokens, each starting at the
# committed context it drafted from or where its previous block ended, never more than
# gamma + lookahead past that context (lookahead defaults to gamma + 1), a few blocks per commit.
# The bounds below are several times that, so a correct drafter never meets them.

# Invalid blocks (or replies) a relay tolerates from one drafter session before treating the
# drafter as failed (it then ends the drafts and the generation goes on as plain decoding).
MAX_DRAFTER_VIOLATIONS = 3

# A drafter still prefilling reports its progress (DraftProgress) at most this often, each
# report with fewer queued tokens than the one before (drafter.server); a relay takes a report
# as the drafter's answer, so its drafter_timeout_s must exceed this plus one prefill chunk.
DRAFT_PROGRESS_INTERVAL_S = 1.0

# A duration a peer reports (ms) is used only when finite and within [0, this).
MAX_REPORTED_MS = 3.6e6


def draft_horizon(gamma: int) -> int:
    """How far past the committed context a draft may reach and still be kept: 4 gamma + 4.
    (A drafter drafts at most gamma + lookahead ahead; a target step verifies at most gamma.)"""
    return 4 * gamma + 4


# Branch blocks (DraftBlock.branch) a correct drafter sends per round: its `branches` setting
# (default 6); the verifier keeps at most 8 per request (verifier.proposer.MAX_BRANCHES).
MAX_BRANCH_BLOCKS = 16


def max_blocks_per_commit(gamma: int) -> int:
    """Blocks a drafter session may send between two commits: 2 (draft_horizon + MAX_BRANCH_BLOCKS).
    A correct one sends at most about gamma + lookahead + 1 chain blocks (one per drafted token
    when it streams, and an empty one) and its branches per round; blocks of the previous round
    still in flight when the commit goes out count toward the new one, hence the factor 2 (a
    fast drafter at gamma 1 with 6 branches was measured at 13 under load, over the old 4 gamma + 8)."""
    return 2 * (draft_horizon(gamma) + MAX_BRANCH_BLOCKS)


def reported_ms(ms: float) -> float:
    """A duration reported by a peer, or 0 when it is not a sane one (NaN, infinite, negative, huge)."""
    return ms if 0.0 <= ms < MAX_REPORTED_MS else 0.0  # NaN fails both comparisons


def bad_token_id(ids: Sequence[int], vocab_size: int) -> str:
    """'' when every id lies in [0, vocab_size) (vocab_size 0: unknown, only negatives are bad),
    else what is wrong with the first bad one."""
    for i, t in enumerate(ids):
        if t < 0 or (vocab_size and t >= vocab_size):
            where = f"[0, {vocab_size})" if vocab_size else "[0, vocab_size)"
            return f"token id {t} at index {i} is outside the vocabulary {where}"
    return ""


def check_draft_block(
    block: Any, gamma: int, vocab_size: int, prompt_len: int, committed: int, request_end: int
) -> tuple[list[int] | None, str]:
    """What a relay may pass on of a drafter's specdec.v1.DraftBlock, and what is wrong with it:
    (tokens to relay, None to drop the block; the violation, '' for none).

    `committed`: the context length the drafter has been told so far; `request_end`: prompt length
    + max_tokens. A block longer than gamma (a branch: gamma + 1) is trimmed (and is a violation); a block that
    starts inside the prompt, before the context it says it was drafted from, past the request's
    end by more than a drafter's window, or that claims a context it was never given, or has an id
    outside the vocabulary, is dropped. A block merely stale (the target moved on while it was
    drafted) is fine: the verifier keeps what is still ahead of its context."""
    start, drafted_from = block.start_position, block.committed_length
    if start < prompt_len:
        return None, f"block.start_position: {start} lies inside the prompt ({prompt_len} tokens)"
    if drafted_from > committed:
        return None, f"block.committed_length: {drafted_from} is past the {committed} tokens committed so far"
    if drafted_from and start < drafted_from:
        return None, f"block.start_position: {start} is before the context it was drafted from ({drafted_from} tokens)"
    horizon = draft_horizon(gamma)
    if start > request_end + horizon:
        return None, (
            f"block.start_position: {start} is more than {horizon} past the request's end ({request_end} tokens)"
        )
    ids = block.token_ids
    violation = ""
    most = gamma + 1 if block.branch else gamma  # a branch: its correction token, then gamma drafts
    if len(ids) > most:
        what = f"gamma + 1 ({most}) for a branch" if block.branch else f"gamma ({gamma})"
        violation = f"block.token_ids: {len(ids)} tokens, more than {what}; trimmed"
        ids = ids[:most]
    bad = bad_token_id(ids, vocab_size)
    if bad:
        return None, f"block.token_ids: {bad}"
    return list(ids), violation
