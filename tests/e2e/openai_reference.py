"""vLLM's own OpenAI server and CLI, run as subprocesses: the reference the REST bridge is compared with.

    with vllm_openai_server(model_dir, log_dir, chat_template=...) as server:
        httpx.post(f"{server.url}/v1/completions", json={...})

The server is `python -m vllm.entrypoints.openai.api_server` (the `vllm serve` console
script fails here: it looks up package metadata named `vllm`, and the CPU build installs
as `vllm-cpu`), on CPU, at the verifier's dtype (`verifier.vllm_hooks.engine_settings`), eager,
one OpenMP thread, a 1 GiB KV cache (/work/shared/notes/vllm-cpu.md). `vllm_cli` runs vLLM's CLI
(`vllm bench serve` ...) unmodified, with that one metadata lookup answered.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from benchmarks.serve import CLI_SHIM, SERVER_SHIM  # the `vllm` CLI under the CPU wheel's distribution name
from specdec_cli.launch import free_port
from verifier.vllm_hooks import engine_settings_from_env

# Environment for vLLM on these CPU machines (/work/shared/notes/vllm-cpu.md).
VLLM_CPU_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # bound threads: ~10 tok/s
    "OMP_NUM_THREADS": "1",
    "NUMBA_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}
READY_TIMEOUT_S = 240.0
LOG_TAIL_CHARS = 4000


def log_tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as err:
        return f"(no log: {err})"


class VllmOpenAIServer:
    """One `vllm.entrypoints.openai.api_server` process serving `model_dir` as `served_name`."""

    def __init__(
        self,
        model_dir: Path,
        work_dir: Path,
        served_name: str = "tiny/target",
        chat_template: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.model_dir, self.work_dir, self.served_name = model_dir, work_dir, served_name
        self.chat_template, self.extra_args = chat_template, extra_args
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = work_dir / "vllm-openai.log"
        self.started_at = 0.0
        self.startup_s: float | None = None  # Popen to first healthy /health

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        settings = engine_settings_from_env("cpu", str(self.model_dir))
        cmd = [
            sys.executable,
            "-c",
            SERVER_SHIM,  # vLLM's server, after asking for the AMX state as the verifier does
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            settings.dtype,
            f"--max-model-len={settings.max_model_len}",  # the verifier's (-1: vLLM's auto-fit)
            "--kv-cache-memory-bytes",  # the verifier's; vLLM's utilisation check fails on these VMs
            str(settings.kv_cache_memory_bytes),
            "--enforce-eager",
            "--disable-uvicorn-access-log",
        ]
        if self.chat_template is not None:
            template = self.work_dir / "chat_template.jinja"
            template.write_text(self.chat_template)
            cmd += ["--chat-template", str(template)]
        return cmd + list(self.extra_args)

    def start(self) -> None:
        """Launch the process (returns at once; `wait_ready` waits for it)."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        env = {**os.environ, **VLLM_CPU_ENV}
        self.started_at = time.monotonic()
        with open(self.log_path, "wb") as log:
            # own session: stop() signals the whole group (the engine core is a child process)
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.work_dir, start_new_session=True
            )

    def failure(self, what: str) -> str:
        return f"vLLM OpenAI server {what}; log {self.log_path}, its tail:\n{log_tail(self.log_path)}"

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Block until GET /health is 200; returns the start-up time in seconds. Raises with the
        log's tail if the process exits or the timeout passes."""
        assert self.proc is not None, "start() first"
        deadline = self.started_at + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(self.failure(f"exited with {self.proc.returncode} before it was ready"))
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    self.startup_s = time.monotonic() - self.started_at
                    return self.startup_s
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(self.failure(f"not ready after {timeout_s:g} s"))
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM the process group (the server and its engine core), then SIGKILL what is left."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # children that outlived the leader, or a hung leader
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


@contextmanager
def vllm_openai_server(
    model_dir: Path,
    work_dir: Path,
    *,
    chat_template: str | None = None,
    served_name: str = "tiny/target",
    timeout_s: float = READY_TIMEOUT_S,
    while_starting: Callable[[], object] | None = None,
    extra_args: tuple[str, ...] = (),
) -> Iterator[VllmOpenAIServer]:
    """A ready vLLM OpenAI server; `while_starting` runs between launch and the readiness wait
    (start other things while vLLM loads). The process group is killed on exit."""
    server = VllmOpenAIServer(model_dir, work_dir, served_name, chat_template, extra_args)
    server.start()
    try:
        if while_starting is not None:
            while_starting()
        server.wait_ready(timeout_s)
        yield server
    finally:
        server.stop()


def vllm_cli(
    args: list[str],
    log_path: Path,
    timeout_s: float = 300,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    """Run `vllm ARGS...` (vLLM's own CLI, unmodified) with the CPU environment; output to `log_path`."""
    env = {**os.environ, **VLLM_CPU_ENV}
    with open(log_path, "wb") as log:
        return subprocess.run(
            [sys.executable, "-c", CLI_SHIM, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            timeout=timeout_s,
            check=False,
        )
