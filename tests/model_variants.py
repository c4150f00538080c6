"""Variants of a tiny model for compatibility tests, each saved as a checkpoint folder:

padded          the same model and tokenizer, its embedding and output layers padded with
                rows past the tokenizer (as Qwen2.5-7B's 152064 rows over 151665 tokens)
other_vocab     one token added to the tokenizer (another vocabulary), the model resized
other_eos       the same vocabulary, another token as EOS
small_qwen2     (in memory) a random-init Qwen2 with the qwen-coder draft's kind of attention
"""

from __future__ import annotations

from pathlib import Path


def _load(folder: Path):  # -> (model, tokenizer)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def padded(folder: Path, dest: Path, rows: int) -> Path:
    """`folder`'s model with `rows` embedding rows (>= its tokenizer's size)."""
    model, tok = _load(folder)
    model.resize_token_embeddings(rows, mean_resizing=False)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def other_vocab(folder: Path, dest: Path, token: str = "<|specdec-extra|>") -> Path:
    """`folder`'s model with one more token in its tokenizer (and one more row)."""
    model, tok = _load(folder)
    tok.add_tokens([token])
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def other_eos(folder: Path, dest: Path, eos_id: int = 1) -> Path:
    """`folder`'s model whose tokenizer ends sequences with token `eos_id` instead."""
    model, tok = _load(folder)
    tok.eos_token = tok.convert_ids_to_tokens(eos_id)
    model.config.eos_token_id = eos_id
    model.generation_config.eos_token_id = eos_id
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


# a small decoder's shape: 2 layers of width 64, grouped-query attention (4 heads over 2 KV heads)
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def small_qwen2(vocab: int):  # -> a Qwen2ForCausalLM in eval mode
    """A random-init Qwen2 of the SMALL shape (seed 0): biased q/k/v and grouped-query
    attention, as the qwen-coder draft groups 14 heads over 2."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, **SMALL)).eval()
