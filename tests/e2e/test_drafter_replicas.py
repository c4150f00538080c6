"""Drafter replicas behind one gateway, as the shipped Kubernetes manifests run them.

Two drafters (tiny draft-mid) on the same port of two loopback addresses (127.0.0.1 and
127.0.0.2), one verifier, and two gateways with the settings users get (no test-only flag):
  - "list": `--drafter-address 127.0.0.1:P,127.0.0.2:P` (a static list);
  - "dns":  `--drafter-address dns:///drafters.specdec.test:P`, the form of
    deploy/k8s/base/gateway.yaml. The name resolves to both addresses through a hosts file
    of the gateway's own: it runs in a private mount namespace (`unshare -m`) with that file
    bound over /etc/hosts, as `ip netns exec` does with /etc/netns/NAME/hosts (root only).

The case, for each gateway:
  - both drafters get requests, every output is exact (plain vLLM's) and none falls back;
  - a conversation's second turn (a long prompt: the first turn's prompt and output, and more)
    goes to the drafter of its first (prefix affinity), which reuses the first turn's keys;
  - one drafter is SIGKILLed; once the gateway's health check has seen it
    (specdec:gateway_replicas{pool="drafter",state="serving"} == 1), every new request
    speculates on the live one with no fallback, and every output is exact.

Before the fix, the dns gateway's drafter pool never resolved (every request failed with
"coroutine raised StopIteration"), and the list gateway kept choosing the dead drafter (its
requests fell back to plain decoding).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Services, vllm_reference
from gen import generate_all, prompts, scrape, spec, wait_for
from transformers import AutoTokenizer

from specdec_cli.launch import Service, free_port, start_service

N = 8
MAX_TOKENS = 48
CONVERSATIONS = 4
LONG_PROMPT_TOKENS = 300  # past the gateway's default prefix_affinity_tokens (256)
NAME = "drafters.specdec.test"
HOSTS = ("127.0.0.1", "127.0.0.2")


def _private_hosts_unavailable() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "a private /etc/hosts needs root and unshare (util-linux)"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare -m failed: {probe.stderr.strip()}"


pytestmark = pytest.mark.skipif(_private_hosts_unavailable() is not None, reason=str(_private_hosts_unavailable()))


def with_hosts(hosts_file: Path) -> list[str]:
    """A command prefix: run in a private mount namespace with `hosts_file` as /etc/hosts."""
    return ["unshare", "-m", "sh", "-c", f'mount --bind "{hosts_file}" /etc/hosts && exec "$@"', "sh"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    logs = tmp_path_factory.mktemp("drafter-replicas")
    hosts = logs / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{h} {NAME}\n" for h in HOSTS))
    s = Services(logs)
    try:
        verifier = s._start("verifier", ["--model", "tiny/target", "--threads", "1"])
        port = free_port()
        drafters = []
        for host in HOSTS:
            d = start_service(
                "drafter",
                port,
                ["--model", "tiny/draft-mid", "--threads", "1", "--host", host],
                logs / host,
                metrics_port=free_port(),
            )  # a folder each: the log is named by port
            d.host = host
            s.started.append(d)
            drafters.append(d)
        gateways = {"list": s.start_gateway(",".join(d.address for d in drafters), verifier.address)}
        rest_port = free_port()
        g = start_service(
            "gateway",
            free_port(),
            [
                "--tokenizer",
                "tiny/target",
                "--drafter-address",
                f"dns:///{NAME}:{port}",
                "--verifier-address",
                verifier.address,
                "--rest-port",
                str(rest_port),
            ],
            logs,
            metrics_port=free_port(),
            prefix=with_hosts(hosts),
        )
        g.rest_port = rest_port
        s.started.append(g)
        gateways["dns"] = g
        s.ready()
        yield {"drafters": drafters, "gateways": gateways}
    finally:
        s.stop()


@pytest.fixture(scope="module")
def cases(tiny_target: Path) -> tuple[list[list[int]], list[list[int]]]:
    ps = prompts(AutoTokenizer.from_pretrained(tiny_target), N, seed=11)
    ref = vllm_reference(
        tiny_target, [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in ps]
    )
    return ps, ref


def serving_drafters(gateway: Service) -> float:
    return scrape(gateway.metrics_port)["specdec:gateway_replicas{pool=drafter,state=serving}"]


def sessions(drafter: Service) -> float:
    """Draft sessions the drafter opened (one per generation sent to it)."""
    return scrape(drafter.metrics_port, drafter.host)["specdec:drafter_requests_total"]


def run(gateway: Service, ps: list[list[int]]) -> list:
    return generate_all(gateway.address, [spec(p, MAX_TOKENS, ignore_eos=True) for p in ps], concurrency=N)


def check(outs: list, ref: list[list[int]]) -> None:
    assert [list(o.token_ids) for o in outs] == ref
    # no request lost its drafter: a dead one chosen ends in "drafter UNAVAILABLE: ...", none serving in
    # "no drafter replica serves". (How much each drafts is adaptive gamma's call: on the tiny pair,
    # whose verify step costs about one step per token, it soon verifies few drafts.)
    assert [o.stats.fallback_reason for o in outs] == [""] * len(outs)


def test_drafter_replicas_behind_a_list_and_a_name(stack, cases, tiny_target: Path) -> None:
    ps, ref = cases
    drafters, gateways = stack["drafters"], stack["gateways"]
    for kind, gateway in gateways.items():  # both pools resolved and checked: both drafters serve
        wait_for(lambda g=gateway: serving_drafters(g) == 2, 60, f"the {kind} gateway sees 2 drafters")
    before = [sessions(d) for d in drafters]
    for gateway in gateways.values():
        outs = []
        for _ in range(2):  # 16 requests: each drafter is picked with overwhelming probability
            outs += run(gateway, ps)
        check(outs, ref + ref)
    got = [sessions(d) - b for d, b in zip(drafters, before, strict=True)]
    print(f"generations per drafter over both gateways: {got}")
    assert sum(got) == 2 * 2 * N and min(got) > 0, got

    # a conversation's turns meet their drafter again (prefix affinity, gateway.pool): each turn 2
    # reuses turn 1's keys from that drafter's prefix cache (with either drafter at random, all
    # CONVERSATIONS x 2 gateways would do so with probability 2^-8)
    vocab = AutoTokenizer.from_pretrained(tiny_target).vocab_size
    for kind, gateway in gateways.items():
        for c in range(CONVERSATIONS):
            rng = random.Random(f"{kind}-{c}")
            first = [rng.randrange(1, vocab) for _ in range(LONG_PROMPT_TOKENS)]
            (one,) = run(gateway, [first])
            (two,) = run(gateway, [first + list(one.token_ids) + [rng.randrange(1, vocab) for _ in range(20)]])
            assert two.stats.drafter_reused_tokens >= LONG_PROMPT_TOKENS - 1, (kind, c, two.stats)

    victim, live = drafters
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(timeout=30)
    for kind, gateway in gateways.items():  # the next health check marks it
        wait_for(lambda g=gateway: serving_drafters(g) == 1, 60, f"the {kind} gateway sees the dead drafter")
    before_live = sessions(live)
    for gateway in gateways.values():
        check(run(gateway, ps), ref)
    assert sessions(live) - before_live == 2 * N  # every new generation went to the live drafter
