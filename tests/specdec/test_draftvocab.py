"""`specdec draft-vocab` (specdec_cli.draftvocab): which files it reads, and bad input as one
line naming the flag or path, before any model loads. The whole command on the tiny draft runs
in tests/e2e/test_draft_vocab.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec_cli import main as cli
from specdec_cli.draftvocab import read_text, text_files


def test_it_reads_text_files_under_folders_and_skips_binary_and_hidden(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.py").write_text("def f():\n    return 1\n")
    (tmp_path / "a" / "blob.bin").write_bytes(b"\xff\xfe\x00\x81")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("[core]\n")
    (tmp_path / "b.c").write_text("int main(void) { return 0; }\n")
    (tmp_path / "link").symlink_to(tmp_path / "a")  # not followed: no file twice
    files = list(text_files([tmp_path]))
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["b.c", "a/blob.bin", "a/x.py"]
    assert [read_text(f) is not None for f in files] == [True, False, True]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--size", "0", "x"], "--size 0: must be at least 1"),
        (["--holdout", "1", "x"], "--holdout 1: must be 0 or at least 2"),
        (["/no/such/folder"], "/no/such/folder: no such file or folder"),
    ],
)
def test_bad_input_is_one_line_naming_it(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["draft-vocab", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_folder_without_text_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00\x81")
    assert cli.main(["draft-vocab", str(tmp_path)]) == 2
    assert f"no text files in {tmp_path}" in capsys.readouterr().err
