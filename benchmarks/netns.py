"""Separate hosts on one machine: Linux network namespaces joined by a bridge (root only).

    Network(["verifier", "drafter", "gateway"], prefix="sdl-", octet=232) makes one namespace
    per host, `PREFIX<host>-<pid>`, each with an `eth0` on a private /24 (10.OCTET.N.0/24, N
    from the process id) plugged into a bridge that lives in a namespace of its own
    (`PREFIXlan-<pid>`), and loopback up. Nothing touches the root namespace's interfaces or
    addresses; `close()` deletes the namespaces (and with them every interface made here).

    net.address("gateway")      -> "10.232.N.3"
    net.prefix("gateway")       -> ["ip", "netns", "exec", "sdl-gateway-PID"]  (run a command there)

Used by `specdec bench-link` (benchmarks/link.py) and the multi-host tests (tests/e2e/netns.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    name = f"sd-probe-{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as err:
        return f"`ip netns add` failed: {err.stderr.strip()}"
    _ip("netns", "del", name)
    return None


class Network:
    """Hosts (network namespaces) on one private bridged subnet; see the module docstring."""

    def __init__(self, hosts: Sequence[str], prefix: str = "sd-", octet: int = 231) -> None:
        pid = os.getpid()
        self.prefix_ = prefix
        self._ports = len(hosts)
        self.subnet = f"10.{octet}.{pid % 250}"
        self.lan = f"{prefix}lan-{pid}"
        self.hosts = {h: (f"{prefix}{h}-{pid}", f"{self.subnet}.{i + 1}") for i, h in enumerate(hosts)}
        self._made: list[str] = []
        try:
            self._add(self.lan)
            _ip("-n", self.lan, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.lan, "link", "set", "br0", "up")
            for i, (ns, addr) in enumerate(self.hosts.values()):
                self._add(ns)
                _ip("-n", self.lan, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.lan, "link", "set", f"p{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise

    def add_host(self, host: str) -> str:
        """One more host on the bridge (the next free address); returns its address."""
        ns = f"{self.prefix_}{host}-{os.getpid()}"
        used = {int(a.rsplit(".", 1)[1]) for _, a in self.hosts.values()}
        addr = f"{self.subnet}.{next(i for i in range(1, 200) if i not in used)}"
        port = f"p{self._ports}"
        self._ports += 1
        self._add(ns)
        _ip("-n", self.lan, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", self.lan, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        self.hosts[host] = (ns, addr)
        return addr

    def remove_host(self, host: str) -> None:
        """Delete a host (its namespace, and with it its link to the bridge)."""
        ns, _ = self.hosts.pop(host)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.remove(ns)

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    @property
    def names(self) -> list[str]:
        """The namespaces made (and not yet deleted)."""
        return list(self._made)

    def address(self, host: str) -> str:
        """The host's address on the bridge."""
        return self.hosts[host][1]

    def prefix(self, host: str) -> list[str]:
        """The command prefix that runs a command on `host`."""
        return ["ip", "netns", "exec", self.hosts[host][0]]

    def close(self) -> None:
        """Delete the namespaces (and with them every interface made here)."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()
