"""A lean forward for a draft model on the CPU: the decoder's arithmetic without transformers'
per-layer machinery.

A CPU draft step feeds one token per session through a 0.5B model: its cost is reading the
weights (memory-bound, ~10 GB/s on one core here) plus, with transformers' modules, ~10 ms of
per-layer Python and small ops a forward (Qwen2.5-Coder-0.5B int8, 24 layers, one session:
78.7 -> 69.1 ms a token, `specdec bench-drafter --forward-ab`, docs/batched-drafting.md).
`LeanDecoder` runs the same model from the same weights with:
    - q/k/v in one Linear and gate/up in one Linear (one int8 GEMM instead of three and two:
      the activations are quantised once, the weights read in one pass);
    - attention as plain matrix products with the query heads grouped by their KV head (no
      repeated keys), softmax in float32 (`grouped_attention`, drafter.rows' batched attention too);
    - transformers' own rotary embedding module (its RoPE scaling, whatever the config says).

It takes the call the drafter makes of a transformers causal LM and returns what it reads:
    model(input_ids [B, T], past_key_values=Cache | None, use_cache=True, logits_to_keep=k,
          attention_mask=None | [B, S] (1 = a real key) | [B, 1, T, S] additive,
          position_ids=None | [B, T]) -> .logits [B, k, vocab], .past_key_values
where S = the cache's length before the call + T. Without `attention_mask` every cached key is
visible and the new tokens see each other causally; without `position_ids` row positions
continue the cache (its get_seq_length()). The cache is any transformers Cache: each layer's
new keys/values go through `cache.update(keys, values, layer)`, which returns the layer's whole
keys/values (drafter.rows' gathered batch cache works unchanged). A cache with an
`attend(layer, query, keys, values, scale)` method (drafter.rows' batch cache) is given the
layer's query after RoPE and the step's new keys/values instead, and returns the attention
[B, heads, T, dim] itself: it reads cached keys where they lie, without gathering them into one
tensor; `attention_mask` is then its business (pass None).

`stop` (optional, a callable): asked before each layer; when it answers True the forward raises
`Stopped` there and returns nothing. A cache that attends itself is left as it was; a plain
cache has the step's keys/values in the layers done so far (the caller drops them: see
drafter.kvcache.GrowingCache.truncate). The drafter stops a forward whose context a commit has
just rejected (drafter.sessions, `superseded`), so the commit need not wait for it.

Supported (`supports`): llama, qwen2 and mistral configs whose layers all attend fully (no
sliding window) with a SiLU-gated MLP: the model types drafter.rows runs its own attention
for. Others keep transformers' forward (specdec.models.load_causal_lm decides).

Numerics: float32 logits equal transformers' up to summation order (the test checks 1e-4).
Under int8 (specdec.models.load_causal_lm quantises after fusing) a fused projection's
activations get one scale, as each unfused one's did (the same input), but its weights get one
scale over q, k and v (or gate and up) together: int8 drafts may differ slightly from the
unfused int8 model's (the target verifies every draft: the output does not change).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

# model types whose attention is plain scaled dot-product (no soft-capping, sinks or per-layer
# windows): the lean forward runs them, and drafter.rows runs its own batched attention for them
PLAIN_ATTENTION_MODEL_TYPES = ("llama", "qwen2", "mistral")


class Stopped(Exception):
    """A LeanDecoder forward ended early because its `stop` said so (see the module docstring)."""


def supports(model: torch.nn.Module) -> bool:
    """Whether `LeanDecoder(model)` computes what `model`'s own forward does (see the module)."""
    config: Any = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", "") not in PLAIN_ATTENTION_MODEL_TYPES:
        return False
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    windowed = getattr(config, "use_sliding_window", False) or (
        config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None
    )
    return (
        all(t == "full_attention" for t in layer_types)
        and not windowed
        and getattr(config, "hidden_act", "silu") == "silu"
        and hasattr(model, "lm_head")
        and hasattr(getattr(model, "model", None), "rotary_emb")
    )


def _fused(parts: list[torch.nn.Linear]) -> torch.nn.Linear:
    """One Linear computing the given Linears' outputs side by side (they share an input)."""
    fused = torch.nn.Linear(
        parts[0].in_features,
        sum(p.out_features for p in parts),
        bias=parts[0].bias is not None,
        dtype=parts[0].weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


def grouped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention in plain matrix products with the query heads grouped by their KV head
    (grouped-query attention without repeating the keys), softmax in float32.
    query [B, heads, T, dim]; key, value [B, kv heads, S, dim]; mask [B or 1, 1, T, S] additive
    or None -> [B, heads, T, dim]."""
    b, heads, t, dim = query.shape
    kv = key.shape[1]
    group = heads // kv  # head h uses KV head h // group
    q = query.reshape(b, kv, group * t, dim)  # [B, kv, group * T, dim]
    # in place where that is the same arithmetic: one tensor of scores fewer at a time (a
    # batched forward's scores are its largest tensors)
    scores = torch.matmul(q, key.transpose(-1, -2)).float().mul_(scale)  # [B, kv, group * T, S]
    if mask is not None:
        s = scores.shape[-1]
        scores.view(b, kv, group, t, s).add_(mask[:, :, None].float())
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(probs, value).view(b, heads, t, dim)


class _Layer(torch.nn.Module):
    """One decoder layer's weights: norms, fused q/k/v, output projection, fused gate/up, down."""

    qkv: torch.nn.Module
    o: torch.nn.Module
    gate_up: torch.nn.Module
    down: torch.nn.Module
    norm_in: torch.Tensor
    norm_post: torch.Tensor

    def __init__(self, layer: Any) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _fused([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = attn.o_proj
        self.gate_up = _fused([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj
        self.norm_in = layer.input_layernorm.weight  # [hidden]
        self.norm_post = layer.post_attention_layernorm.weight  # [hidden]


class LeanDecoder(torch.nn.Module):
    """`model`'s forward without transformers' modules (see the module docstring). Takes the
    model's weights (the unfused projections are dropped with the model); `config`,
    `generation_config`, `device` and `dtype` are the model's."""

    embed: torch.nn.Module
    rotary: torch.nn.Module
    lm_head: torch.nn.Module
    norm: torch.Tensor

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        if not supports(model):
            raise ValueError(f"LeanDecoder does not run a {getattr(model.config, 'model_type', '?')} model")
        config: Any = model.config
        body: Any = model.model
        self.config = config
        self.generation_config = getattr(model, "generation_config", None)
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.layers = torch.nn.ModuleList(_Layer(layer) for layer in body.layers)
        self.norm = body.norm.weight  # [hidden]
        head: Any = model.lm_head  # a Linear (torch types a Module's attributes as Tensor | Module)
        self.lm_head = head
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.intermediate = int(config.intermediate_size)
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # as transformers' LlamaRMSNorm: in float32, back to the input's dtype before the weight
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x.to(dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [B, heads, T, dim]; cos, sin [B, 1, T, dim]
        half = self.head_dim // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def _mask(self, attention_mask: torch.Tensor | None, t: int, s: int) -> torch.Tensor | None:
        """The additive mask [B or 1, 1, T, S] in float32 (None: every key visible, T = 1)."""
        if attention_mask is not None and attention_mask.dim() == 4:
            return attention_mask.float()
        causal = torch.ones(t, s, dtype=torch.bool, device=self.device).tril(s - t)  # query j sees keys <= s - t + j
        allowed = causal[None, None]  # [1, 1, T, S]
        if attention_mask is not None:  # [B, S]: 1 for a real key
            if attention_mask.shape[-1] != s:
                raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} keys, the cache and input {s}")
            allowed = allowed & attention_mask.bool()[:, None, None, :]  # [B, 1, T, S]
        elif t == 1:
            return None
        return torch.zeros(allowed.shape, device=self.device).masked_fill_(~allowed, torch.finfo(torch.float32).min)

    def forward(
        self,
        input_ids: torch.Tensor,
        past_key_values: Cache | None = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        stop: Callable[[], bool] | None = None,
        **unused: object,
    ) -> CausalLMOutputWithPast:
        cache = past_key_values if past_key_values is not None else DynamicCache()
        b, t = input_ids.shape
        if position_ids is None:
            past = cache.get_seq_length()
            position_ids = torch.arange(past, past + t, device=input_ids.device)[None].expand(b, t)
        h = self.embed(input_ids)  # [B, T, hidden]
        cos, sin = self.rotary(h, position_ids)  # [B, T, dim] each
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, dim]
        nq, nkv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        mask: torch.Tensor | None = None
        attend = getattr(cache, "attend", None)  # a cache that attends itself (see the module docstring)
        layers: Sequence[_Layer] = self.layers  # type: ignore[assignment]  # a ModuleList of _Layer
        for index, layer in enumerate(layers):
            if stop is not None and stop():
                raise Stopped(f"stopped before layer {index}")
            x = self._rms(h, layer.norm_in)
            qkv = layer.qkv(x)  # [B, T, (heads + 2 kv heads) x dim]
            q = qkv[..., :nq].view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, heads, T, dim]
            k = qkv[..., nq : nq + nkv].view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, T, dim]
            v = qkv[..., nq + nkv :].view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            if attend is not None:
                out = attend(index, q, k, v, self.scale)  # [B, heads, T, dim]
            else:
                keys, values = cache.update(k, v, index)  # [B, kv, S, dim]
                if index == 0:
                    mask = self._mask(attention_mask, t, keys.shape[-2])
                out = grouped_attention(q, keys, values, mask, self.scale)  # [B, heads, T, dim]
            h = h + layer.o(out.transpose(1, 2).reshape(b, t, nq))
            gate_up = layer.gate_up(self._rms(h, layer.norm_post))  # [B, T, 2 x intermediate]
            gate, up = gate_up[..., : self.intermediate], gate_up[..., self.intermediate :]
            h = h + layer.down(torch.nn.functional.silu(gate) * up)
        kept = h[:, -logits_to_keep:] if logits_to_keep else h  # [B, k, hidden]
        logits = self.lm_head(self._rms(kept, self.norm))  # [B, k, vocab]
        return CausalLMOutputWithPast(logits=logits, past_key_values=cache if use_cache else None)
