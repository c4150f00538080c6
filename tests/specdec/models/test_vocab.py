"""specdec.models.vocab: a draft vocabulary is chosen by frequency, survives its file, refuses
bad files naming the field, and the cut output layer scores its ids exactly as the full one
while no other id can be drafted (in both forwards, quantised or not)."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import model_variants
import pytest
import torch
from transformers import DynamicCache

from specdec.models import load_causal_lm
from specdec.models.lean import LeanDecoder
from specdec.models.vocab import DraftVocab, SubsetHead, build, coverage, restrict

VOCAB = 300


def test_build_keeps_the_most_frequent_ids_and_the_special_ones() -> None:
    counts = Counter({5: 10, 7: 10, 3: 4, 9: 1, 400: 50})  # 400: not a row of a 300-wide layer
    vocab = build(counts, 2, VOCAB, always=[299, 1000], source="s")
    assert vocab.token_ids == (5, 7, 299)  # 5 and 7 tie at 10 (lower id first), 299 always; 400, 1000 out
    assert build(counts, 3, VOCAB).token_ids == (3, 5, 7)
    assert vocab.source == "s" and vocab.vocab_size == VOCAB
    assert coverage(vocab, Counter({5: 3, 9: 1})) == 0.75
    with pytest.raises(ValueError, match="size 0"):
        build(counts, 0, VOCAB)


def test_a_vocabulary_refuses_ids_it_cannot_hold() -> None:
    with pytest.raises(ValueError, match="token_ids: empty"):
        DraftVocab((), VOCAB)
    with pytest.raises(ValueError, match="sorted and unique"):
        DraftVocab((3, 2), VOCAB)
    with pytest.raises(ValueError, match="0 to vocab_size - 1"):
        DraftVocab((1, VOCAB), VOCAB)


def test_the_file_round_trips_and_a_bad_one_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "v.json"
    vocab = DraftVocab((1, 2, 40), VOCAB, "three ids")
    vocab.save(path)
    assert DraftVocab.load(path) == vocab
    cases = {
        "not JSON": "{",
        "field format": json.dumps({"token_ids": [1], "vocab_size": VOCAB}),
        "field vocab_size": json.dumps({"format": "specdec-draft-vocab/1", "token_ids": [1]}),
        "field token_ids": json.dumps({"format": "specdec-draft-vocab/1", "vocab_size": VOCAB, "token_ids": ["a"]}),
        "0 to vocab_size - 1": json.dumps({"format": "specdec-draft-vocab/1", "vocab_size": 2, "token_ids": [5]}),
    }
    for expected, body in cases.items():
        path.write_text(body)
        with pytest.raises(ValueError, match=expected) as err:
            DraftVocab.load(path)
        assert str(path) in str(err.value)
    with pytest.raises(ValueError, match="No such file"):
        DraftVocab.load(tmp_path / "missing.json")


def test_the_cut_head_scores_its_ids_as_the_full_head_and_no_other() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, VOCAB, bias=True)
    vocab = DraftVocab(tuple(range(0, VOCAB, 7)), VOCAB)
    cut = SubsetHead(head, vocab)
    hidden = torch.randn(3, 2, 16)  # [B, T, hidden]
    with torch.no_grad():
        full, got = head(hidden), cut(hidden)  # [B, T, vocab] each
    ids = torch.tensor(vocab.token_ids)
    assert got.shape == full.shape
    torch.testing.assert_close(got[..., ids], full[..., ids])
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert (got[..., outside] == torch.finfo(got.dtype).min).all()
    assert (torch.softmax(got, dim=-1)[..., outside] == 0).all()  # q is 0 outside the vocabulary
    with pytest.raises(ValueError, match="300 ids wide, this model's is 299"):
        SubsetHead(torch.nn.Linear(16, VOCAB - 1), vocab)


@pytest.mark.parametrize("lean", [False, True], ids=["transformers", "lean"])
def test_a_cut_model_drafts_the_full_models_pick_among_its_ids(lean: bool) -> None:
    """Greedy steps of the cut model equal the full model's argmax over the vocabulary's ids,
    and the full model's own picks do leave the vocabulary (a test that can fail)."""
    model = model_variants.small_qwen2(VOCAB)
    full = LeanDecoder(copy.deepcopy(model)) if lean else copy.deepcopy(model)
    vocab = DraftVocab(tuple(range(0, VOCAB, 3)), VOCAB)
    cut = restrict(LeanDecoder(model) if lean else model, vocab)
    ids = torch.tensor(vocab.token_ids)
    left = 0
    with torch.inference_mode():
        tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
        caches = DynamicCache(), DynamicCache()
        for _ in range(12):
            want = full(input_ids=tokens, past_key_values=caches[0], logits_to_keep=1).logits[:, -1]  # [2, vocab]
            got = cut(input_ids=tokens, past_key_values=caches[1], logits_to_keep=1).logits[:, -1]
            torch.testing.assert_close(got[:, ids], want[:, ids], rtol=1e-5, atol=1e-5)
            assert (got.argmax(-1) == ids[want[:, ids].argmax(-1)]).all()
            left += int((~torch.isin(want.argmax(-1), ids)).sum())
            tokens = got.argmax(-1, keepdim=True)  # [2, 1]
    assert left > 0, "the full model never picked an id outside the vocabulary"


def test_load_causal_lm_cuts_the_int8_layer_keeping_its_rows_bit_for_bit(tmp_path: Path) -> None:
    """Under int8 the kept ids' scores are the full int8 model's exactly (the same int8 rows and
    scale), so a cut draft's greedy pick is the full int8 draft's pick among the vocabulary."""
    model_variants.small_qwen2(VOCAB).save_pretrained(tmp_path)
    vocab = DraftVocab(tuple(range(0, VOCAB, 2)), VOCAB)
    full = load_causal_lm(str(tmp_path), quantize="int8", forward="lean")
    cut = load_causal_lm(str(tmp_path), quantize="int8", forward="lean", draft_vocab=vocab)
    assert isinstance(cut.lm_head, SubsetHead)
    assert isinstance(cut.lm_head.rows, torch.ao.nn.quantized.dynamic.Linear)  # the cut layer is int8 too
    ids = torch.tensor(vocab.token_ids)
    tokens = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = full(input_ids=tokens).logits  # [3, 7, vocab]
        got = cut(input_ids=tokens).logits
    assert torch.equal(got[..., ids], want[..., ids])
    with pytest.raises(ValueError, match="made for an output layer 301 ids wide"):
        load_causal_lm(str(tmp_path), draft_vocab=DraftVocab((1,), VOCAB + 1))
