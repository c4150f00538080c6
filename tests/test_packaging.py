"""Packaging by role: `pip install .[drafter]` and `.[gateway]` alone install and serve, without vLLM.

Each role gets a fresh virtual environment holding only `pip install -e <checkout>[ROLE]`,
from a copy of the work tree as a fresh clone has it (no .venv, no generated stubs), so
the stubs are compiled the way a new host compiles them (`python -m specdec.wire`, what
`make protos` runs). Then `specdec serve ROLE` starts on the tiny pair and must answer the
gRPC health check with SERVING; the gateway's REST bridge must answer too.

Slow (minutes: packages come from the index or pip's cache; torch from the local wheel
folder): `pytest tests/test_packaging.py -m slow -o addopts='' -s`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from specdec.config import cache_dir
from specdec.models import resolve
from specdec_cli.launch import Service, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parent.parent
# What a fresh clone does not have (build outputs, environments, caches, logs).
NOT_IN_CLONE = {
    ".git",
    ".venv",
    ".tools",
    "node_modules",
    "__pycache__",
    ".pytest_cache",
    ".specdec-cache",
    "logs",
    "bench-results",
    "build",
    "dist",
    "site",
}
INSTALL_TIMEOUT_S = 1200
READY_TIMEOUT_S = 180


def _checkout(dest: Path) -> Path:
    """Copy the work tree into `dest` as a fresh clone would be: no venv, no stubs in specdec/v1."""

    def ignore(folder: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n in NOT_IN_CLONE or n.endswith(".egg-info")}
        if Path(folder) == REPO / "specdec":
            skip.add("v1")  # generated from protos/, gitignored
        return skip

    shutil.copytree(REPO, dest, ignore=ignore)
    return dest


def _env(venv: Path) -> dict[str, str]:
    """This process's environment (pip's find-links and index settings included), pointed at `venv`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["SPECDEC_CACHE_DIR"] = str(cache_dir())  # the user's cache: the tiny pair is not rebuilt
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _role_venv(tmp_path: Path, role: str) -> tuple[Path, dict[str, str], Path]:
    """A fresh venv with only `pip install -e <fresh checkout>[role]`; returns (venv, env, checkout)."""
    src = _checkout(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = _env(venv)
    py = str(venv / "bin" / "python")
    start = time.monotonic()
    done = _run([py, "-m", "pip", "install", "-q", "-e", f"{src}[{role}]"], env, tmp_path, INSTALL_TIMEOUT_S)
    assert done.returncode == 0, f"pip install -e .[{role}] failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    print(f"\n[{role}] pip install -e .[{role}] into a fresh venv: {time.monotonic() - start:.0f} s")
    check = _run([py, "-m", "pip", "check"], env, tmp_path, 120)
    assert check.returncode == 0, f"pip check in the {role} venv:\n{check.stdout}{check.stderr}"
    return venv, env, src


def _absent(py: str, module: str, env: dict[str, str], cwd: Path) -> None:
    done = _run([py, "-c", f"import {module}"], env, cwd, 120)
    assert done.returncode != 0 and f"No module named '{module}'" in done.stderr, (
        f"`import {module}` should fail in this venv:\n{done.stdout}{done.stderr}"
    )


def _compile_stubs(py: str, env: dict[str, str], cwd: Path, src: Path) -> None:
    """What `make protos` runs; needs grpcio-tools, which every role installs."""
    done = _run([py, "-m", "specdec.wire"], env, cwd, 300)
    assert done.returncode == 0, f"python -m specdec.wire failed:\n{done.stdout}{done.stderr}"
    assert (src / "specdec" / "v1" / "drafter_pb2_grpc.py").is_file()


def _serve(venv: Path, env: dict[str, str], cwd: Path, kind: str, args: list[str]) -> Service:
    port = free_port()
    log_path = cwd / f"{kind}.log"
    cmd = [str(venv / "bin" / "specdec"), "serve", kind, "--port", str(port), "--metrics-port", "0", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    return Service(kind, port, proc, log_path)


def _serve_until_ready_then_stop(svc: Service, check: Callable[[], None] | None = None) -> None:
    try:
        start = time.monotonic()
        try:
            svc.wait_ready(READY_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as err:
            pytest.fail(f"{err}\n{svc.log_path.read_text()[-4000:] if svc.log_path else ''}")
        print(f"[{svc.kind}] health check SERVING {time.monotonic() - start:.1f} s after start")
        if check is not None:
            check()
    finally:
        svc.stop()
    assert svc.proc.returncode == 0, f"{svc.kind} exited {svc.proc.returncode}:\n{svc.log_path.read_text()[-4000:]}"


def _get(url: str, timeout_s: float = 30.0) -> tuple[int, bytes]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                return resp.status, resp.read()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture(scope="module")
def tiny_pair() -> None:
    """Build the tiny pair in the user's cache with this environment, so role venvs only read it."""
    resolve("tiny/target")


def test_drafter_extra_serves_without_vllm(tmp_path: Path, tiny_pair: None) -> None:
    venv, env, src = _role_venv(tmp_path, "drafter")
    py = str(venv / "bin" / "python")
    _absent(py, "vllm", env, tmp_path)
    _compile_stubs(py, env, tmp_path, src)
    svc = _serve(venv, env, tmp_path, "drafter", ["--model", "tiny/draft-mid", "--threads", "1"])
    _serve_until_ready_then_stop(svc)


def test_gateway_extra_serves_without_vllm_or_torch(tmp_path: Path, tiny_pair: None) -> None:
    venv, env, src = _role_venv(tmp_path, "gateway")
    py = str(venv / "bin" / "python")
    _absent(py, "vllm", env, tmp_path)
    _absent(py, "torch", env, tmp_path)  # a gateway only tokenizes
    _compile_stubs(py, env, tmp_path, src)
    rest_port = free_port()
    # peers need not be up: the gateway connects to them per request
    svc = _serve(
        venv,
        env,
        tmp_path,
        "gateway",
        [
            "--tokenizer",
            "tiny/target",
            "--drafter-address",
            f"127.0.0.1:{free_port()}",
            "--verifier-address",
            f"127.0.0.1:{free_port()}",
            "--rest-port",
            str(rest_port),
        ],
    )

    def rest_bridge_answers() -> None:  # fastapi, pydantic, uvicorn and prometheus-client in use
        status, body = _get(f"http://127.0.0.1:{rest_port}/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny/target"
        status, body = _get(f"http://127.0.0.1:{rest_port}/metrics/")
        assert status == 200 and b"specdec" in body

    _serve_until_ready_then_stop(svc, rest_bridge_answers)
