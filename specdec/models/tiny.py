"""The tiny test pair: a random-init Llama target and drafts of controlled agreement.

Built from nothing in seconds, deterministically (fixed seeds, a fixed training text
for the tokenizer), and cached. It proves mechanics (exactness, protocol, faults), not
speed or quality.

Roles (all share one byte-level BPE tokenizer of VOCAB_SIZE tokens):
    target       2-layer Llama, hidden 128; lm_head scaled so next-token
                 distributions are peaked enough for statistical tests
    draft-same   an exact copy of the target: greedy agreement (alpha) = 1
    draft-mid    the target with noise added to its output head: alpha in between
    draft-far    an unrelated random model: alpha near 0
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaConfig

VOCAB_SIZE = 512
HIDDEN = 128
LAYERS = 2
HEADS = 2
MAX_POSITIONS = 2048
# Standard deviation of the target's lm_head weights: logits ~ N(0, (0.35 * sqrt(128))^2).
LM_HEAD_STD = 0.35
# Noise added to draft-mid's lm_head, relative to LM_HEAD_STD.
MID_NOISE = 0.2
EOS = "<|endoftext|>"
RECIPE_VERSION = "1"
ROLES = ("target", "draft-same", "draft-mid", "draft-far")
_MARKER = ".specdec-complete"

# Training text for the tokenizer: fixed standard-library modules (same on every 3.11).
_CORPUS_MODULES = ("textwrap", "string", "heapq", "bisect", "colorsys", "fnmatch", "shlex", "difflib")

# A few prompts that make sense to this tokenizer (code-like text).
SAMPLE_PROMPTS = (
    "def add(a, b):\n    return",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
)


def _recipe_hash() -> str:
    spec = [RECIPE_VERSION, VOCAB_SIZE, HIDDEN, LAYERS, HEADS, LM_HEAD_STD, MID_NOISE, _CORPUS_MODULES]
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def _train_tokenizer(dest: Path) -> None:
    import importlib

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = []
    for name in _CORPUS_MODULES:
        source = importlib.import_module(name).__file__
        assert source is not None, f"{name} is a pure-Python standard-library module"
        texts.append(Path(source).read_text())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS)
    fast.save_pretrained(dest)


def _config(eos_id: int) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        dtype="float32",  # torch_dtype before transformers 5; it saves the same config.json
    )


def _build_models(tok_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    assert isinstance(eos_id, int), "one token, one id"

    def make(seed: int) -> LlamaForCausalLM:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(_config(eos_id))
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, LM_HEAD_STD)
        return model

    target = make(0)
    mid = make(0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        noise = torch.randn(mid.lm_head.weight.shape, generator=gen) * LM_HEAD_STD * MID_NOISE
        mid.lm_head.weight.add_(noise)
    models = {"target": target, "draft-same": target, "draft-mid": mid, "draft-far": make(2)}
    for role, model in models.items():
        model.save_pretrained(out / role, safe_serialization=True)
        tokenizer.save_pretrained(out / role)


def folders(root: Path) -> dict[str, Path]:
    """The tiny pair's folders under `root`, keyed by role, whether built or not."""
    final = Path(root) / _recipe_hash()
    return {role: final / role for role in ROLES}


def is_built(root: Path) -> bool:
    """Whether `build(root)` has completed for this recipe (it would return at once)."""
    return (Path(root) / _recipe_hash() / _MARKER).exists()


def build(root: Path) -> dict[str, Path]:
    """Build (once) and return the tiny pair's folders, keyed by role.

    The build happens in a temporary folder renamed into place when complete, so an
    interrupted build never leaves a folder that looks finished.
    """
    root = Path(root)
    final = root / _recipe_hash()
    if is_built(root):
        return folders(root)
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        _train_tokenizer(work / "tokenizer")
        _build_models(work / "tokenizer", work)
        shutil.rmtree(work / "tokenizer")
        (work / _MARKER).write_text(_recipe_hash())
        try:
            os.replace(work, final)
        except OSError:  # another process finished first
            if not is_built(root):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folders(root)
