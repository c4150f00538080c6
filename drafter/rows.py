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
keys/values are appended to its own `cache`.

A row is a draft session (drafter.batch) or a branch (drafter.sessions, "branch": its
session's cache up to the branch's position, then its own keys/values, two segments). This
module knows neither.

Shared prefixes. With the lean forward (specdec.models.lean.LeanDecoder, the CPU drafter's),
the batch cache attends itself (`_BatchCache.attend`) and gathers less: a row's first segment
that other rows read too (a session's cache, read by its branch rows up to their positions) is
a part of its own, attended where it lies, one matrix product for every row that reads it;
only the rest (a branch row's own keys/values, the caches no other row reads) is gathered. The
parts' softmaxes are merged by their log-sums (as flash-decoding merges the splits of a key
range). Gathering copied the session's cache once per row, every step and layer, and read it
once per row: a session's row with 2 branch rows riding cost 1.7-2.3x its serial step at 3,000
cached tokens, shared 1.3x (`python -m benchmarks.branch_batch --ride 2`,
docs/batched-drafting.md). A prefix under SHARE_MIN tokens, and a cache only one row reads, are
still gathered: there the copy costs less than a second softmax and the merge.

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

from specdec.models.lean import PLAIN_ATTENTION_MODEL_TYPES, LeanDecoder, grouped_attention

Segment = tuple[torch.Tensor, torch.Tensor]  # (keys, values) [1, heads, n, dim] each: n cached positions in order

# The shortest shared prefix attended where it lies (drafter.rows, "Shared prefixes"): below it the
# copy costs less than the parts' merge, ~1.5-3 ms a forward of the qwen-coder draft over its 24
# layers (the two were even between 600 and 900 cached tokens: `python -m benchmarks.branch_batch
# --ride 2 --contexts 150,300,600,900`, docs/batched-drafting.md).
SHARE_MIN = 768

# Most bytes of attention scores (float32) a batched forward's layer computes at once: past it the
# step's queries are attended in chunks (`_GatheredLayer.attend`). A step's scores are rows x
# heads x new tokens x keys: 10 sessions of 3,300 tokens that a commit of 300 tokens each
# catches up would take ~550 MiB a layer, several copies of it at the softmax, and the heap
# keeps what it held (`python -m benchmarks.forward_memory`, docs/design.md, "A forward's workspace").
SCORES_BYTES = 64 << 20


def _gather(past: Sequence[Sequence[Segment]], padded: int, keys: torch.Tensor, values: torch.Tensor) -> Segment:
    """Each row's segments in order, zero-padded to `padded` slots, then the step's new keys and
    values (keys, values [B, heads, T, dim]) -> ([B, heads, padded + T, dim], the same for values)."""
    b, heads, t, dim = keys.shape
    all_keys = keys.new_zeros(b, heads, padded + t, dim)
    all_values = values.new_zeros(b, heads, padded + t, dim)
    for i, segments in enumerate(past):
        at = 0
        for k, v in segments:
            n = k.shape[-2]
            all_keys[i, :, at : at + n] = k[0]
            all_values[i, :, at : at + n] = v[0]
            at += n
    all_keys[:, :, padded:] = keys
    all_values[:, :, padded:] = values
    return all_keys, all_values


def _allowed(pads: Sequence[int], seen: Sequence[int], padded: int, t: int) -> torch.Tensor:
    """Which keys each query may see [B, T, padded + T] (bool): row i's first seen[i] gathered
    slots, then the step's new slots causally, never its padding (its first pads[i] slots; a
    padding query sees them: its output is dropped, and a query that sees nothing has no softmax)."""
    allowed = torch.zeros(len(pads), t, padded + t, dtype=torch.bool)
    causal = torch.ones(t, t, dtype=torch.bool).tril()  # [T, T]: query slot s sees new slots <= s
    for i, (pad, n) in enumerate(zip(pads, seen)):
        allowed[i, :, :n] = True
        allowed[i, :, padded:] = causal
        allowed[i, pad:, padded : padded + pad] = False
    return allowed


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask [B, T, S] as an additive one [B, 1, T, S]: 0 where allowed, dtype's min elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def _partial_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float, t: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one part of the keys, with what merging it with another part needs.
    query [B, kv heads, group x T, dim] (heads grouped by their KV head, as in grouped_attention);
    keys, values [B or 1, kv heads, S, dim]; mask additive [B, 1, T or 1, S] or None
    -> (log of the sum of exp(score) [B, kv, group x T, 1], the part's attention [B, kv,
    group x T, dim]), float32. Keys of one row (B = 1) that B rows read are read once: the rows'
    queries are stacked into one product (a broadcast product would copy the keys per row)."""
    b, kv, n, dim = query.shape
    query = query * scale
    stacked = keys.shape[0] == 1 and b > 1
    if stacked:
        queries = query.transpose(0, 1).reshape(kv, b * n, dim)  # [kv, B x group x T, dim]
        scores = torch.matmul(queries, keys[0].transpose(-1, -2)).float()  # [kv, B x group x T, S]
        if mask is not None:
            scores.view(kv, b, n // t, t, -1).add_(mask.view(1, b, 1, mask.shape[-2], mask.shape[-1]))
    else:
        scores = torch.matmul(query, keys.transpose(-1, -2)).float()  # [B, kv, group x T, S]
        if mask is not None:
            scores.view(b, kv, n // t, t, -1).add_(mask[:, :, None])
    # a softmax in place (the scores are the product's own tensor): fewer passes over B x S floats
    top = scores.amax(-1, keepdim=True)
    scores.sub_(top).exp_()
    total = scores.sum(-1, keepdim=True)
    out = torch.matmul(scores.to(values.dtype), values[0] if stacked else values).float().div_(total)
    lse = top + total.log()
    if stacked:  # back to [B, kv, group x T, ...]
        return lse.view(kv, b, n, 1).transpose(0, 1), out.view(kv, b, n, dim).transpose(0, 1)
    return lse, out


class _GatheredLayer(CacheLayerMixin):
    """One layer's keys/values for a batched step: the rows' own caches, padded to Lp, then
    the step's new keys/values (see the module's terms). Built per step, never kept. With
    `attend` (the lean forward), the layer computes its attention and gathers only the part of
    each row's cache that is not attended in place."""

    is_croppable = False

    def __init__(self, past: list[list[Segment]], padded: int, batch: _BatchCache | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers leaves CacheLayerMixin.__init__ unannotated
        # per row: its cached keys/values as segments in position order, n summing to L_i (a
        # session: its cache; a branch row: its session's cache up to the branch's position, then the row's own)
        self.past = past
        self.padded = padded  # Lp
        self.batch = batch  # the step's rows' padding and its masks, for `attend`
        self.new: Segment | None = None  # the step's (keys, values) [B, heads, T, dim]

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """The layer's attention: query [B, heads, T, dim] after RoPE; keys, values the step's new
        [B, kv heads, T, dim] -> [B, heads, T, dim]. A row's first segment that another row reads too
        is a part of its own (one product for the rows that read it, each to its own length); the
        rest of each row's cache and the new keys are gathered."""
        assert self.batch is not None
        self.new = (keys, values)
        b, heads, t, _ = query.shape
        readers: dict[tuple[int, ...], list[int]] = {}  # a first segment (its storage and strides) -> rows reading it
        for i, segments in enumerate(self.past):
            if segments:
                k, v = segments[0]
                readers.setdefault((k.data_ptr(), *k.stride(), v.data_ptr(), *v.stride()), []).append(i)
        parts: list[tuple[list[int], Segment, tuple[int, ...]]] = []  # (rows, the longest view, each row's length)
        rest = list(self.past)
        share_min = self.batch.share_min
        for rows in readers.values():
            if len(rows) < 2 or share_min is None:
                continue
            lengths = tuple(self.past[i][0][0].shape[-2] for i in rows)
            if max(lengths) < share_min:
                continue
            parts.append((rows, self.past[rows[lengths.index(max(lengths))]][0], lengths))
            for i in rows:
                rest[i] = rest[i][1:]
        seen = tuple(sum(k.shape[-2] for k, _ in segments) for segments in rest)
        padded = max(seen)
        gathered_keys, gathered_values = _gather(rest, padded, keys, values)  # [B, kv, padded + T, dim]
        mask = self.batch.mask(seen, padded)  # [B, 1, T, padded + T]
        # queries in chunks whose scores [B, heads, chunk, keys] (float32) stay under SCORES_BYTES
        # (each query's softmax is its own: the same attention, less memory at once)
        widest = padded + t + max((max(lengths) for _, _, lengths in parts), default=0)
        chunk = max(1, SCORES_BYTES // (b * heads * widest * 4))
        if chunk >= t:
            return self._attend_queries(query, gathered_keys, gathered_values, mask, parts, scale)
        return torch.cat(
            [
                self._attend_queries(
                    query[:, :, t0 : t0 + chunk],
                    gathered_keys,
                    gathered_values,
                    mask[:, :, t0 : t0 + chunk].contiguous(),
                    parts,
                    scale,
                )
                for t0 in range(0, t, chunk)
            ],
            dim=2,
        )

    def _attend_queries(
        self,
        query: torch.Tensor,
        gathered_keys: torch.Tensor,
        gathered_values: torch.Tensor,
        mask: torch.Tensor,
        parts: list[tuple[list[int], Segment, tuple[int, ...]]],
        scale: float,
    ) -> torch.Tensor:
        """`attend` for some of the step's queries: query [B, heads, t, dim]; the gathered keys and
        values [B, kv, S, dim] and their mask's rows for these queries [B, 1, t, S]; the parts
        (rows, their shared segment, each row's length) -> [B, heads, t, dim]."""
        assert self.batch is not None
        if not parts:
            return grouped_attention(query, gathered_keys, gathered_values, mask, scale)
        b, heads, t, dim = query.shape
        q = query.reshape(b, gathered_keys.shape[1], -1, dim)  # [B, kv, group x t, dim]
        lse, out = _partial_attention(q, gathered_keys, gathered_values, mask, scale, t)
        for rows, (k, v), lengths in parts:
            at = torch.tensor(rows, device=q.device)
            part_lse, part_out = _partial_attention(q[at], k, v, self.batch.lengths_mask(lengths), scale, t)
            # merge the two softmaxes by their log-sums (each row is in one part at most)
            both = torch.logaddexp(lse[at], part_lse)
            out[at] = out[at] * torch.exp(lse[at] - both) + part_out * torch.exp(part_lse - both)
        return out.to(gathered_values.dtype).view(b, heads, t, dim)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, heads, T, dim] -> [B, heads, Lp + T, dim]
        self.new = (key_states, value_states)
        return _gather(self.past, self.padded, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.padded + query_length, 0

    def get_seq_length(self) -> int:
        return self.padded

    def get_max_length(self) -> int:
        return -1


class _BatchCache(Cache):
    """The batched step's cache for a model that asks its cache to attend (LeanDecoder): one
    `_GatheredLayer` a layer, and the masks its layers share (built once a step)."""

    def __init__(
        self,
        past: list[list[list[Segment]]],
        pads: list[int],
        t: int,
        device: torch.device,
        share_min: int | None = SHARE_MIN,
    ) -> None:
        # past: per layer, per row, its segments; pads: each row's left padding of the T new slots;
        # share_min: attend a prefix several rows read where it lies from this many tokens (None: never)
        super().__init__(layers=[_GatheredLayer(rows, 0, self) for rows in past])
        self.pads, self.t, self.device, self.share_min = pads, t, device, share_min
        self._masks: dict[tuple[object, ...], torch.Tensor] = {}

    def attend(
        self, layer: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """`layer`'s attention (_GatheredLayer.attend): query [B, heads, T, dim], the step's new
        keys and values [B, kv heads, T, dim] -> [B, heads, T, dim]."""
        found = self.layers[layer]
        assert isinstance(found, _GatheredLayer)
        return found.attend(query, keys, values, scale)

    def mask(self, seen: tuple[int, ...], padded: int) -> torch.Tensor:
        """The gathered part's additive mask [B, 1, T, padded + T] float32 (_allowed)."""
        key = ("gathered", seen, padded)
        if key not in self._masks:
            self._masks[key] = _additive(_allowed(self.pads, seen, padded, self.t), torch.float32).to(self.device)
        return self._masks[key]

    def lengths_mask(self, lengths: tuple[int, ...]) -> torch.Tensor | None:
        """A part's additive mask [rows, 1, 1, longest] float32: row r sees its first lengths[r]
        keys; None when every row sees them all."""
        longest = max(lengths)
        if min(lengths) == longest:
            return None
        key = ("part", lengths)
        if key not in self._masks:
            allowed = torch.arange(longest)[None] < torch.tensor(lengths)[:, None]  # [rows, longest]
            self._masks[key] = _additive(allowed[:, None], torch.float32).to(self.device)
        return self._masks[key]


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


def layer_kv(cache: Cache, layer: int, upto: int | None = None) -> list[Segment]:
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
    segments: Callable[[int], list[Segment]]
    cache: Cache


@torch.inference_mode()
def forward(
    model: torch.nn.Module,
    rows: Sequence[Row],
    share_min: int | None = SHARE_MIN,
    stop: Callable[[], bool] | None = None,
) -> torch.Tensor:
    """Feed each row's `new` tokens through `model` in one forward and append their keys/values
    to each row's cache. Returns the logits of each row's last token [B, vocab]. `share_min`
    (the lean forward): a cache prefix several rows read, of this many tokens or more, is
    attended where it lies, once (the module's "Shared prefixes"); None gathers it per row
    (benchmarks.branch_batch compares the two). `stop` (the lean forward; ignored by others):
    asked before each layer, True ends the forward with specdec.models.lean.Stopped, and no
    row's cache has changed (they are appended to only after the forward)."""
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
    pads = [t - len(new) for new in news]
    for i, (new, cached, pad) in enumerate(zip(news, lengths, pads)):
        ids[i, pad:] = torch.tensor(new, dtype=torch.long)
        positions[i, pad:] = torch.arange(cached, cached + len(new))
        positions[i, :pad] = cached  # padding queries: any position (their outputs are dropped)
    segments = [[r.segments(layer) for r in rows] for layer in range(n_layers)]
    if isinstance(model, LeanDecoder):  # it asks the cache to attend: no mask of the whole batch, less gathered
        cache: Cache = _BatchCache(segments, pads, t, device, share_min)
        mask = None
    else:
        dtype = getattr(model, "dtype", torch.float32)  # the activations' dtype (int8-quantised Linears keep float32)
        if not dtype.is_floating_point:
            dtype = torch.float32
        mask = _additive(_allowed(pads, lengths, padded, t), dtype).to(device)  # [B, 1, T, Lp + T]
        cache = Cache(layers=[_GatheredLayer(past, padded) for past in segments])
    attention = config._attn_implementation
    # the same attention, faster for a batched step (_rows_attention), for the model types whose
    # attention is plain scaled dot-product (no soft-capping, sinks or sliding window); others keep their own
    if attention in ("sdpa", "eager") and getattr(config, "model_type", "") in PLAIN_ATTENTION_MODEL_TYPES:
        config._attn_implementation = ROWS_ATTENTION
    extra: dict[str, object] = {"stop": stop} if stop is not None and isinstance(model, LeanDecoder) else {}
    try:
        out = model(
            input_ids=ids.to(device),
            attention_mask=mask,
            position_ids=positions.to(device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **extra,
        )
    finally:
        config._attn_implementation = attention
    # the views of the rows' caches as they were go before the new keys are appended: an append
    # that outgrows a cache's buffer moves it to a larger one, and the old one is freed only once
    # nothing views it (held here, every row's old buffers stayed until the last row's append:
    # a group's caches twice over at once)
    del segments
    for gathered in cache.layers:
        assert isinstance(gathered, _GatheredLayer)
        gathered.past = []
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
