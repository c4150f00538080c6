"""Model references a vLLM user would pass: folders, Hugging Face repo ids (offline, from a local
cache, with a revision), registry names, and a team's pairs file."""

from __future__ import annotations

from pathlib import Path

import hf_cache
import pytest

from specdec import models
from specdec.errors import ModelNotFoundError, UserError
from specdec.models import hub
from specdec_cli import main as cli


@pytest.fixture
def hf_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty Hugging Face home, offline (nothing reaches a hub)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("SPECDEC_PAIRS", raising=False)
    monkeypatch.chdir(tmp_path)  # no specdec.toml from the checkout
    return tmp_path / "hf"


def test_a_repo_id_resolves_from_the_cache_offline_at_its_revision(hf_home: Path) -> None:
    target = models.resolve("tiny/target")
    main = hf_cache.store(target, "acme/tiny-target", hf_home / "hub")
    tagged = hf_cache.store(models.resolve("tiny/draft-mid"), "acme/tiny-target", hf_home / "hub", revision="v2")
    snapshots = hf_home / "hub" / "models--acme--tiny-target" / "snapshots"
    assert models.resolve("acme/tiny-target") == snapshots / main
    assert models.resolve("acme/tiny-target", revision="v2") == snapshots / tagged
    assert models.resolve("acme/tiny-target@v2") == snapshots / tagged  # @REV: the same as revision
    assert models.resolve(f"acme/tiny-target@{main}") == snapshots / main  # a commit
    assert (models.resolve("acme/tiny-target") / "config.json").read_bytes() == (target / "config.json").read_bytes()


def test_hf_hub_cache_wins_over_hf_home(hf_home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    commit = hf_cache.store(models.resolve("tiny/target"), "acme/tiny-target", other)
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert models.resolve("acme/tiny-target") == other / "models--acme--tiny-target" / "snapshots" / commit


def test_a_missing_repo_id_is_one_error_naming_the_id_and_the_cache(hf_home: Path) -> None:
    with pytest.raises(ModelNotFoundError) as err:
        models.resolve("acme/no-such-model")
    text = str(err.value)
    assert "'acme/no-such-model' (revision 'main') is not in the Hugging Face cache" in text
    assert str(hf_home / "hub") in text and "HF_HUB_OFFLINE is set" in text
    hf_cache.store(models.resolve("tiny/target"), "acme/tiny-target", hf_home / "hub")
    with pytest.raises(ModelNotFoundError, match="'acme/tiny-target' \\(revision 'v9'\\) is not in"):
        models.resolve("acme/tiny-target", revision="v9")


def test_the_cli_prints_the_missing_id_as_one_line(hf_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "path", "acme/no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(
            "specdec: error: model 'acme/no-such-model' (revision 'main') is not in the Hugging Face "
            f"cache {hf_home / 'hub'}"
        )
        and "\n" not in err
    )


def test_registry_names_and_folders_still_resolve_first(hf_home: Path) -> None:
    folder = models.resolve("tiny/target")
    assert folder.is_dir() and models.resolve(str(folder)) == folder
    with pytest.raises(ModelNotFoundError, match="pair 'tiny' has no role 'nope'"):  # never asked of the hub
        models.resolve("tiny/nope")
    with pytest.raises(ModelNotFoundError, match="is a folder, so revision 'v2' cannot apply"):
        models.resolve(str(folder), revision="v2")
    assert hub.split_revision("acme/x@v1.2") == ("acme/x", "v1.2") and hub.split_revision("/a/b@c") == ("/a/b@c", None)
    assert not hub.is_repo_id("/abs/path") and not hub.is_repo_id("a/b/c") and hub.is_repo_id("Qwen/Qwen3-0.6B")


def test_load_causal_lm_by_repo_id_is_the_folders_model(hf_home: Path) -> None:
    import torch

    hf_cache.store(models.resolve("tiny/draft-mid"), "acme/tiny-draft", hf_home / "hub")
    by_id = models.load_causal_lm("acme/tiny-draft")
    by_folder = models.load_causal_lm(str(models.resolve("tiny/draft-mid")))
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(by_id(ids).logits, by_folder(ids).logits)


PAIRS_TOML = """
[pairs.acme]
target = "acme/tiny-target"
draft = "tiny/draft-mid"
"""


def test_a_pairs_file_names_a_teams_pairs_next_to_the_built_in_ones(hf_home: Path) -> None:
    hf_cache.store(models.resolve("tiny/target"), "acme/tiny-target", hf_home / "hub")
    Path("specdec.toml").write_text(PAIRS_TOML)
    try:
        acme = models.pair("acme")
        assert (acme.target, acme.draft, acme.tokenizer) == ("acme/tiny-target", "tiny/draft-mid", "acme/tiny-target")
        assert {"acme", "qwen-coder", "tiny"} <= set(models.PAIRS)  # one registry
        assert "acme" in models.pair_names() and models.roles("acme") == ("target", "draft")
        assert models.resolve("acme/draft") == models.resolve("tiny/draft-mid")
        assert models.resolve("acme/target").parent.name == "snapshots"
        assert models.folders("acme")["target"] == models.resolve("acme/tiny-target")
        chosen = models.choose("acme", draft="tiny/draft-far")
        assert (chosen.target, chosen.draft, chosen.tokenizer) == (
            "acme/tiny-target",
            "tiny/draft-far",
            "acme/tiny-target",
        )
        found = models.check_pair(chosen)  # same tokenizer: fits
        assert set(found) == {"target", "draft", "tokenizer"}
    finally:
        Path("specdec.toml").unlink()
        models.load_pairs_file()
    assert "acme" not in models.PAIRS


def test_specdec_pairs_names_another_file_and_bad_files_are_one_error(
    hf_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "team-pairs.toml"
    monkeypatch.setenv("SPECDEC_PAIRS", str(path))
    try:
        for text, message in (
            ('[pairs.tiny]\ntarget = "a/b"\ndraft = "c/d"\n', "shadows the built-in pair 'tiny'"),
            ('[pairs.x]\ntarget = "a/b"\n', r"\[pairs.x\] needs `target` and `draft`"),
            ('[pairs.x]\ntarget = "a/b"\ndraft = "c/d"\nmodel = "e"\n', "unknown keys \\['model'\\]"),
            ("[pairs.x\n", "pairs file .*team-pairs.toml: "),
        ):
            path.write_text(text)
            with pytest.raises(UserError, match=message):
                models.load_pairs_file()
        path.write_text('[pairs.x]\ntarget = "a/b"\ndraft = "c/d"\n')
        assert models.pair("x").draft == "c/d"
        with pytest.raises(ModelNotFoundError, match="unknown model pair 'y'; known pairs: .*qwen-coder, tiny, x"):
            models.pair("y")
        monkeypatch.setenv("SPECDEC_PAIRS", str(tmp_path / "missing.toml"))
        with pytest.raises(UserError, match="SPECDEC_PAIRS names .*missing.toml, which is not a file"):
            models.load_pairs_file()
    finally:
        monkeypatch.delenv("SPECDEC_PAIRS")
        models.load_pairs_file()
    assert "x" not in models.PAIRS
