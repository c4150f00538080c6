"""A draft fits a target when their vocabularies and special ids match; different padding of the
embedding is accepted (specdec.models.compat). Refused at start in one line naming both models."""

from __future__ import annotations

from pathlib import Path

import model_variants
import pytest
import torch
from prometheus_client import CollectorRegistry

from drafter.sessions import ModelDraftSession
from specdec import models
from specdec.config import DrafterConfig
from specdec.models import compat
from specdec_cli import main as cli


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root, target = tmp_path_factory.mktemp("variants"), models.resolve("tiny/target")
    return {
        "target": target,
        "padded": model_variants.padded(target, root / "padded", 576),
        "other-vocab": model_variants.other_vocab(target, root / "other-vocab"),
        "other-eos": model_variants.other_eos(target, root / "other-eos"),
    }


def facts(variants: dict[str, Path], name: str) -> compat.Vocabulary:
    return compat.from_folder(variants[name], name)


def test_a_draft_with_another_vocabulary_is_refused_in_one_line_naming_both(variants) -> None:
    line = compat.mismatch(facts(variants, "target"), facts(variants, "other-vocab"))
    assert line is not None and "\n" not in line
    assert line.startswith(
        "draft 'other-vocab' does not fit target 'target': different vocabularies (512 vs 513 tokens"
    )
    with pytest.raises(compat.IncompatibleModels, match="different vocabularies"):
        compat.check(facts(variants, "target"), facts(variants, "other-vocab"))


def test_special_ids_must_match(variants) -> None:
    assert (
        compat.mismatch(facts(variants, "target"), facts(variants, "other-eos"))
        == "draft 'other-eos' does not fit target 'target': EOS token id 0 vs 1"
    )


def test_different_padding_of_the_same_vocabulary_is_accepted(variants) -> None:
    target, padded = facts(variants, "target"), facts(variants, "padded")
    assert (padded.vocab_size, padded.tokenizer_size, padded.fingerprint) == (576, 512, target.fingerprint)
    assert compat.mismatch(target, padded) is None and compat.mismatch(padded, target) is None


def test_a_model_without_a_row_for_every_token_is_refused(variants) -> None:
    from dataclasses import replace

    short = replace(facts(variants, "target"), model="short", vocab_size=500)
    assert (
        compat.mismatch(facts(variants, "target"), short)
        == "draft 'short' does not fit target 'target': 'short' has 500 embedding rows for 512 tokens"
    )
    gateway = replace(facts(variants, "target"), model="tok", vocab_size=0)  # a tokenizer only: no rows to check
    assert compat.mismatch(facts(variants, "target"), gateway, "gateway tokenizer") is None


def test_the_wire_form_round_trips_and_an_older_peer_is_not_checked(variants) -> None:
    from specdec.wire import pb

    for name in ("target", "other-eos"):
        f = facts(variants, name)
        assert compat.from_pb(compat.to_pb(f), name) == f
    assert f.pad_token_id is None and not compat.to_pb(f).HasField("pad_token_id")
    assert compat.from_pb(pb.Vocabulary(), "old") is None  # no fingerprint: a peer that sends none


def test_a_drafter_given_its_target_refuses_a_draft_that_does_not_fit(variants) -> None:
    from drafter.server import build

    cfg = DrafterConfig(model=str(variants["other-vocab"]), target="tiny/target", metrics_port=0)
    with pytest.raises(compat.IncompatibleModels, match="does not fit target 'tiny/target': different vocabularies"):
        build(cfg, CollectorRegistry())


def test_up_refuses_a_pair_that_does_not_fit_before_starting_anything(
    variants, capsys, monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr("specdec_cli.launch.Cluster.start", lambda self, *a: started.append(self))
    for argv in (
        ["up", "--models", "tiny", "--draft", str(variants["other-eos"])],
        ["demo", "--models", "tiny", "--draft", str(variants["other-vocab"])],
        ["up", "--target", "tiny/target", "--draft", "tiny/draft-mid", "--tokenizer", str(variants["other-vocab"])],
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("specdec: error: "), err
        assert "does not fit target 'tiny/target'" in err[0], err
    assert "gateway tokenizer" in err[0]
    assert not started


def test_drafts_are_chosen_among_the_tokenizers_ids_only() -> None:
    """A padded draft never proposes a padding id, greedy or sampled, with or without branches'
    alternatives: every draft lies in the target's vocabulary."""
    model = models.load_causal_lm("tiny/draft-mid")
    logits = torch.zeros(576)  # [rows]
    logits[600 - 64] = 100.0  # a padding row would win
    logits[7] = 5.0
    for temperature in (0.0, 1.0):
        session = ModelDraftSession(
            model,
            [1, 2, 3],
            gamma=4,
            lookahead=0,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            seed=0,
            q_top_k=4,
            vocab_limit=512,
        )
        for with_alts in (False, True):
            d = session._pick(logits.clone(), with_alts)
            assert d.token_id < 512 and all(t < 512 for t, _ in d.alts or ())
    unlimited = ModelDraftSession(
        model, [1, 2, 3], gamma=4, lookahead=0, temperature=0.0, top_k=0, top_p=1.0, seed=0, q_top_k=4
    )
    assert unlimited._pick(logits.clone(), False).token_id == 536  # the limit is what keeps it out
