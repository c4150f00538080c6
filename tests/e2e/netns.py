"""Separate hosts on one machine for the multi-host tests: benchmarks/netns.py's Network with
the tests' names (`sd-<host>-<pid>`) and subnet (10.231.N.0/24).

    Network(["verifier", "drafter", "gateway", "client"])
    net.address("gateway")      -> "10.231.N.3"
    net.prefix("gateway")       -> ["ip", "netns", "exec", "sd-gateway-PID"]  (run a command there)
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks import netns
from benchmarks.netns import unavailable_reason

__all__ = ["Network", "unavailable_reason"]


class Network(netns.Network):
    """The tests' hosts (see the module docstring)."""

    def __init__(self, hosts: Sequence[str]) -> None:
        super().__init__(hosts, prefix="sd-", octet=231)
