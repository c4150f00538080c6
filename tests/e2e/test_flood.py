"""Authentication before work, measured: a stream's token gaps while clients without a key flood
the REST bridge with large bodies, against the same kind of stream's gaps with no flood, in one
run: in each of ROUNDS rounds a quiet stream, then a flooded one, and the ratio of their mean
gaps; the test takes the median over the rounds. No timing is compared across runs, and one round
that something else disturbed does not decide. (The ratio of the pooled medians of 3 rounds, as
before, failed at 1.53 once in a full-suite run here, where alone it measured 1.20-1.28: a stream's
gaps are bimodal, tokens of one step arriving together, so that median jumps between the modes.)

The REST bridge answers 401 from the headers, before reading a body (tests/gateway/test_guard.py
counts the body reads and tokenizer calls: 0), so a flood costs the gateway's event loop, which
carries every stream, next to nothing. The flood is a separate process at the lowest CPU priority
(nice 19): on a 2-core machine its own sending must not be what is measured.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import Services
from gen import scrape

KEY = "sk-flood-3c1f"
BODY_MB = 4  # under max_request_mb (8): a 401 from the headers, not a 413
FLOODERS = 4
ROUNDS = 5  # each: one stream without the flood, then one with it
MAX_TOKENS = 96
BOUND = 1.5  # the issue's: gaps under the flood within 1.5x of the gaps without

# Each thread: connect, send headers announcing BODY_MB, then the body in 64 KiB writes until the
# server answers (or closes); count the 401s. Prints "flooding" at the first 401; stops, printing the
# count, when its stdin closes.
FLOODER = r"""
import select, socket, sys, threading
host, port, mb, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
stop = threading.Event()
count = [0]
head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {mb << 20}\r\n\r\n").encode()
chunk = b"0" * 65536
def flood():
    while not stop.is_set():
        try:
            with socket.create_connection((host, port), timeout=10) as s:
                s.sendall(head)
                sent, answer = 0, b""
                while not answer and not stop.is_set():
                    readable, writable, _ = select.select([s], [s] if sent < (mb << 20) else [], [], 1.0)
                    if readable:
                        answer = s.recv(4096) or b"closed"
                    elif writable:
                        sent += s.send(chunk)
                if answer.split(b"\r\n", 1)[0].split(b" ")[1:2] == [b"401"]:
                    count[0] += 1
                    if count[0] == 1:
                        print("flooding", flush=True)
        except OSError:
            pass
for _ in range(threads):
    threading.Thread(target=flood, daemon=True).start()
sys.stdin.read()
stop.set()
print(count[0], flush=True)
"""


@pytest.fixture(scope="module")
def gateway(services: Services) -> Iterator[Services]:
    svc = services.start_gateway(services.drafters["mid"].address, services.verifier.address, ("--api-keys", KEY))
    try:
        svc.wait_ready(120)
        yield svc
    finally:
        svc.stop()


def _gaps(rest_port: int) -> list[float]:
    """One streamed completion; the seconds between its token-carrying chunks."""
    stamps: list[float] = []
    body = {
        "model": "tiny/target",
        "prompt": [5, 6, 7, 8],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=120) as client,
        client.stream(
            "POST",
            f"http://127.0.0.1:{rest_port}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
        ) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    assert len(stamps) > 10
    return [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True)]


def test_a_flood_without_keys_does_not_slow_a_stream(gateway) -> None:
    refused_before = scrape(gateway.metrics_port).get("specdec:gateway_refused_total{reason=unauthenticated}", 0.0)
    ratios: list[float] = []  # per round: the flooded stream's mean gap / the quiet one's
    sent = 0
    for _ in range(ROUNDS):
        quiet = statistics.mean(_gaps(gateway.rest_port))
        flood = subprocess.Popen(
            [
                "nice",
                "-n",
                "19",
                sys.executable,
                "-c",
                FLOODER,
                "127.0.0.1",
                str(gateway.rest_port),
                str(BODY_MB),
                str(FLOODERS),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ,
        )
        try:
            assert flood.stdout is not None and flood.stdout.readline().strip() == "flooding"
            ratios.append(statistics.mean(_gaps(gateway.rest_port)) / quiet)
        finally:
            out, _ = flood.communicate(timeout=60)  # closes its stdin: it stops
        sent += int(out.split()[-1])
    ratio = statistics.median(ratios)
    refused = scrape(gateway.metrics_port).get("specdec:gateway_refused_total{reason=unauthenticated}", 0.0)
    print(
        f"mean token gap under a flood of {sent} unauthenticated {BODY_MB} MiB bodies ({FLOODERS} senders) "
        f"against the quiet stream before it: {', '.join(f'{r:.2f}' for r in ratios)}; median {ratio:.2f}"
    )
    assert sent > 0 and refused - refused_before >= sent  # every flood request was refused (401)
    assert ratio <= BOUND, f"gaps under the flood are {ratio:.2f}x the quiet ones"
