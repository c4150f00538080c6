"""The draft as the drafter runs it by default, for the benchmarks that time it in this process
(benchmarks.commit_stop, benchmarks.forward_cost): pinned to the last core with one torch thread,
as the drafter runs, loaded with the drafter's default placement, quantisation and forward, and
fed a prompt of real source (`--source`, default the standard library's json/decoder.py)."""

from __future__ import annotations

import argparse
import inspect
import json.decoder
import os
from pathlib import Path

import torch

from specdec.config import DrafterConfig
from specdec.models import PAIRS, load_causal_lm, resolve
from specdec.models.device import Placement, draft_placement
from specdec.models.vocab import read as read_draft_vocab


def add_prompt_args(ap: argparse.ArgumentParser) -> None:
    """`--prompt` (tokens) and `--source` (the file they come from)."""
    ap.add_argument("--prompt", type=int, default=300, help="prompt tokens, from --source")
    ap.add_argument("--source", type=Path, default=Path(inspect.getfile(json.decoder)))


def default_draft(
    models: str, forward: str | None = None, draft_vocab: str | None = None
) -> tuple[DrafterConfig, Placement, torch.nn.Module]:
    """Pin this process to the drafter's core (the last) with one torch thread, then load the
    draft of the pair `models` as the drafter does by default: (its config, placement, model).
    `forward`: the drafter's --forward (None: its default); `draft_vocab`: a --draft-vocab file."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[-1]})
    torch.set_num_threads(1)
    cfg = DrafterConfig(model=PAIRS[models].draft)
    placement = draft_placement(cfg.device, cfg.dtype, cfg.quantize)
    vocab = read_draft_vocab(draft_vocab, cfg.model, 0) if draft_vocab else None
    model = load_causal_lm(
        cfg.model, placement.dtype, placement.quantize, None, placement.device, forward or cfg.forward, vocab
    )
    return cfg, placement, model


def source_ids(model: str, source: Path, need: int) -> list[int]:
    """`source`'s token ids under the tokenizer of `model` (a model reference); SystemExit naming
    --prompt when there are fewer than `need`."""
    from transformers import AutoTokenizer

    ids: list[int] = AutoTokenizer.from_pretrained(resolve(model))(source.read_text(errors="replace"))["input_ids"]
    if len(ids) < need:
        raise SystemExit(f"--source has {len(ids)} tokens, --prompt needs {need}")
    return ids
