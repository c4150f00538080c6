"""Batched drafting: one forward of the draft model advances every session that drafts a token.

The draft worker serves one model. In a step, each session that has a draft token to make
(drafter.sessions.ModelDraftSession) needs `new` = context[cached:] fed through the model:
one token in steady state, a few after a commit. `draft_step` runs all of them as ONE
forward, then lets each session pick its token from its own row's logits (greedy, or
sampled with its own torch.Generator), exactly as its serial `step` would.

Terms:
    row         one session in the batch; rows are ragged: row i feeds n_i new tokens after
                L_i cached ones (L_i = its `cached`)
    T           the longest n_i; rows are LEFT-padded to T, so every row's last real token
                sits at the last query slot and `logits_to_keep=1` gives each row its logits
    Lp          the longest L_i; the batch's keys are [row's cache, padded to Lp | the T new]

Each session keeps its own transformers DynamicCache (commit rolls it back with `crop`, branch
batches copy it, as in the serial path). For a batched forward, `_GatheredLayer` gathers the
rows' cached keys/values into a padded [B, heads, Lp + T, dim] tensor per layer; a 4D
additive mask hides each row's padding and its future, and explicit position_ids give each
row its own positions (RoPE is applied before the cache sees the keys). After the forward,
each row's real new keys/values are appended to its own cache. So rows join and leave
between steps freely: a step batches whichever sessions have work.

Not batched (stepped per session as before): prefill chunks (a prompt chunk is up to
`prefill_chunk` tokens: padding a batch of 1-token rows to it would waste the step), the
steps that only flush or resend a block, n-gram sessions, and branch batches (a session's
branches at one position are already one batched forward of their own).

Exactness: a row's logits equal the serial forward's up to float rounding (batched GEMMs
sum in another order). With `quantize int8` (torch dynamic quantisation) activations are
quantised per tensor, i.e. over the whole batch: batched drafts may then differ from the
serial ones (still valid drafts: the target verifies each, with the q the row sampled from).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from drafter.sessions import DRAFT_NEEDED, BlockOut, DraftSession, ModelDraftSession, Ready
from specdec.models.lean import PLAIN_ATTENTION_MODEL_TYPES, grouped_attention

StepResult = BlockOut | Ready | None


class _GatheredLayer(CacheLayerMixin):
    """One layer's keys/values for a batched step: the rows' own caches, padded to Lp, then
    the step's new keys/values (see the module's terms). Built per step, never kept."""

    is_croppable = False

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor] | None], padded: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers leaves CacheLayerMixin.__init__ unannotated
        self.past = past  # per row: (keys [1, heads, L_i, dim], values [1, heads, L_i, dim]) or None (L_i = 0)
        self.padded = padded  # Lp
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None  # the step's (keys, values) [B, heads, T, dim]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, heads, T, dim] -> [B, heads, Lp + T, dim]
        self.new = (key_states, value_states)
        b, heads, t, dim = key_states.shape
        keys = key_states.new_zeros(b, heads, self.padded + t, dim)
        values = value_states.new_zeros(b, heads, self.padded + t, dim)
        for i, kv in enumerate(self.past):
            if kv is not None:
                n = kv[0].shape[-2]
                keys[i, :, :n] = kv[0][0]
                values[i, :, :n] = kv[1][0]
        keys[:, :, self.padded :] = key_states
        values[:, :, self.padded :] = value_states
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.padded + query_length, 0

    def get_seq_length(self) -> int:
        return self.padded

    def get_max_length(self) -> int:
        return -1


def _rows_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention for a batched step, in plain matrix products with the query heads grouped by
    their KV head (grouped-query attention without repeating the keys). transformers' sdpa
    repeats each KV head whenever a mask is given on the CPU, and torch's CPU flash kernel
    with a mask and one query per row was about 2x slower than this at 16 rows (Qwen2.5-0.5B
    shapes: 14 heads, 2 KV heads; docs/batched-drafting.md)."""
    # query [B, heads, T, dim]; key, value [B, kv heads, S, dim]; attention_mask [B, 1, T, S] additive
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = grouped_attention(query, key, value, attention_mask, scale)  # [B, heads, T, dim]
    return out.transpose(1, 2).contiguous(), None  # [B, T, heads, dim]


ROWS_ATTENTION = "specdec_rows"
AttentionInterface.register(ROWS_ATTENTION, _rows_attention)


def _layer_kv(session: ModelDraftSession, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A session's cached (keys, values) [1, heads, cached, dim] at `layer`; None when empty."""
    layers = session.cache.layers
    if layer >= len(layers):
        return None
    found = layers[layer]
    assert isinstance(found, CacheLayerMixin)  # a DynamicCache's layers (no linear-attention ones)
    if not found.is_initialized or found.get_seq_length() == 0 or found.keys is None or found.values is None:
        return None
    return found.keys, found.values


@torch.inference_mode()
def forward_rows(model: torch.nn.Module, sessions: Sequence[ModelDraftSession]) -> torch.Tensor:
    """Feed each session's context[cached:] through `model` in one forward; append the new
    keys/values to each session's cache (its `cached` becomes len(context)). Returns the
    logits of each row's last token [B, vocab]. The caller holds every session's lock."""
    device = sessions[0].device
    news = [s.context[s.cached :] for s in sessions]
    lengths = [s.cached for s in sessions]
    if any(not n for n in news):
        raise ValueError("forward_rows: a row has no new token to feed")
    t = max(len(n) for n in news)
    padded = max(lengths)
    config: Any = model.config  # a transformers PretrainedConfig
    n_layers = int(config.num_hidden_layers)
    ids = torch.zeros(len(sessions), t, dtype=torch.long)  # [B, T], left-padded
    positions = torch.zeros(len(sessions), t, dtype=torch.long)  # [B, T]
    allowed = torch.zeros(len(sessions), t, padded + t, dtype=torch.bool)  # [B, T, Lp + T]
    causal = torch.ones(t, t, dtype=torch.bool).tril()  # [T, T]: query slot s sees new slots <= s
    for i, (new, cached) in enumerate(zip(news, lengths)):
        pad = t - len(new)
        ids[i, pad:] = torch.tensor(new, dtype=torch.long)
        positions[i, pad:] = torch.arange(cached, cached + len(new))
        positions[i, :pad] = cached  # padding queries: any position (their outputs are dropped)
        allowed[i, :, :cached] = True  # the row's own cache
        allowed[i, :, padded:] = causal
        allowed[i, pad:, padded : padded + pad] = False  # real queries never see the padding slots
    dtype = getattr(model, "dtype", torch.float32)  # the activations' dtype (int8-quantised Linears keep float32)
    if not dtype.is_floating_point:
        dtype = torch.float32
    # additive mask [B, 1, T, Lp + T]: 0 where a query may attend, the dtype's min elsewhere
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
    cache = Cache(layers=[_GatheredLayer([_layer_kv(s, layer) for s in sessions], padded) for layer in range(n_layers)])
    attention = config._attn_implementation
    # the same attention, faster for a batched step (_rows_attention), for the model types whose
    # attention is plain scaled dot-product (no soft-capping, sinks or sliding window); others keep their own
    if attention in ("sdpa", "eager") and getattr(config, "model_type", "") in PLAIN_ATTENTION_MODEL_TYPES:
        config._attn_implementation = ROWS_ATTENTION
    try:
        out = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    finally:
        config._attn_implementation = attention
    for i, (s, new) in enumerate(zip(sessions, news)):
        for layer, gathered in enumerate(cache.layers):
            assert isinstance(gathered, _GatheredLayer) and gathered.new is not None
            keys, values = gathered.new  # [B, heads, T, dim]
            s.cache.update(keys[i : i + 1, :, t - len(new) :], values[i : i + 1, :, t - len(new) :], layer)
        s.cached = len(s.context)
        s.forward_tokens += len(new)
    logits: torch.Tensor = out.logits  # [B, T, vocab]
    return logits[:, -1]  # [B, vocab]


def batchable(model: torch.nn.Module) -> bool:
    """Whether `forward_rows` applies to `model`: a decoder whose layers all use full
    attention (a sliding-window layer would need its own mask)."""
    types = getattr(model.config, "layer_types", None) or ["full_attention"]
    return all(t == "full_attention" for t in types) and not getattr(model.config, "use_sliding_window", False)


def draft_step(
    sessions: Sequence[DraftSession], on_forward: Callable[[int], None] | None = None
) -> list[tuple[StepResult, BaseException | None]]:
    """One step of each session, as `session.step()` would do it, with the model sessions
    that draft a token batched into one forward per model. Returns, per session in order,
    (its step's result, None) or (None, the exception that failed it).

    `on_forward(rows)` is called after each forward of the draft model that drafted tokens:
    a batched forward with its rows, a model session's own forward with 1 (what the drafter's
    `specdec:drafter_batch_rows` histogram observes). n-gram sessions make no forward."""
    results: list[tuple[StepResult, BaseException | None]] = [(None, None)] * len(sessions)
    with contextlib.ExitStack() as locks:
        rows: dict[int, list[int]] = {}  # id(model) -> indices of the sessions that draft with it
        for i, s in enumerate(sessions):
            locks.enter_context(s.lock)
            try:
                first = s.step_begin_locked()
            except Exception as exc:  # noqa: BLE001 - handed to the worker, which removes the session
                results[i] = (None, exc)
                continue
            if first is not DRAFT_NEEDED:
                results[i] = (first, None)
            elif isinstance(s, ModelDraftSession) and batchable(s.model):
                rows.setdefault(id(s.model), []).append(i)
            else:
                try:
                    results[i] = (s.step_draft_locked(time.perf_counter()), None)
                except Exception as exc:  # noqa: BLE001
                    results[i] = (None, exc)
                    continue
                if on_forward is not None and isinstance(s, ModelDraftSession):
                    on_forward(1)
        for members in rows.values():
            if len(members) == 1:  # a batch of one: the serial step itself (no mask, no gather)
                i = members[0]
                try:
                    results[i] = (sessions[i].step_draft_locked(time.perf_counter()), None)
                except Exception as exc:  # noqa: BLE001
                    results[i] = (None, exc)
                    continue
                if on_forward is not None:
                    on_forward(1)
                continue
            batch = [s for i in members if isinstance(s := sessions[i], ModelDraftSession)]
            assert len(batch) == len(members)
            t0 = time.perf_counter()
            done: set[int] = set()
            try:
                logits = forward_rows(batch[0].model, batch)
                share_ms = (time.perf_counter() - t0) * 1e3 / len(batch)  # each row's share of the forward
                if on_forward is not None:
                    on_forward(len(batch))
                for row, (i, s) in enumerate(zip(members, batch)):
                    assert isinstance(s, ModelDraftSession)
                    results[i] = (s.step_draft_locked(t0, s.pick_locked(logits[row]), share_ms), None)
                    done.add(i)
            except Exception as exc:  # noqa: BLE001 - the forward failed: every row's step did
                for i in members:
                    if i not in done:
                        results[i] = (None, exc)
    return results
