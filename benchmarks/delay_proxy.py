"""A userspace TCP delay proxy: one-way delay on a link where the kernel has no netem.

    python -m benchmarks.delay_proxy --listen HOST:PORT --upstream HOST:PORT --delay-ms D

prints one line, `ready`, on stdout once it listens, and runs until SIGTERM or SIGINT.
`specdec bench-link` (benchmarks/link.py) puts one on each link it delays.

Terms:
    connection  one accepted client connection and the one upstream connection the proxy
                opens for it; connections never share state.
    direction   client -> upstream, or upstream -> client; each is handled alone.
    chunk       the bytes one read returned (at most READ_BYTES). A chunk read at time t is
                written to the other side no earlier than t + delay, and after every chunk
                read before it in the same direction (order is kept).
    one-way delay  `delay_ms`: what the proxy adds in each direction; a request and its answer
                through one proxy so gain 2 x delay_ms of round-trip time (RTT).

Reading never waits on the delay: a reader stamps each chunk with its due time and queues it,
and one writer per direction sleeps until the head of the queue is due, so the delay adds
latency but does not cap throughput (the queue is the bytes "in flight" on the link; TCP's
flow control still applies through the writer's drain). An end of stream (the peer's
half-close) travels the same queue: it is passed on (write_eof) once the chunks before it are
written and its own delay has passed. A connection ends when both directions have ended, or at
once when either side fails (a reset): then both sockets are closed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence

READ_BYTES = 1 << 16  # most bytes one read may return: the largest chunk


def split_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` (or `[V6]:PORT`) as (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not HOST:PORT: {text!r}")
    return host.strip("[]"), int(port)


class DelayProxy:
    """Listens on (listen_host, listen_port) and relays each connection to (upstream_host,
    upstream_port), holding every chunk for `delay_ms` in each direction (module docstring).

    `await start()` binds (port 0 picks a free one: `port` says which), `await close()` stops
    listening and ends the connections in flight."""

    def __init__(
        self, listen_host: str, listen_port: int, upstream_host: str, upstream_port: int, delay_ms: float
    ) -> None:
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, not {delay_ms}")
        self.listen_host, self.listen_port = listen_host, listen_port
        self.upstream_host, self.upstream_port = upstream_host, upstream_port
        self.delay_s = delay_ms / 1e3
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The port listened on (the one picked, when listen_port was 0)."""
        if self._server is None or not self._server.sockets:
            return self.listen_port
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Bind and start accepting connections."""
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.listen_port)

    async def close(self) -> None:
        """Stop accepting and close every connection in flight (pending chunks are dropped)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def serve_forever(self) -> None:
        """start(), then serve until cancelled."""
        await self.start()
        assert self._server is not None
        await self._server.serve_forever()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            try:
                up_r, up_w = await asyncio.open_connection(self.upstream_host, self.upstream_port)
            except OSError:
                client_w.close()  # the upstream refused: the client sees its connection end
                return
            pipes = [
                asyncio.ensure_future(self._pipe(client_r, up_w)),
                asyncio.ensure_future(self._pipe(up_r, client_w)),
            ]
            try:
                await asyncio.gather(*pipes)
            except (OSError, asyncio.IncompleteReadError):
                pass  # a reset on either side ends the connection on both
            finally:
                for p in pipes:
                    p.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
                for w in (client_w, up_w):
                    w.close()
                for w in (client_w, up_w):
                    with contextlib.suppress(Exception):
                        await w.wait_closed()
        finally:
            self._tasks.discard(task)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """One direction: a reader that stamps and queues chunks, a writer that releases them when due."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()

        async def read() -> None:
            while True:
                try:
                    data: bytes | None = await src.read(READ_BYTES)
                except OSError:
                    data = None  # a reset: passed on, in order, as the end of the connection
                queue.put_nowait((loop.time() + self.delay_s, data))  # b"": the end of the stream
                if not data:
                    return

        reader = asyncio.ensure_future(read())
        try:
            while True:
                due, data = await queue.get()
                while (wait := due - loop.time()) > 0:  # never early, whatever the timer's rounding
                    await asyncio.sleep(wait)
                if data is None:
                    raise ConnectionResetError("the other side reset the connection")
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                dst.write(data)
                await dst.drain()
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError, asyncio.IncompleteReadError):
                await reader


async def _run(proxy: DelayProxy) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await proxy.start()
    print("ready", flush=True)
    await stop.wait()
    await proxy.close()


def main(argv: Sequence[str] | None = None) -> int:
    """The process entry point (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.delay_proxy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to accept connections on")
    p.add_argument("--upstream", required=True, metavar="HOST:PORT", help="address each connection is relayed to")
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay added in each direction, ms")
    args = p.parse_args(argv)
    try:
        listen, upstream = split_address(args.listen), split_address(args.upstream)
        proxy = DelayProxy(*listen, *upstream, args.delay_ms)
    except ValueError as err:
        p.error(str(err))
    asyncio.run(_run(proxy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
