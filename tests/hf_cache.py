"""Put a local checkpoint into a Hugging Face hub cache, in the layout huggingface_hub reads
offline (no hub needed): `models--ORG--NAME/blobs/SHA`, `snapshots/COMMIT/FILE` (a link to its
blob) and `refs/REVISION` holding COMMIT."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def store(folder: Path, repo_id: str, hub_cache: Path, revision: str = "main") -> str:
    """Copy every file of `folder` into `hub_cache` as `repo_id` at `revision`; returns the
    (made-up, deterministic) commit hash the revision points to."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file() and not p.name.startswith("."))
    digest = hashlib.sha1(repo_id.encode() + revision.encode())
    for f in files:
        digest.update(f.read_bytes())
    commit = digest.hexdigest()
    repo = Path(hub_cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for f in files:
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snapshot / f.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            os.symlink(os.path.relpath(blob, link.parent), link)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit
