"""Hugging Face repo ids as model references, resolved the way `vllm serve ORG/NAME` resolves them.

A *repo id* is `ORG/NAME` (letters, digits, `-`, `_`, `.`), optionally with `@REVISION` (a
branch, tag or commit; the same as `--revision`). It is resolved through `huggingface_hub`'s
`snapshot_download` into the user's Hugging Face cache:

    cache        `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub` (read when a
                 reference is resolved, not when the module is imported); its layout is
                 `models--ORG--NAME/snapshots/COMMIT/...` with `refs/REVISION` naming the commit.
    offline      `HF_HUB_OFFLINE=1` (or `TRANSFORMERS_OFFLINE=1`): only the cache is read, as in
                 an air-gapped cluster; otherwise the hub is asked, and a cached snapshot is
                 used when the hub cannot be reached.

Only what serving needs is fetched (ALLOW_PATTERNS: configs, safetensors weights, tokenizer
files); never code (`trust_remote_code` is not supported). The verifier hands vLLM the local
snapshot folder, so vLLM itself never talks to the hub.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from specdec.errors import ModelNotFoundError

# ORG/NAME as the hub allows it (huggingface_hub.utils.validate_repo_id), optional @REVISION.
REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96})(?:@(?P<revision>[\w./-]+))?$")
# The files a checkpoint is served from: configs, weights, tokenizer.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "tokenizer*"]


def split_revision(ref: str) -> tuple[str, str | None]:
    """`ORG/NAME@REV` -> (`ORG/NAME`, `REV`); any other reference -> (ref, None)."""
    m = REPO_ID.match(ref)
    if m and m.group("revision"):
        return m.group("repo"), m.group("revision")
    return ref, None


def is_repo_id(ref: str) -> bool:
    """Whether `ref` has the form of a Hugging Face repo id (ORG/NAME[@REV]); says nothing
    about whether it exists."""
    return bool(REPO_ID.match(ref)) and ".." not in ref


def cache_dir() -> Path:
    """The Hugging Face hub cache, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def offline() -> bool:
    """Whether only the cache may be read (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set true)."""
    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return any((v or "").strip().lower() in ("1", "true", "yes", "on") for v in flags)


def resolve(ref: str, revision: str | None = None) -> Path:
    """The local snapshot folder of repo id `ref` (ORG/NAME or ORG/NAME@REV) at `revision`
    (default: the @REV of `ref`, else `main`), downloaded into the cache unless offline.

    Raises ModelNotFoundError naming the id, the revision and the cache when it is neither in
    the cache nor (online) on the hub.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    repo, at = split_revision(ref)
    revision = revision or at or "main"
    cache, local_only = cache_dir(), offline()
    try:
        folder = snapshot_download(
            repo, revision=revision, cache_dir=cache, local_files_only=local_only, allow_patterns=ALLOW_PATTERNS
        )
    except HFValidationError as err:
        raise ModelNotFoundError(
            f"model {ref!r} is not a valid Hugging Face repo id ({err})",
            "pass a folder, a registry name PAIR/ROLE or ORG/NAME",
        ) from None
    except Exception as err:  # noqa: BLE001 (huggingface_hub raises many kinds: all mean "not available")
        how = (
            "HF_HUB_OFFLINE is set, so only the cache was read"
            if local_only
            else f"the hub did not provide it either ({type(err).__name__})"
        )
        raise ModelNotFoundError(
            f"model {repo!r} (revision {revision!r}) is not in the Hugging Face cache {cache}; {how}",
            f"download it into that cache first (`hf download {repo} --revision {revision}` where the hub is "
            "reachable, with the same HF_HOME), or point HF_HOME / HF_HUB_CACHE at the cache that has it",
        ) from None
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"model {repo!r} (revision {revision!r}) in {path} has no config.json",
            "it is not a transformers checkpoint vLLM can serve",
        )
    return path
