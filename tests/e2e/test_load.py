"""Load: 64 concurrent streaming clients for 60 s on the tiny pair, half over gRPC, half over
the REST bridge (server-sent events), through one gateway. Every request must succeed and
every greedy output must be exact; p50 / p99 latencies and throughput are printed (the
figures in docs/reliability.md come from this test: `make test` prints them with -s, or
`pytest tests/e2e/test_load.py -s`). SPECDEC_LOAD_S shortens or lengthens the run.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
from conftest import vllm_reference
from gen import prompts, spec
from transformers import AutoTokenizer

from gateway.client import AsyncGatewayClient

CLIENTS = 64
DURATION_S = float(os.environ.get("SPECDEC_LOAD_S", "60"))
MAX_TOKENS = 16


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def test_64_streaming_clients_for_a_minute(services, tiny_target: Path) -> None:
    gw = services.gateways["mid"]
    ps = prompts(AutoTokenizer.from_pretrained(tiny_target), 12, seed=21)
    ref = vllm_reference(tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS} for p in ps])  # plain vLLM
    url = f"http://127.0.0.1:{gw.rest_port}/v1/completions"

    async def run() -> tuple[list[tuple[str, float, float, bool]], list[str]]:
        results: list[tuple[str, float, float, bool]] = []  # (kind, first-token s, total s, exact)
        errors: list[str] = []
        stop_at = time.monotonic() + DURATION_S

        async def grpc_client(i: int, client: AsyncGatewayClient) -> None:
            n = i
            while time.monotonic() < stop_at:
                k = n % len(ps)
                t0, first, ids = time.monotonic(), 0.0, []
                try:
                    async for chunk in client.chunks(spec(ps[k], MAX_TOKENS, gamma=4)):
                        first = first or time.monotonic() - t0
                        ids.extend(chunk.token_ids)
                    results.append(("grpc", first, time.monotonic() - t0, ids == ref[k]))
                except Exception as err:  # noqa: BLE001 (counted, reported)
                    errors.append(f"grpc: {err!r}"[:300])
                n += 1

        async def rest_client(i: int, http: httpx.AsyncClient) -> None:
            n = i
            while time.monotonic() < stop_at:
                k = n % len(ps)
                body = {
                    "prompt": ps[k],
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "stream": True,
                    "return_token_ids": True,
                }
                t0, first, ids = time.monotonic(), 0.0, []
                try:
                    async with http.stream("POST", url, json=body) as r:
                        if r.status_code != 200:
                            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()!r}")
                        async for line in r.aiter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                event = json.loads(line[6:])
                                if "error" in event:
                                    raise RuntimeError(event["error"])
                                for choice in event.get("choices", []):
                                    first = first or time.monotonic() - t0
                                    ids.extend(choice.get("token_ids") or [])
                    results.append(("rest", first, time.monotonic() - t0, ids == ref[k]))
                except Exception as err:  # noqa: BLE001
                    errors.append(f"rest: {err!r}"[:300])
                n += 1

        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with (
            AsyncGatewayClient(gw.address, timeout_s=300) as client,
            httpx.AsyncClient(timeout=300, limits=limits) as http,
        ):
            await asyncio.gather(
                *(grpc_client(i, client) for i in range(CLIENTS // 2)),
                *(rest_client(i, http) for i in range(CLIENTS // 2)),
            )
        return results, errors

    t0 = time.monotonic()
    results, errors = asyncio.run(run())
    wall = time.monotonic() - t0
    assert errors == [], errors[:5]
    assert results and all(exact for *_, exact in results), sum(not e for *_, e in results)
    for kind in ("grpc", "rest"):
        rows = [r for r in results if r[0] == kind]
        ttft, total = [r[1] * 1e3 for r in rows], [r[2] * 1e3 for r in rows]
        print(
            f"load {kind}: {len(rows)} requests in {wall:.0f} s ({len(rows) / wall:.1f} req/s, "
            f"{len(rows) * MAX_TOKENS / wall:.0f} tok/s); "
            f"TTFT p50 {pct(ttft, 0.5):.0f} ms p99 {pct(ttft, 0.99):.0f} ms; "
            f"latency p50 {pct(total, 0.5):.0f} ms p99 {pct(total, 0.99):.0f} ms; errors 0"
        )
    assert {r[0] for r in results} == {"grpc", "rest"}
