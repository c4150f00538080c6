"""A port taken under a starting service: the real gateway fails at once, before loading
anything, with EXIT_ADDRESS_IN_USE and one line naming the port, for its gRPC port and for
its REST bridge's (bound with it, so no later bind can lose a race), its health probes' and
its /metrics'."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from specdec.errors import EXIT_ADDRESS_IN_USE
from specdec_cli.launch import free_port


@pytest.fixture
def held() -> Iterator[int]:
    """A port another process holds (listening)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.mark.parametrize("which", ["--port", "--rest-port", "--health-port", "--metrics-port"])
def test_a_taken_port_stops_the_gateway_at_once_naming_it(held: int, which: str) -> None:
    ports = {"--port": free_port(), "--rest-port": free_port(), "--metrics-port": 0, which: held}
    cmd = [sys.executable, "-m", "specdec_cli", "serve", "gateway"]
    cmd += [f"{flag}={port}" for flag, port in ports.items()]
    cmd += ["--tokenizer", "tiny/target", "--drafter-address", "127.0.0.1:1", "--verifier-address", "127.0.0.1:1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == EXIT_ADDRESS_IN_USE, proc.stderr
    assert last.startswith("specdec: error:") and f"127.0.0.1:{held}" in last and "Address already in use" in last
