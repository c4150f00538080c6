"""What the REST bridge's in-process call to the gateway core saves per streamed chunk, as a
ratio measured in one run.

The same streamed completions go through two REST bridges (gateway.rest.routes.build_app,
each served by uvicorn on a loopback port), on one scripted core that yields its chunks at
once, so what is timed is the path a chunk takes, not a model:

    in-process  the bridge calls the core's `generate` directly (the gateway now)
    grpc hop    the bridge calls specdec.v1.GatewayService over a unix socket, whose servicer
                (GatewayServicer) runs the same core, in the same process and event loop (the
                gateway before: REST -> gRPC client -> unix socket -> servicer -> core)

Rounds alternate the two paths; each round streams `--requests` completions of `--chunks`
chunks, `--concurrency` at a time, from an httpx client in the same event loop. Prints, per
path, the median over rounds of the CPU time per chunk (the process's, all its threads: the
client, both servers, gRPC's own threads; what the hop costs) and of the wall time per chunk,
and the ratios. CPU time is the figure to compare on a shared host: wall time there moves
with other processes' load, CPU time much less.

    python -m benchmarks.rest_hop
    python -m benchmarks.rest_hop --requests 200 --chunks 64 --concurrency 16 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import uvicorn

from gateway.client import AsyncGatewayClient
from gateway.core import Chunk, ErrorCode, GatewayError
from gateway.rest.routes import build_app
from gateway.server import GatewayServicer
from specdec.config import GatewayConfig
from specdec.security import grpc_options
from specdec.serving import SessionSlots
from specdec.wire import pb, rpc
from specdec_cli.launch import free_port


class ScriptedCore:
    """A gateway core whose every generation is `chunks` chunks of one token ("x"), yielded at
    once; the last carries usage and stats, as GatewayCore's final chunk does."""

    def __init__(self, chunks: int) -> None:
        self.n = chunks
        self.slots = SessionSlots("gateway", 0, "max_inflight")  # what GatewayServicer reads of a core
        self.cfg = SimpleNamespace(stream_write_timeout_s=0.0)

    def serving(self) -> bool:
        return True

    def ended_by_drain(self, task: asyncio.Task[Any] | None) -> str | None:
        return None  # never drained

    async def generate(
        self,
        spec: pb.GenerationSpec,
        *,
        authorization: str | None = None,
        parent: Any = None,
        deadline_s: float | None = None,
        stream: bool = False,
    ) -> AsyncGenerator[Chunk, None]:
        for i in range(self.n):
            if i < self.n - 1:
                yield Chunk("x", [7], 0, 0, pb.FINISH_REASON_UNSPECIFIED, request_id=spec.request_id)
            else:
                yield Chunk(
                    "x",
                    [7],
                    0,
                    0,
                    pb.FINISH_REASON_LENGTH,
                    request_id=spec.request_id,
                    usage=pb.Usage(prompt_tokens=len(spec.prompt_token_ids), completion_tokens=self.n),
                    stats=pb.SpeculationStats(),
                )

    async def close(self) -> None:
        pass


class GrpcHop:
    """A core reached over gRPC, as the bridge reached the gateway before: each generation is a
    GenerateStream (or Generate) call, its messages turned back into Chunks."""

    def __init__(self, address: str) -> None:
        self.client = AsyncGatewayClient(address, timeout_s=None, wait_for_ready=False)

    def serving(self) -> bool:
        return True

    def ended_by_drain(self, task: asyncio.Task[Any] | None) -> str | None:
        return None  # never drained

    async def generate(
        self,
        spec: pb.GenerationSpec,
        *,
        authorization: str | None = None,
        parent: Any = None,
        deadline_s: float | None = None,
        stream: bool = False,
    ) -> AsyncGenerator[Chunk, None]:
        metadata = (("authorization", authorization),) if authorization else ()
        try:
            if not stream:
                r = await self.client.generate(spec, metadata=metadata, timeout_s=deadline_s)
                yield Chunk(
                    r.text,
                    list(r.token_ids),
                    0,
                    0,
                    r.finish_reason,
                    list(r.logprobs),
                    r.request_id,
                    usage=r.usage,
                    stats=r.stats,
                    first_token_ms=r.first_token_ms,
                    total_ms=r.total_ms,
                )
                return
            call = self.client.stream(spec, metadata=metadata, timeout_s=deadline_s)
            try:
                async for m in call:
                    yield Chunk(
                        m.text,
                        list(m.token_ids),
                        m.drafted,
                        m.accepted,
                        m.finish_reason,
                        list(m.logprobs),
                        m.request_id,
                        usage=m.usage if m.HasField("usage") else None,
                        stats=m.stats if m.HasField("stats") else None,
                    )
            finally:
                call.cancel()
        except grpc.aio.AioRpcError as err:
            raise GatewayError(ErrorCode[err.code().name], err.details() or "") from err


class Tok:
    """What the bridge asks of a tokenizer for a token-id prompt: its text."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


async def _serve(app: Any) -> tuple[uvicorn.Server, asyncio.Task[None], str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    return server, task, f"http://127.0.0.1:{port}"


async def _round(
    client: httpx.AsyncClient, url: str, requests: int, concurrency: int, chunks: int
) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per chunk of one round: `requests` streamed completions,
    `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)
    body = {"prompt": [1, 2, 3], "max_tokens": chunks, "stream": True}

    async def one() -> int:
        async with gate, client.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            got = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"choices":[{' in line.replace(" ", ""):
                    got += 1
            return got

    t0, cpu0 = time.perf_counter(), time.process_time()
    got = await asyncio.gather(*(one() for _ in range(requests)))
    cpu, took = time.process_time() - cpu0, time.perf_counter() - t0
    if set(got) != {chunks}:
        raise RuntimeError(f"expected {chunks} chunk events per stream, got {sorted(set(got))}")
    return cpu / (requests * chunks), took / (requests * chunks)


async def measure(requests: int, chunks: int, concurrency: int, rounds: int) -> dict[str, Any]:
    core = ScriptedCore(chunks)
    folder = tempfile.mkdtemp(prefix="specdec-rest-hop-")
    address = f"unix:{folder}/grpc.sock"
    grpc_server = grpc.aio.server(options=grpc_options(GatewayConfig(), server=True))
    rpc.add_GatewayServiceServicer_to_server(GatewayServicer(core), grpc_server)  # type: ignore[arg-type]  # a ScriptedCore stands in for the GatewayCore (slots, cfg, generate: what the servicer reads)
    grpc_server.add_insecure_port(address)
    await grpc_server.start()
    hop = GrpcHop(address)
    servers = {
        name: await _serve(build_app(c, Tok(), "m"))  # both are a gateway.core.Core
        for name, c in (("in-process", core), ("grpc hop", hop))
    }
    per_chunk: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}  # (cpu, wall) per round
    try:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            for _, _, url in servers.values():  # warm-up: connections, imports, first calls
                await _round(client, url, concurrency, concurrency, chunks)
            for _ in range(rounds):
                for name, (_, _, url) in servers.items():
                    per_chunk[name].append(await _round(client, url, requests, concurrency, chunks))
    finally:
        for server, task, _ in servers.values():
            server.should_exit = True
            await task
        await hop.client.close()
        await grpc_server.stop(0)
        shutil.rmtree(folder, ignore_errors=True)
    out: dict[str, Any] = {"requests": requests, "chunks": chunks, "concurrency": concurrency, "rounds": rounds}
    for i, kind in enumerate(("cpu", "wall")):
        us = {name: statistics.median(v[i] for v in values) * 1e6 for name, values in per_chunk.items()}
        out[f"in_process_{kind}_us_per_chunk"] = round(us["in-process"], 1)
        out[f"grpc_hop_{kind}_us_per_chunk"] = round(us["grpc hop"], 1)
        out[f"saved_{kind}_us_per_chunk"] = round(us["grpc hop"] - us["in-process"], 1)
        out[f"{kind}_ratio"] = round(us["grpc hop"] / us["in-process"], 2)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=100, help="streamed completions per round")
    parser.add_argument("--chunks", type=int, default=64, help="chunks (one token each) per completion")
    parser.add_argument("--concurrency", type=int, default=16, help="completions streamed at once")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per path, alternating; the median is kept")
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.requests, args.chunks, args.concurrency, args.rounds))
    for kind in ("cpu", "wall"):
        print(
            f"{kind:>4}: in-process {result[f'in_process_{kind}_us_per_chunk']:.1f} us per REST chunk, "
            f"grpc hop {result[f'grpc_hop_{kind}_us_per_chunk']:.1f} us: "
            f"the hop costs {result[f'{kind}_ratio']:.2f}x "
            f"({result[f'saved_{kind}_us_per_chunk']:.1f} us saved per chunk)"
        )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
