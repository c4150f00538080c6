"""specdec.models.lean: the lean forward computes the model's own forward, in every call the
drafter makes (a prefill chunk, one-token steps on a cache, left-padded rows with a 2D mask
and their own positions, drafter.batch's 4D mask is tests/drafter/test_batch.py's), and
load_causal_lm picks it where it applies."""

from __future__ import annotations

import copy

import model_variants
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from specdec.models import load_causal_lm, resolve
from specdec.models.lean import LeanDecoder, supports

VOCAB = 300
SMALL = dict(vocab_size=VOCAB, **model_variants.SMALL)  # for the model types the lean forward refuses or takes


def _qwen2() -> torch.nn.Module:
    """Random-init Qwen2: biased q/k/v projections, grouped-query attention (4 heads, 2 KV)."""
    return model_variants.small_qwen2(VOCAB)


def _tiny() -> torch.nn.Module:
    """The tiny pair's draft: a llama (no biases)."""
    return AutoModelForCausalLM.from_pretrained(resolve("tiny/draft-mid"), dtype=torch.float32).eval()


@pytest.mark.parametrize("make", [_qwen2, pytest.param(_tiny, marks=pytest.mark.e2e)], ids=["qwen2", "tiny-llama"])
def test_lean_logits_equal_the_models_own(make) -> None:
    model = make()
    reference = copy.deepcopy(model)
    lean = LeanDecoder(model)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        # a prefill chunk, then one token at a time on the cache, keeping only the last logits
        own_cache, lean_cache = DynamicCache(), DynamicCache()
        want = reference(input_ids=ids[:, :16], past_key_values=own_cache, use_cache=True).logits  # [1, 16, vocab]
        got = lean(input_ids=ids[:, :16], past_key_values=lean_cache, use_cache=True).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for i in range(16, 24):
            step = ids[:, i : i + 1]
            want = reference(input_ids=step, past_key_values=own_cache, use_cache=True, logits_to_keep=1).logits
            got = lean(input_ids=step, past_key_values=lean_cache, use_cache=True, logits_to_keep=1).logits
            assert got.shape == (1, 1, model.config.vocab_size)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for mine, theirs in zip(lean_cache.layers, own_cache.layers, strict=True):  # the cache holds the same keys
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mine.values, theirs.values, rtol=1e-4, atol=1e-4)
        # left-padded rows (a branch batch): a 2D key mask and each row's own positions
        rows = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))  # [B, T]
        keep = torch.ones(2, 6, dtype=torch.long)  # [B, S]: row 1's first two slots are padding
        keep[1, :2] = 0
        positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]])
        kwargs = dict(input_ids=rows, attention_mask=keep, position_ids=positions, use_cache=True)
        want = reference(past_key_values=DynamicCache(), **kwargs).logits
        got = lean(past_key_values=DynamicCache(), **kwargs).logits
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[1, 2:], want[1, 2:], rtol=1e-4, atol=1e-4)  # the real queries


def test_lean_makes_a_cache_when_given_none() -> None:
    lean = LeanDecoder(_qwen2())
    with torch.inference_mode():
        out = lean(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 3
    assert out.logits.shape == (1, 3, VOCAB)


def test_supports_only_full_attention_silu_decoders() -> None:
    assert supports(_qwen2())
    windowed = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=8))
    assert not supports(windowed)  # a sliding window needs its own mask
    assert supports(MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None)))
    assert not supports(Qwen3ForCausalLM(Qwen3Config(**SMALL)))  # q/k norms: not this forward
    with pytest.raises(ValueError, match="qwen3"):
        LeanDecoder(Qwen3ForCausalLM(Qwen3Config(**SMALL)))


@pytest.mark.e2e
def test_load_causal_lm_picks_the_forward() -> None:
    assert isinstance(load_causal_lm("tiny/draft-mid", forward="auto"), LeanDecoder)
    assert isinstance(load_causal_lm("tiny/draft-mid", forward="lean", quantize="int8"), LeanDecoder)
    assert not isinstance(load_causal_lm("tiny/draft-mid"), LeanDecoder)  # the default: transformers'
    with pytest.raises(ValueError, match="forward must be one of"):
        load_causal_lm("tiny/draft-mid", forward="fast")
    with pytest.raises(ValueError, match="CPU-only"):
        load_causal_lm("tiny/draft-mid", forward="lean", device="cuda")


@pytest.mark.e2e
def test_a_lean_int8_draft_keeps_no_float32_projection_alive() -> None:
    """The draft a drafter serves holds its int8 weights only: the float32 Linear layers it was
    made from (the transformers model's unfused projections, which reference cycles kept alive
    until a collection: ~1 of the 2.6 GiB the qwen-coder draft's load left resident, a sixth of its
    pod's limit) are gone when load_causal_lm returns (docs/design.md, "The drafter's memory")."""
    import gc

    gc.collect()
    before = {id(o) for o in gc.get_objects()}
    gc.disable()  # the automatic collector may or may not run during a load: not it
    try:
        model = load_causal_lm("tiny/draft-mid", forward="lean", quantize="int8")
        floats = [o for o in gc.get_objects() if type(o) is torch.nn.Linear and id(o) not in before]
    finally:
        gc.enable()
    assert floats == []
    assert isinstance(model, LeanDecoder)


@pytest.mark.e2e
def test_lean_int8_drafts_the_same_tokens_as_the_models_own_int8() -> None:
    """Quantised, the fused projections share their activation scale as the separate ones did:
    greedy steps pick the same tokens as transformers' int8 model on the tiny draft."""
    own = load_causal_lm("tiny/draft-mid", quantize="int8", forward="transformers")
    lean = load_causal_lm("tiny/draft-mid", quantize="int8", forward="lean")
    with torch.inference_mode():
        picks = []
        for model in (own, lean):
            cache, ids, out = DynamicCache(), torch.tensor([[5, 17, 99, 3, 250]]), []
            for _ in range(12):
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                ids = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
                out.append(int(ids))
            picks.append(out)
    assert picks[0] == picks[1]
