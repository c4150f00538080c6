"""Real-model check (slow, `make test-slow`): the qwen-coder drafter inside the memory limit of
the shipped manifests' drafter pod.

The limit is read from deploy/k8s/base/drafter.yaml (what ships, not a copy of it); the drafter
(`specdec serve drafter --model qwen-coder/draft`, every other setting its default, as the pod
runs it) is started in a memory cgroup of that limit made here (root; cgroup v2, or v1's memory
controller), as the kubelet would. It must come up serving (before drafter.memory the int8 load
peaked at ~6.5 GiB, and the kernel killed it at 6 GiB), and its keys/values budget must come
from that limit: 85 % of it, less what the loaded drafter holds and the prefix cache's 512 MiB
(drafter.memory's auto budget), so that the sessions it admits fit beside its weights.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from gen import scrape

from drafter.memory import AUTO_SHARE
from specdec.models import resolve
from specdec_cli.launch import Service, free_port, start_service

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CGROUP = Path("/sys/fs/cgroup")
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


def _memory_cgroup(limit: int) -> tuple[Path, Path] | None:
    """A new memory cgroup with `limit`: (its folder, the file a pid is written to to join it);
    None where this process cannot make one."""
    if os.geteuid() != 0:
        return None
    name = f"specdec-test-{uuid.uuid4().hex[:8]}"
    if (CGROUP / "cgroup.controllers").exists():  # v2
        if "memory" not in (CGROUP / "cgroup.subtree_control").read_text().split():
            return None
        group, limit_file = CGROUP / name, "memory.max"
    elif (CGROUP / "memory").is_dir():  # v1
        group, limit_file = CGROUP / "memory" / name, "memory.limit_in_bytes"
    else:
        return None
    try:
        group.mkdir()
        (group / limit_file).write_text(str(limit))
    except OSError:
        return None
    return group, group / "cgroup.procs"


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, int]]:
    limit = manifest_limit()
    made = _memory_cgroup(limit)
    if made is None:
        pytest.skip("needs root and a writable memory cgroup (v2 with the memory controller, or v1)")
    group, procs = made
    resolve("qwen-coder/draft")  # pulled before the clock starts
    logs = tmp_path_factory.mktemp("drafter-pod")
    svc = start_service(
        "drafter",
        free_port(),
        ["--model", "qwen-coder/draft"],
        logs,
        metrics_port=free_port(),
        # join the cgroup, then become the drafter: everything it allocates is counted there
        prefix=["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh"],
    )
    try:
        svc.wait_ready(600)
        yield svc, limit
    finally:
        svc.stop()
        try:
            group.rmdir()
        except OSError:
            pass


def test_the_drafter_serves_within_the_pods_limit_and_sizes_its_budget_from_it(pod: tuple[Service, int]) -> None:
    svc, limit = pod
    assert svc.proc.poll() is None, "the drafter exited (killed for memory?)"
    got = scrape(svc.metrics_port)
    held = got["process_resident_memory_bytes"]
    budget = got["specdec:drafter_kv_cache_budget_bytes"]
    # the auto budget: a share of the limit, less what the drafter held once loaded (about what it
    # holds now: it has served nothing) and the prefix cache's budget
    expected = limit * AUTO_SHARE - held - (512 << 20)
    assert abs(budget - expected) < 256 << 20, (budget, expected)
    assert held + budget + (512 << 20) < limit  # weights, sessions and the prefix cache fit the pod
