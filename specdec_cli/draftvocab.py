"""`specdec draft-vocab`: make a draft vocabulary file from a sample of a workload's text.

    specdec draft-vocab PATH... [--model REF] [--size N] [--holdout K] [--out FILE]

Counts the draft tokenizer's tokens over the files given (folders: every UTF-8 text file under
them, links not followed), keeps the `--size` most frequent ids and the tokenizer's special
tokens, and writes the file the drafter's `--draft-vocab` reads (specdec.models.vocab). Every
K-th file (`--holdout`, default 10) is first left out: the coverage of those files by a
vocabulary counted without them (the share of their tokens the draft can still propose) is
printed, then they are counted too. Below 100 %, a round whose target token is outside the
vocabulary ends its accepted run there (docs/draft-vocabulary.md).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path

from specdec.errors import UserError

HELP = "make a draft vocabulary (the ids the draft may propose) from a sample of your traffic's text"
MAX_FILE_BYTES = 1 << 20  # a file's first MiB is counted


def text_files(paths: list[Path]) -> Iterator[Path]:
    """The files named and every file under the folders named (sorted, links not followed)."""
    for path in paths:
        if path.is_file():
            yield path
        elif path.is_dir():
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                yield from (Path(root) / f for f in sorted(files) if not f.startswith("."))
        else:
            raise UserError(f"{path}: no such file or folder", "give files or folders of your traffic's text")


def read_text(path: Path) -> str | None:
    """The file's first MiB as UTF-8 text; None for a binary file (or one that cannot be read)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES)
        return data.decode("utf-8", errors="ignore" if len(data) == MAX_FILE_BYTES else "strict")
    except (OSError, UnicodeDecodeError):
        return None


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`specdec draft-vocab`."""
    p = sub.add_parser(
        "draft-vocab", help=HELP, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "paths", nargs="+", type=Path, metavar="PATH", help="text files or folders (a sample of your traffic)"
    )
    p.add_argument(
        "--model", default="qwen-coder/draft", metavar="REF", help="the draft model (its tokenizer and width)"
    )
    p.add_argument("--size", type=int, default=65536, help="most frequent ids kept (default 65536)")
    p.add_argument(
        "--holdout", type=int, default=10, metavar="K", help="leave every K-th file out to measure coverage (0: none)"
    )
    p.add_argument(
        "--out", type=Path, default=Path("draft-vocab.json"), help="the file to write (default draft-vocab.json)"
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Count, choose, report and write (see the module docstring)."""
    from transformers import AutoConfig, AutoTokenizer

    from specdec.models import resolve
    from specdec.models.vocab import build, count_tokens, coverage

    if args.size < 1:
        raise UserError(f"--size {args.size}: must be at least 1", "pass --size 32768, say")
    if args.holdout < 0 or args.holdout == 1:
        raise UserError(f"--holdout {args.holdout}: must be 0 or at least 2", "pass --holdout 10, say")
    sample: list[str] = []
    held: list[str] = []
    for n, path in enumerate(text_files(args.paths), 1):  # before loading anything: a bad path is one line
        text = read_text(path)
        if text:
            (held if args.holdout and n % args.holdout == 0 else sample).append(text)
    if not sample:
        raise UserError(f"no text files in {', '.join(map(str, args.paths))}", "give files or folders of text")
    folder = resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    width = int(AutoConfig.from_pretrained(folder).vocab_size)  # the output layer's width
    counts = count_tokens(tokenizer, sample)
    special = [*tokenizer.all_special_ids, *getattr(tokenizer, "added_tokens_decoder", {})]
    mb = sum(len(t.encode()) for t in sample + held) / 1e6
    if held:  # coverage of files the vocabulary was not counted from; then count them too
        unseen = count_tokens(tokenizer, held)
        share = coverage(build(counts, args.size, width, special), unseen)
        counts.update(unseen)
    where = ", ".join(map(str, args.paths))
    vocab = build(counts, args.size, width, special, source=f"{len(sample) + len(held)} files of {where}")
    print(
        f"counted {sum(counts.values()):,} tokens ({len(counts):,} distinct ids) in "
        f"{len(sample) + len(held)} files ({mb:.1f} MB)"
    )
    print(
        f"draft vocabulary: {len(vocab.token_ids):,} of {width:,} ids "
        f"(the {args.size:,} most frequent and the special tokens)"
    )
    if held:
        print(
            f"coverage of {len(held)} held-out files (every {args.holdout}th, by a vocabulary counted "
            f"without them): {100 * share:.2f} % of their tokens"
        )
    vocab.save(args.out)
    print(f"wrote {args.out}: serve the drafter with --draft-vocab {args.out} (or SPECDEC_DRAFT_VOCAB)")
    return 0
