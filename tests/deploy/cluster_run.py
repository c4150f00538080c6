"""Run deploy/k8s as shipped on the small kubelet (tests/deploy/kubelet.py) and drive it as a
client would; run by tests/deploy/test_cluster.py (root only).

    python tests/deploy/cluster_run.py CONFIG.json   ->  one JSON line per phase on stdout

CONFIG: {"kustomization": folder to render, "dockerfile": path, "claims": {claim: folder},
"secrets": {name: {key: text}}, "bin_dir": the entry point's folder, "log_dir": folder,
"prompts": [[token ids]...], "max_tokens": N, "stream_tokens": N, "api_key": key,
"tls": {"ca"[, "cert", "key"]} or null}.

Phases (each line {"phase": ..., ...}):
    up          every Deployment's pods Ready (the events of the start)
    dns         what the cluster DNS answers for each Service name (asked from a pod)
    exact       the prompts through the gateway Service's REST port: token ids per prompt
    scale-out   one more drafter pod and verifier pod; requests until both served one;
                seconds from their Ready to that, and generations per pod
    roll        8 streams of stream_tokens each; once each has its first tokens, one pod of
                each Deployment is deleted as Kubernetes does. Per stream: token ids, error,
                when it ended and when its last tokens came (seconds after the deletion);
                when SIGTERM went out and how many streams were open then
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kubelet import Cluster, render  # noqa: E402

# the counters that say a pod served a generation: /metrics family by Deployment
SERVED = {
    "drafter": "specdec:drafter_requests_total",
    "verifier": "specdec:verifier_requests_total",
    "gateway": "specdec:requests_total",
}


def emit(phase: str, **data: Any) -> None:
    print(json.dumps({"phase": phase, **data}), flush=True)


def metrics_port(pod: Any) -> int:
    for c in pod.containers:
        for p in c.spec.get("ports", []):
            if p.get("name") == "metrics":
                return int(p["containerPort"])
    raise KeyError(pod.name)


def served(pod: Any) -> float:
    """Generations a pod served, from its own /metrics (a failed scrape: the pod is gone)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(f"http://{pod.ip}:{metrics_port(pod)}/metrics", timeout=5).read().decode()
    except OSError:
        return -1.0
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == SERVED[pod.deployment]
    )


class Client:
    """The OpenAI-compatible REST API through the gateway Service (its ClusterIP)."""

    def __init__(self, base: str, api_key: str, tls: dict[str, str] | None, server_name: str) -> None:
        import httpx

        # TLS: the certificate names the Service, not its ClusterIP (as a client that resolved the name)
        self.ext = {"sni_hostname": server_name} if tls else {}
        kw: dict[str, Any] = {"timeout": httpx.Timeout(600.0)}
        if tls:
            kw["verify"] = tls["ca"]
            if tls.get("cert"):
                kw["cert"] = (tls["cert"], tls["key"])
        self.http = httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {api_key}"}, **kw)
        self.model = ""

    async def connect(self) -> None:
        """The served model's name, from /v1/models (as an OpenAI client finds it)."""
        r = await self.http.get("/v1/models", extensions=self.ext)
        r.raise_for_status()
        self.model = r.json()["data"][0]["id"]

    def body(self, prompt: list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        }

    async def complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        r = await self.http.post("/v1/completions", json=self.body(prompt, max_tokens, False), extensions=self.ext)
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text}")
        return list(r.json()["choices"][0]["token_ids"])

    async def stream(
        self, prompt: list[int], max_tokens: int, first: asyncio.Event, progress: list[tuple[float, int]]
    ) -> dict[str, Any]:
        """One streamed completion: {"ids", "finish", "error", "ended"} (`ended`: time.monotonic()
        at its end). `first` is set at its first chunk (or its end); `progress` gets
        (time.monotonic(), tokens so far) at each chunk."""
        ids: list[int] = []
        finish = None
        try:
            async with self.http.stream(
                "POST", "/v1/completions", json=self.body(prompt, max_tokens, True), extensions=self.ext
            ) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:  # an error after the first byte (the status line is gone)
                        error = f"error event: {event['error']}"
                        return {"ids": ids, "finish": finish, "error": error, "ended": time.monotonic()}
                    choice = event["choices"][0]
                    ids += choice.get("token_ids") or []
                    finish = choice.get("finish_reason") or finish
                    progress.append((time.monotonic(), len(ids)))
                    first.set()
        except Exception as err:  # noqa: BLE001 (a broken stream is what this counts)
            return {"ids": ids, "finish": finish, "error": f"{type(err).__name__}: {err}", "ended": time.monotonic()}
        finally:
            first.set()
        error = None if finish else "the stream ended with no finish_reason"
        return {"ids": ids, "finish": finish, "error": error, "ended": time.monotonic()}


def drain_window(deployment: dict[str, Any]) -> tuple[float, float]:
    """(preStop sleep, SPECDEC_SHUTDOWN_TIMEOUT_S) of a rendered Deployment's first container,
    in seconds: a pod deleted keeps serving its open streams for the first, then finishes
    them for up to the second (the drain)."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    sleep = float(command[1]) if command[:1] == ["sleep"] else 0.0
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    return sleep, float(env.get("SPECDEC_SHUTDOWN_TIMEOUT_S") or 30.0)


async def main(cfg: dict[str, Any]) -> None:
    cluster = Cluster(
        render(Path(cfg["kustomization"])),
        Path(cfg["dockerfile"]),
        {k: Path(v) for k, v in cfg["claims"].items()},
        cfg["secrets"],
        Path(cfg["bin_dir"]),
        Path(cfg["log_dir"]),
    )
    try:
        t0 = time.monotonic()
        await cluster.start()
        await cluster.wait_ready(None, len(cluster.pods), 900)
        emit("up", seconds=round(time.monotonic() - t0, 1), pods=sorted(cluster.pods), events=cluster.events)

        names = {
            svc["metadata"]["name"]: f"{svc['metadata']['name']}.{cluster.namespace}.svc.cluster.local"
            for svc in cluster.services
        }
        asker = next(p for p in cluster.pods.values() if p.deployment == "gateway")
        code = (
            "import json, socket, sys\nout = {}\nfor n in sys.argv[1:]:\n"
            "    out[n] = sorted({i[4][0] for i in socket.getaddrinfo(n, 1, type=socket.SOCK_STREAM)})\n"
            "print(json.dumps(out))"
        )
        answer = subprocess.run(
            ["ip", "netns", "exec", asker.netns, sys.executable, "-c", code, *names.values()],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        emit("dns", answers=json.loads(answer), pods={p.name: p.ip for p in cluster.pods.values()})

        gateway = next(s for s in cluster.services if s["metadata"]["name"] == "gateway")
        port = next(p["port"] for p in gateway["spec"]["ports"] if p["name"] == "http")
        scheme = "https" if cfg["tls"] else "http"
        client = Client(f"{scheme}://{cluster.vip('gateway')}:{port}", cfg["api_key"], cfg["tls"], names["gateway"])
        await client.connect()
        sem = asyncio.Semaphore(8)

        async def one(p: list[int], n: int) -> list[int]:
            async with sem:
                return await client.complete(p, n)

        ids = await asyncio.gather(*(one(p, cfg["max_tokens"]) for p in cfg["prompts"]))
        emit("exact", ids=ids)

        before = {p.name: served(p) for p in cluster.pods.values()}
        new = await asyncio.gather(cluster.add_pod("drafter"), cluster.add_pod("verifier"))
        await cluster.wait_ready(None, len(cluster.pods), 900)
        ready_at = time.monotonic()
        rounds = 0
        while min(served(p) for p in new) <= 0 and time.monotonic() - ready_at < 300:
            await asyncio.gather(*(one(p, 16) for p in cfg["prompts"][:8]))
            rounds += 1
        emit(
            "scale-out",
            seconds=round(time.monotonic() - ready_at, 1),
            rounds=rounds,
            new=[p.name for p in new],
            served={p.name: served(p) - before.get(p.name, 0.0) for p in cluster.pods.values()},
        )

        # the roll: 8 streams as long as the model allows, so they outlast the preStop sleep
        pre_stop_s, drain_s = drain_window(cluster.deployments["gateway"])
        tokens = cfg["stream_tokens"]
        firsts = [asyncio.Event() for _ in range(8)]
        progress: list[list[tuple[float, int]]] = [[] for _ in range(8)]
        streams = [
            asyncio.create_task(client.stream(p, tokens, e, log))
            for p, e, log in zip(cfg["prompts"][:8], firsts, progress, strict=True)
        ]
        await asyncio.gather(*(e.wait() for e in firsts))
        victims = [
            min((p for p in cluster.pods.values() if p.deployment == d), key=lambda p: p.name)
            for d in ("drafter", "verifier", "gateway")
        ]
        open_at_delete = sum(not t.done() for t in streams)

        async def open_at_sigterm() -> int:  # streams still open when the first SIGTERM went out
            while not cluster.sigterms and not all(t.done() for t in streams):
                await asyncio.sleep(0.05)
            return sum(not t.done() for t in streams)

        watch = asyncio.create_task(open_at_sigterm())
        deleted_at = time.monotonic()
        await asyncio.gather(*(cluster.delete_pod(v.name) for v in victims))
        results = await asyncio.gather(*streams)
        gateway_sigterm = f"{victims[-1].name}/gateway SIGTERM"  # the kubelet's event: "<time> <pod>/<c> SIGTERM"
        sigterm_at = next(float(e.split()[0]) for e in cluster.events if e.endswith(gateway_sigterm))
        emit(
            "roll",
            deleted=[v.name for v in victims],
            tokens=tokens,
            window=[pre_stop_s, drain_s],
            open_at_delete=open_at_delete,
            open_at_sigterm=await watch,
            sigterm=round(sigterm_at - deleted_at, 1),  # the gateway's; seconds after the deletion, as the rest
            ended=[round(r["ended"] - deleted_at, 1) for r in results],
            last_tokens=[round(log[-1][0] - deleted_at, 1) if log else None for log in progress],
            ids=[r["ids"] for r in results],
            errors=[r["error"] for r in results],
            events=cluster.events[-40:],
        )
        await client.http.aclose()
    finally:
        await cluster.close()


if __name__ == "__main__":
    asyncio.run(main(json.loads(Path(sys.argv[1]).read_text())))
