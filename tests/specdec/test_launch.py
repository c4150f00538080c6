"""specdec_cli.launch's ports: `free_port` draws outside the kernel's ephemeral range, a port
taken under a service is EXIT_ADDRESS_IN_USE, and a `Cluster` starts a service again on new
ports only where it chose them itself. The processes here are plain Python one-liners, not
services (the unit tier starts none)."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from specdec.errors import EXIT_ADDRESS_IN_USE, exit_status
from specdec.serving import bind_error, bind_tcp
from specdec_cli import launch
from specdec_cli import main as cli
from specdec_cli.launch import ANY_PORT, Cluster, PortTaken, Service


def test_free_ports_are_below_the_ephemeral_range_and_never_repeat() -> None:
    low = launch._ephemeral_low()
    ports = [launch.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out (and still: nothing here took it)


def test_a_taken_port_keeps_its_errno_and_names_the_address() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(OSError) as caught:
            bind_tcp("127.0.0.1", port, "the REST port").close()
        assert caught.value.errno == errno.EADDRINUSE
        assert f"the REST port 127.0.0.1:{port}" in str(caught.value)
        err = bind_error("gateway", "its gRPC port", "127.0.0.1", port)  # what serve() raises for gRPC's 0
        assert err.errno == errno.EADDRINUSE and f"gateway: cannot bind its gRPC port 127.0.0.1:{port}" in str(err)
        message, status = cli.explain(err)
        assert status == EXIT_ADDRESS_IN_USE and f"127.0.0.1:{port}" in message and "ss -ltnp" in message
    assert cli.explain(OSError(errno.ENOSPC, "disk full"))[1] == 2


def exits_with(kind: str, port: int, status: int) -> Service:
    """A Service whose process exits with `status` at once (a stand-in for one that failed to start)."""
    return Service(kind, port, subprocess.Popen([sys.executable, "-c", f"raise SystemExit({status})"]))


@pytest.mark.parametrize("chosen", [True, False])
def test_a_cluster_starts_again_only_a_service_whose_chosen_port_was_taken(chosen: bool) -> None:
    cluster = Cluster(pair="tiny", drafter_port=ANY_PORT if chosen else 50052)
    starts: list[int] = []

    def launch_again() -> Service:  # the second start fails otherwise: the error that ends the wait
        starts.append(launch.free_port())
        return exits_with("drafter", starts[-1], 1)

    cluster.services = [exits_with("drafter", 50052, EXIT_ADDRESS_IN_USE)]
    if chosen:
        with pytest.raises(RuntimeError, match="drafter exited with exit status 1"):
            cluster._ready("drafter", launch_again, timeout_s=60)
        assert len(starts) == 1 and cluster.drafter.port == starts[0]
    else:  # a port the user gave is not swapped for another
        with pytest.raises(PortTaken, match="drafter: a port it was to bind is taken"):
            cluster._ready("drafter", launch_again, timeout_s=60)
        assert starts == []
    cluster.stop()


def test_a_port_taken_every_time_gives_up_after_port_tries() -> None:
    cluster = Cluster(pair="tiny", gateway_port=ANY_PORT)
    cluster.services = [exits_with("gateway", 1, EXIT_ADDRESS_IN_USE)]
    starts = 0

    def taken_again() -> Service:
        nonlocal starts
        starts += 1
        return exits_with("gateway", 1, EXIT_ADDRESS_IN_USE)

    with pytest.raises(PortTaken):
        cluster._ready("gateway", taken_again, timeout_s=60)
    assert starts == launch.PORT_TRIES - 1
    cluster.stop()


def test_stop_all_signals_every_service_before_waiting(tmp_path: Path) -> None:
    """stop_all stops services together: each child below, once signalled, exits 0 only after it
    sees the other one signalled too (3 after 10 s without). Stopped one after another, the first
    would wait in vain and exit 3."""
    script = (
        "trap 'touch {me}; for i in $(seq 100); do [ -e {other} ] && exit 0; sleep 0.1; done; exit 3' TERM; "
        "touch {me}.up; while :; do sleep 0.1; done"
    )
    a, b = tmp_path / "a", tmp_path / "b"
    services = [
        Service("drafter", 0, subprocess.Popen(["bash", "-c", script.format(me=a, other=b)])),
        Service("verifier", 0, subprocess.Popen(["bash", "-c", script.format(me=b, other=a)])),
    ]
    try:
        for marker in (a, b):  # both traps are set
            wait_until(lambda m=marker: Path(f"{m}.up").exists())
        launch.stop_all(services)
        assert [s.proc.returncode for s in services] == [0, 0]
    finally:
        for s in services:
            if s.proc.poll() is None:
                s.proc.kill()
                s.proc.wait()


def wait_until(done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll `done` (bounded): for a child's own marker file."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_service_killed_by_a_signal_is_named_by_its_signal() -> None:
    """A crash (SIGILL, as vLLM's AVX512 kernels on an AVX2-only CPU) reads as that signal, not as -4."""
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"])
    svc = Service("verifier", launch.free_port(), proc)
    with pytest.raises(RuntimeError, match=r"verifier exited with signal SIGILL \(Illegal instruction\)"):
        svc.wait_ready(60)
    assert exit_status(2) == "exit status 2" and exit_status(-9) == "signal SIGKILL (Killed)"
