"""Real-model check (slow, `make test-slow`): the qwen-coder drafter inside the memory limit of
the shipped manifests' drafter pod.

The limit is read from deploy/k8s/base/drafter.yaml (what ships, not a copy of it); the drafter
(`specdec serve drafter --model qwen-coder/draft`, every other setting its default, as the pod
runs it) is started in a memory cgroup of that limit made here (root; cgroup v2, or v1's memory
controller; benchmarks.drafter_memory's), as the kubelet would. It must come up serving
(before, the int8 load peaked at 6.4 GiB, and the kernel killed it at 6 GiB), and its
keys/values budget must come from that limit: 60 % of it, less what the loaded drafter holds and
the prefix cache's 512 MiB (drafter.memory's auto budget), so that the sessions it admits fit
beside its weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from gen import scrape

from benchmarks.drafter_memory import in_cgroup, memory_cgroup
from drafter.memory import AUTO_SHARE_CGROUP
from specdec.models import resolve
from specdec_cli.launch import Service, free_port, start_service

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}


def manifest_limit() -> int:
    """The drafter container's memory limit in deploy/k8s/base/drafter.yaml, bytes."""
    for doc in yaml.safe_load_all((ROOT / "deploy/k8s/base/drafter.yaml").read_text()):
        if doc and doc.get("kind") == "Deployment":
            (container,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == "drafter"]
            value = str(container["resources"]["limits"]["memory"])
            number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", value).groups()  # type: ignore[union-attr]
            return int(number) * UNITS[unit]
    raise AssertionError("no drafter Deployment in deploy/k8s/base/drafter.yaml")


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, int]]:
    limit = manifest_limit()
    with memory_cgroup(limit) as procs:
        if procs is None:
            pytest.skip("needs root and a memory cgroup it can make (v2 with the memory controller, or v1)")
        resolve("qwen-coder/draft")  # pulled before the clock starts
        logs = tmp_path_factory.mktemp("drafter-pod")
        # the drafter joins the cgroup, then starts: everything it allocates is counted there
        args = ["--model", "qwen-coder/draft"]
        svc = start_service("drafter", free_port(), args, logs, metrics_port=free_port(), prefix=in_cgroup(procs))
        try:
            svc.wait_ready(600)
            yield svc, limit
        finally:
            svc.stop()


def test_the_drafter_serves_within_the_pods_limit_and_sizes_its_budget_from_it(pod: tuple[Service, int]) -> None:
    svc, limit = pod
    assert svc.proc.poll() is None, "the drafter exited (killed for memory?)"
    got = scrape(svc.metrics_port)
    held = got["process_resident_memory_bytes"]
    budget = got["specdec:drafter_kv_cache_budget_bytes"]
    # the auto budget: a share of the limit, less what the drafter held once loaded (about what it
    # holds now: it has served nothing) and the prefix cache's budget
    expected = limit * AUTO_SHARE_CGROUP - held - (512 << 20)
    assert abs(budget - expected) < 256 << 20, (budget, expected)
    assert held + budget + (512 << 20) < limit  # weights, sessions and the prefix cache fit the pod
