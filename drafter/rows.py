"""One forward of the draft model over ragged rows, each with its own keys/values.

Terms:
    row         one sequence in the forward (`Row`); rows are ragged: row i feeds n_i new tokens
                after L_i cached ones (its `past`)
    T           the longest n_i; rows are LEFT-padded to T, so every row's last real token
                sits at the last query slot and `logits_to_keep=1` gives each row its logits
    Lp          the longest L_i; the batch's keys are [row's cache, padded to Lp | the T new]

`_GatheredLayer` gathers the rows' cached keys/values (each row's `segments`, in position
order) into a padded [B, heads, Lp + T, dim] tensor per layer; a 4D additive mask hides each
row's padding and its future, and explicit position_ids give each row its own positions (RoPE
is applied before the cache sees the keys). After the forward, each row's real new
keys/values are appended to its own `cache`. A row is a draft session (drafter.batch) or a
branch (drafter.sessions, "branch": its session's cache up to the branch's position, then its
own keys/values, two segments). This module knows neither.

Exactness: a row's logits equal the serial forward's up to float rounding (batched GEMMs
sum in another order). With `quantize int8` (torch dynamic quantisation) activations are
quantised per tensor, i.e. over the whole batch: batched drafts may then differ from the
serial ones (still valid drafts: the target verifies each, with the q the row sampled from).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.models.lean import PLAIN_ATTENTION_MODEL_TYPES, grouped_attention


class _GatheredLayer(CacheLayerMixin):
    """One layer's keys/values for a batched step: the rows' own caches, padded to Lp, then
    the step's new keys/values (see the module's terms). Built per step, never kept."""

    is_croppable = False

    def __init__(self, past: list[list[tuple[torch.Tensor, torch.Tensor]]], padded: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers leaves CacheLayerMixin.__init__ unannotated
        # per row: its cached keys/values as segments in position order, (keys, values) [1, heads, n, dim]
        # each, n summing to L_i (a session: its cache; a branch row: its session's cache up to the
        # branch's position, then the row's own)
        self.past = past
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
        for i, segments in enumerate(self.past):
            at = 0
            for k, v in segments:
                n = k.shape[-2]
                keys[i, :, at : at + n] = k[0]
                values[i, :, at : at + n] = v[0]
                at += n
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


def layer_kv(cache: Cache, layer: int, upto: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A cache's keys/values at `layer` as segments (see _GatheredLayer): [(keys, values)]
    [1, heads, n, dim], n = its length or `upto`, whichever is less; [] when that is 0."""
    layers = cache.layers
    if layer >= len(layers):
        return []
    found = layers[layer]
    assert isinstance(found, CacheLayerMixin)  # a DynamicCache's layers (no linear-attention ones)
    if not found.is_initialized or found.keys is None or found.values is None:
        return []
    n = found.get_seq_length() if upto is None else min(upto, found.get_seq_length())
    if n == 0:
        return []
    return [(found.keys[:, :, :n], found.values[:, :, :n])]


@dataclass
class Row:
    """One row of a batched forward (see the module's terms): it feeds `new` at positions
    past .. past + len(new) - 1, after the keys/values `segments(layer)` gives (past of them, in
    position order), and the forward appends the new tokens' keys/values to `cache`."""

    new: list[int]
    past: int
    segments: Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]
    cache: Cache


@torch.inference_mode()
def forward(model: torch.nn.Module, rows: Sequence[Row]) -> torch.Tensor:
    """Feed each row's `new` tokens through `model` in one forward and append their keys/values
    to each row's cache. Returns the logits of each row's last token [B, vocab]."""
    device = getattr(model, "device", torch.device("cpu"))
    news = [r.new for r in rows]
    lengths = [r.past for r in rows]
    if any(not n for n in news):
        raise ValueError("forward_rows: a row has no new token to feed")
    t = max(len(n) for n in news)
    padded = max(lengths)
    config: Any = model.config  # a transformers PretrainedConfig
    n_layers = int(config.num_hidden_layers)
    ids = torch.zeros(len(rows), t, dtype=torch.long)  # [B, T], left-padded
    positions = torch.zeros(len(rows), t, dtype=torch.long)  # [B, T]
    allowed = torch.zeros(len(rows), t, padded + t, dtype=torch.bool)  # [B, T, Lp + T]
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
    cache = Cache(layers=[_GatheredLayer([r.segments(layer) for r in rows], padded) for layer in range(n_layers)])
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
    for i, (r, new) in enumerate(zip(rows, news)):
        for layer, gathered in enumerate(cache.layers):
            assert isinstance(gathered, _GatheredLayer) and gathered.new is not None
            keys, values = gathered.new  # [B, heads, T, dim]
            r.cache.update(keys[i : i + 1, :, t - len(new) :], values[i : i + 1, :, t - len(new) :], layer)
    logits: torch.Tensor = out.logits  # [B, T, vocab]
    return logits[:, -1]  # [B, vocab]


def batchable(model: torch.nn.Module) -> bool:
    """Whether `forward_rows` applies to `model`: a decoder whose layers all use full
    attention (a sliding-window layer would need its own mask)."""
    types = getattr(model.config, "layer_types", None) or ["full_attention"]
    return all(t == "full_attention" for t in types) and not getattr(model.config, "use_sliding_window", False)
