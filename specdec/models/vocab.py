"""A draft vocabulary: the draft model's output layer cut to the token ids a workload uses.

A CPU draft forward reads all of its weights once per step. Qwen2.5-Coder-0.5B's output layer
(151,936 ids x 896, int8) is 136 MB of ~0.5 GB: a forward that scores only the ids a workload
actually produces reads a quarter fewer bytes. The *draft vocabulary* is that set of ids: the
`size` most frequent tokens of a sample of the workload's text (the draft's tokenizer, counted
by `build`), plus the tokenizer's special tokens. The idea is FR-Spec's (Zhao et al., 2025,
"frequency-ranked speculative sampling") and EAGLE-3's draft vocabulary.

`SubsetHead` replaces the model's `lm_head`: a Linear over the vocabulary's rows only (after
int8 quantisation, the same int8 rows and scales: a kept id's score is the full layer's bit for
bit), whose scores are written into a full-width logits row with every other id at the dtype's minimum, so
everything after the forward (greedy picks, q for sampled requests, alternatives for branches,
allowed_token_ids) is unchanged. The draft can then never propose an id outside the vocabulary;
its q gives such ids probability 0. Output stays exact either way: the target verifies every
draft (greedy: token for token; sampling: the acceptance rule with the q the draft sampled from,
0 outside the vocabulary, keeps the target's distribution). What it costs is acceptance
where the target's next token is outside the vocabulary (`specdec draft-vocab` reports the
share on held-out files of the sample).

File (JSON, `save`/`load`): {"format": "specdec-draft-vocab/1", "vocab_size": V (the model's
output width), "token_ids": [sorted ids], "source": "what it was counted from"}.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.errors import UserError

FORMAT = "specdec-draft-vocab/1"


@dataclass(frozen=True)
class DraftVocab:
    """A draft vocabulary: `token_ids` (sorted, unique, each < vocab_size) of a model whose
    output layer is `vocab_size` wide; `source` says what they were counted from."""

    token_ids: tuple[int, ...]
    vocab_size: int
    source: str = ""

    def __post_init__(self) -> None:
        ids = self.token_ids
        if not ids:
            raise ValueError("token_ids: empty (a draft vocabulary needs at least one id)")
        if list(ids) != sorted(set(ids)):
            raise ValueError("token_ids: must be sorted and unique")
        if ids[0] < 0 or ids[-1] >= self.vocab_size:
            raise ValueError(f"token_ids: ids must be 0 to vocab_size - 1 ({self.vocab_size - 1})")

    def save(self, path: Path) -> None:
        """Write the vocabulary as JSON (the module's file format)."""
        body = {
            "format": FORMAT,
            "vocab_size": self.vocab_size,
            "source": self.source,
            "token_ids": list(self.token_ids),
        }
        path.write_text(json.dumps(body) + "\n")

    @classmethod
    def load(cls, path: Path) -> DraftVocab:
        """Read a file `save` wrote; a ValueError naming the file and the field when it is not one."""
        try:
            body = json.loads(path.read_text())
        except OSError as err:
            raise ValueError(f"{path}: {err.strerror or err}") from err
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not JSON ({err.msg})") from err
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ValueError(f"{path}: field format: not {FORMAT!r} (make it with `specdec draft-vocab`)")
        ids, width = body.get("token_ids"), body.get("vocab_size")
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"{path}: field vocab_size: a positive integer expected")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError(f"{path}: field token_ids: a list of integers expected")
        try:
            return cls(tuple(ids), width, str(body.get("source", "")))
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err


def read(path: str | Path, model: str, width: int) -> DraftVocab:
    """The `--draft-vocab` file for the draft `model` whose output layer is `width` ids wide (0:
    unknown, not checked), read before any weights load: a UserError naming the setting when it
    is not one, or was made for another width."""
    try:
        vocab = DraftVocab.load(Path(path))
    except ValueError as err:
        raise UserError(f"--draft-vocab: {err}", "make one with `specdec draft-vocab`") from err
    if width and vocab.vocab_size != width:
        raise UserError(
            f"--draft-vocab {path}: made for an output layer {vocab.vocab_size} ids wide, "
            f"not the draft {model}'s {width}",
            f"make one for {model} with `specdec draft-vocab --model {model}`",
        )
    return vocab


def count_tokens(tokenizer: Any, texts: Iterable[str]) -> Counter[int]:
    """How often each token id occurs in `texts`, tokenised as the draft sees a prompt (no
    special tokens added)."""
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    return counts


def build(counts: Counter[int], size: int, vocab_size: int, always: Iterable[int] = (), source: str = "") -> DraftVocab:
    """The `size` most frequent ids of `counts` (ties: the lower id first) plus `always` (the
    tokenizer's special tokens: an end of text must stay draftable), every id < vocab_size."""
    if size < 1:
        raise ValueError(f"size {size}: must be at least 1")
    ranked = sorted((i for i in counts if 0 <= i < vocab_size), key=lambda i: (-counts[i], i))
    chosen = set(ranked[:size]) | {i for i in always if 0 <= i < vocab_size}
    return DraftVocab(tuple(sorted(chosen)), vocab_size, source)


def coverage(vocab: DraftVocab, counts: Counter[int]) -> float:
    """The share of the tokens counted in `counts` whose id is in `vocab` (1.0 for none)."""
    total = sum(counts.values())
    inside = set(vocab.token_ids)
    return sum(n for i, n in counts.items() if i in inside) / total if total else 1.0


def _kept_rows(head: torch.nn.Module, ids: torch.Tensor) -> torch.nn.Module:
    """A layer computing `head`'s outputs at `ids` only: a Linear of those rows, or for torch's
    dynamic int8 Linear one whose rows keep their int8 values and scales (so a kept id's score is
    the full layer's bit for bit)."""
    dynamic = torch.ao.nn.quantized.dynamic.Linear
    if isinstance(head, dynamic):
        weight, bias = head.weight(), head.bias()  # qint8 [vocab, hidden], float [vocab] or None
        values = weight.dequantize()[ids]  # exact multiples of the scales: requantised to the same ints
        if weight.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            kept = torch.quantize_per_tensor(values, weight.q_scale(), weight.q_zero_point(), weight.dtype)
        else:
            scales, zeros = weight.q_per_channel_scales()[ids], weight.q_per_channel_zero_points()[ids]
            kept = torch.quantize_per_channel(values, scales, zeros, 0, weight.dtype)
        rows = dynamic(head.in_features, len(ids), dtype=weight.dtype)  # type: ignore[no-untyped-call]
        rows.set_weight_bias(kept, None if bias is None else bias[ids])
        return rows
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"draft vocabulary: the output layer is a {type(head).__name__}, not a Linear")
    linear = torch.nn.Linear(
        head.in_features, len(ids), bias=head.bias is not None, dtype=head.weight.dtype, device=head.weight.device
    )
    with torch.no_grad():  # a copy: a tied embedding keeps its full table
        linear.weight.copy_(head.weight[ids])
        if head.bias is not None:
            linear.bias.copy_(head.bias[ids])
    return linear


class SubsetHead(torch.nn.Module):
    """An output layer that scores only a draft vocabulary's ids:
    hidden [..., hidden] -> logits [..., vocab_size], the vocabulary's ids scored by `head`'s
    rows for them (bit for bit the full layer's, float or dynamic int8), every other id at the
    dtype's minimum (softmax gives it 0)."""

    ids: torch.Tensor  # [K] the vocabulary's ids, sorted
    rows: torch.nn.Module  # hidden -> K

    def __init__(self, head: torch.nn.Module, vocab: DraftVocab) -> None:
        super().__init__()
        width = int(getattr(head, "out_features", 0))
        if width != vocab.vocab_size:
            raise ValueError(
                f"draft vocabulary: made for an output layer {vocab.vocab_size} ids wide, this model's is {width}"
            )
        device = next((p.device for p in head.parameters()), torch.device("cpu"))
        ids = torch.tensor(vocab.token_ids, dtype=torch.long, device=device)
        self.rows = _kept_rows(head, ids)
        self.register_buffer("ids", ids, persistent=False)  # [K]
        self.vocab_size = vocab.vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores: torch.Tensor = self.rows(hidden)  # [..., K]
        out = scores.new_full((*scores.shape[:-1], self.vocab_size), torch.finfo(scores.dtype).min)
        out.index_copy_(-1, self.ids, scores)
        return out  # [..., vocab_size]


def restrict(model: torch.nn.Module, vocab: DraftVocab) -> torch.nn.Module:
    """`model` with its `lm_head` replaced by a SubsetHead over `vocab` (transformers' causal LMs
    and specdec.models.lean.LeanDecoder both call `self.lm_head`), before or after int8 dynamic
    quantisation; a ValueError when the model has no Linear output layer or its width is not
    vocab.vocab_size."""
    head = getattr(model, "lm_head", None)
    if head is None:
        raise ValueError(f"draft vocabulary: {type(model).__name__} has no lm_head to cut")
    model.lm_head = SubsetHead(head, vocab)
    return model
