"""Client helpers for the end-to-end tests: many generations through a gateway at once."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.client import AsyncGatewayClient, generation_spec
from specdec.serving import DUMP_END
from specdec.wire import pb
from specdec_cli.launch import Service

TEXT_PROMPTS = [
    "def add(a, b):\n    return",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
    "while True:\n    line = input()\n",
    "def fib(n):\n    if n < 2:\n        return n\n",
    '# Copyright\n"""Module docstring."""\n',
    "try:\n    import json\nexcept ImportError:\n",
    "x = [i * i for i in range(",
    "with open(path) as f:\n    data = f.read()\n",
]


def prompts(tokenizer: Any, n: int = 20, seed: int = 0) -> list[list[int]]:
    """n prompts as token ids: the text prompts, then seeded random ids of varied length."""
    import random

    out = [list(tokenizer.encode(t)) for t in TEXT_PROMPTS][:n]
    rng = random.Random(seed)
    while len(out) < n:
        out.append([rng.randrange(1, tokenizer.vocab_size) for _ in range(rng.randrange(3, 60))])
    return out


def spec(
    prompt: list[int],
    max_tokens: int,
    gamma: int | None = None,
    drafter: str = "",
    request_id: str = "",
    **sampling: Any,
) -> "pb.GenerationSpec":
    return generation_spec(
        prompt, max_tokens=max_tokens, gamma=gamma, drafter=drafter, request_id=request_id, **sampling
    )


async def _generate_all(
    address: str, specs: list["pb.GenerationSpec"], concurrency: int
) -> list["pb.GenerateResponse"]:
    sem = asyncio.Semaphore(concurrency)
    async with AsyncGatewayClient(address, timeout_s=600) as client:

        async def one(s: "pb.GenerationSpec") -> "pb.GenerateResponse":
            async with sem:
                return await client.generate(s)

        return await asyncio.gather(*(one(s) for s in specs))


def generate_all(address: str, specs: list["pb.GenerationSpec"], concurrency: int = 16) -> list["pb.GenerateResponse"]:
    """Run every spec through the gateway, `concurrency` at a time; responses in spec order."""
    return asyncio.run(_generate_all(address, specs, concurrency))


def _metrics_text(port: int, host: str = "127.0.0.1") -> str:
    return urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """{sample name with labels: value} from a service's /metrics (served on `host`)."""
    out = {}
    for family in text_string_to_metric_families(_metrics_text(port, host)):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def scrape_families(port: int) -> set[str]:
    """The metric family names on a service's /metrics, sampled or not: counters without
    _total, and without the X_created series the text format shows as families of their own."""
    families = {family.name for family in text_string_to_metric_families(_metrics_text(port))}
    return {name for name in families if not (name.endswith("_created") and name[: -len("_created")] in families)}


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait until `condition()` holds (checked every 0.1 s): the event itself, not a guess of
    how long it takes; fails after `timeout_s`, a bound far above the expected time."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.1)


def stall_report(svc: Service) -> str:
    """What `svc`, a service that answers nothing, is doing, for a failure message: its
    specdec:*_sessions / engine gauges (when it serves /metrics) and every thread's stack, which
    SIGUSR1 makes it write to its log (specdec.serving.serve; docs/observability.md)."""
    parts = [f"{svc.kind} {svc.address} (pid {svc.proc.pid}, log {svc.log_path})"]
    if svc.metrics_port:
        try:
            gauges = {k: v for k, v in scrape(svc.metrics_port).items() if "sessions" in k or "engine_" in k}
            parts.append(f"gauges: {gauges}")
        except OSError as err:
            parts.append(f"its /metrics did not answer either: {err}")
    if svc.log_path is None or svc.proc.poll() is not None:
        return "\n".join([*parts, "no stacks: it has no log, or has exited"])
    path = svc.log_path
    start = path.stat().st_size
    os.kill(svc.proc.pid, signal.SIGUSR1)

    def since_signal() -> str:
        with open(path, "rb") as log:
            log.seek(start)
            return log.read().decode(errors="replace")

    # the dump is whole once its last line is in (serving.dump_stacks)
    try:
        wait_for(lambda: DUMP_END in since_signal(), 30, f"{svc.kind}'s stack dump in its log")
    except AssertionError as err:
        parts.append(str(err))
    return "\n".join([*parts, "its threads' stacks:\n" + since_signal()[-12000:]])
