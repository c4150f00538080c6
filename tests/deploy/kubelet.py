"""A small kubelet, kube-proxy and cluster DNS on one machine, for running deploy/k8s as shipped.

What it does with rendered manifests (`kubectl kustomize ...`), the way a cluster would:
  - a pod is a network namespace on one bridge (benchmarks.netns) with its own address, and each
    container a process in a private mount namespace whose root is an overlay of this machine's
    root (writes never reach the host), with the pod's volumes bound at their mountPaths
    (emptyDir: a fresh folder; secret / configMap: their keys as files; persistentVolumeClaim:
    the folder given for the claim), the root read-only when readOnlyRootFilesystem says so,
    and the container's user (runAsUser / runAsGroup);
  - a container runs its `command` (or the image's ENTRYPOINT, read from the Dockerfile) and
    `args` (or CMD), with its env (value, configMapKeyRef, secretKeyRef, fieldRef,
    resourceFieldRef, envFrom) and $(VAR) expanded as Kubernetes does;
  - init containers run first, one after the other, each to success;
  - probes as the manifests define them (grpc or exec; startup, then readiness and liveness),
    run from the node (a namespace of its own on the bridge); a pod is Ready when its
    containers' readiness probes pass, and only Ready pods are endpoints;
  - a real DNS server (dnsmasq) answers Service names: a headless Service's name with the
    address of every Ready pod, a ClusterIP Service's name with one virtual address that a
    userspace proxy (as kube-proxy's userspace mode) forwards to a Ready endpoint;
  - deleting a pod: its endpoints go first (DNS and proxy), then the preStop hook, then
    SIGTERM, then SIGKILL at terminationGracePeriodSeconds from the deletion.

Root only (network and mount namespaces); `unavailable_reason()` says why not. Everything it
makes (namespaces, /etc/netns/NAME, folders) goes with `close()`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.netns import Network
from benchmarks.netns import unavailable_reason as netns_unavailable

DOMAIN = "svc.cluster.local"


def unavailable_reason() -> str | None:
    """Why the harness cannot run here (None: it can)."""
    reason = netns_unavailable()
    if reason:
        return reason
    for tool in ("dnsmasq", "unshare", "chroot", "nsenter", "kubectl"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (dnsmasq: Debian's dnsmasq-base)"
    return None


def render(kustomization_dir: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize DIR` renders."""
    import yaml

    out = subprocess.run(
        ["kubectl", "kustomize", str(kustomization_dir)], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    return [o for o in yaml.safe_load_all(out) if o]


def image_entrypoints(dockerfile: Path) -> dict[str, tuple[list[str], list[str]]]:
    """{build target: (ENTRYPOINT, CMD)} of a Dockerfile's stages (exec form only)."""
    out: dict[str, tuple[list[str], list[str]]] = {}
    stage = ""
    for line in dockerfile.read_text().splitlines():
        words = line.strip().split(None, 1)
        if not words:
            continue
        if words[0] == "FROM":
            stage = line.split(" AS ")[-1].strip() if " AS " in line else ""
            out[stage] = ([], [])
        elif words[0] in ("ENTRYPOINT", "CMD") and stage and not line.startswith(" "):
            entry, cmd = out[stage]
            value = json.loads(words[1])
            out[stage] = (value, cmd) if words[0] == "ENTRYPOINT" else (entry, value)
    return out


def image_files(dockerfile: Path, repo: Path) -> list[tuple[Path, str]]:
    """(file in the repository, absolute path in the image) of the Dockerfile's COPY lines that
    put a single file at an absolute path (the health check client, for one)."""
    out = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if len(words) == 3 and words[0] == "COPY" and words[2].startswith("/") and (repo / words[1]).is_file():
            out.append((repo / words[1], words[2]))
    return sorted(set(out))


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names replaced, unknown ones kept, $$ -> $."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def cpu_value(quantity: str, divisor: str = "1") -> str:
    """A resourceFieldRef of limits.cpu as the kubelet writes it: ceil(quantity / divisor)."""

    def cores(q: str) -> float:
        return float(q[:-1]) / 1000 if q.endswith("m") else float(q)

    return str(max(1, -(-cores(quantity) // cores(divisor)).__int__()))


@dataclass
class Container:
    name: str
    spec: dict[str, Any]
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)
    started: bool = False  # the startup probe passed (or there is none)
    ready: bool = False
    failures: dict[str, int] = field(default_factory=dict)  # probe kind -> consecutive failures
    restarts: int = 0


@dataclass
class Pod:
    name: str
    deployment: str
    labels: dict[str, str]
    spec: dict[str, Any]
    netns: str
    ip: str
    volumes: dict[str, tuple[Path, bool]]  # volume name -> (host folder, read-only)
    containers: list[Container]
    terminating: bool = False
    tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return not self.terminating and all(c.ready for c in self.containers)


class Cluster:
    """One node, its pods and Services; see the module docstring.

    `objects`: rendered manifests; `dockerfile`: where images' ENTRYPOINT/CMD come from (an
    image `REPO/TARGET:TAG` is the Dockerfile's stage TARGET); `claims`: host folders for
    persistentVolumeClaims by claim name; `secrets`: Secret data by name (a user creates them
    beside the manifests); `bin_dir`: the folder of the `specdec` entry point (the image's PATH).
    Container logs go to `log_dir/POD-CONTAINER.log`.
    """

    def __init__(
        self,
        objects: list[dict[str, Any]],
        dockerfile: Path,
        claims: dict[str, Path],
        secrets: dict[str, dict[str, str]],
        bin_dir: Path,
        log_dir: Path,
    ) -> None:
        self.objects = objects
        self.images = image_entrypoints(dockerfile)
        self.files = image_files(dockerfile, dockerfile.parents[2])
        self.claims = claims
        self.secrets = secrets
        self.bin_dir = bin_dir
        self.log_dir = log_dir
        self.configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
        self.services = [o for o in objects if o["kind"] == "Service"]
        self.deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
        self.namespace = next((o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"), "default")
        self.pods: dict[str, Pod] = {}
        self.net = Network(["node"], prefix="sdk-", octet=233)
        self.node_ip = self.net.address("node")
        enter_netns(self.net.hosts["node"][0])  # this process is the node from here on
        self.work = Path(tempfile.mkdtemp(prefix="specdec-kubelet-"))
        self._names = itertools.count(1)
        self._vips: dict[str, str] = {}  # ClusterIP Service -> its virtual address (on the node)
        self._next_host = 200
        self._rr = itertools.count()
        self._dns: subprocess.Popen | None = None
        self._proxies: list[asyncio.base_events.Server] = []
        self._etc: list[Path] = []
        self.events: list[str] = []
        self.sigterms: list[str] = []  # pod/container, in the order SIGTERM reached them

    # ----- DNS and Services ------------------------------------------------------------
    def _fqdn(self, svc: dict[str, Any]) -> str:
        return f"{svc['metadata']['name']}.{svc['metadata'].get('namespace', self.namespace)}.{DOMAIN}"

    def endpoints(self, svc: dict[str, Any]) -> list[Pod]:
        """The Ready pods a Service selects."""
        sel = svc["spec"].get("selector", {})
        return [p for p in self.pods.values() if p.ready and all(p.labels.get(k) == v for k, v in sel.items())]

    def _write_dns(self) -> None:
        lines = []
        for svc in self.services:
            if svc["spec"].get("clusterIP") == "None":
                lines += [f"{p.ip} {self._fqdn(svc)}" for p in self.endpoints(svc)]
            else:
                lines.append(f"{self._vips[svc['metadata']['name']]} {self._fqdn(svc)}")
        path = self.work / "dns-hosts"
        path.write_text("\n".join(lines) + "\n")
        if self._dns is not None:
            self._dns.send_signal(signal.SIGHUP)  # dnsmasq re-reads its hosts files

    def _etc_netns(self, ns: str, hostname: str, ip: str) -> None:
        """/etc/resolv.conf and /etc/hosts of a namespace (`ip netns exec` binds them)."""
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        self._etc.append(etc)
        search = f"{self.namespace}.{DOMAIN} {DOMAIN} cluster.local"
        (etc / "resolv.conf").write_text(f"nameserver {self.node_ip}\nsearch {search}\noptions ndots:5\n")
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{ip} {hostname}\n")

    async def start(self) -> None:
        """DNS, the ClusterIP proxies, then every Deployment's pods (spec.replicas, or the
        HorizontalPodAutoscaler's minReplicas when the Deployment leaves replicas to it)."""
        self._etc_netns(self.net.hosts["node"][0], "node", self.node_ip)
        for svc in self.services:
            if svc["spec"].get("clusterIP") != "None":
                vip = f"{self.net.subnet}.{self._next_host}"
                self._next_host += 1
                subprocess.run(["ip", "addr", "add", f"{vip}/32", "dev", "eth0"], check=True)
                self._vips[svc["metadata"]["name"]] = vip
                for port in svc["spec"]["ports"]:
                    self._proxies.append(
                        await asyncio.start_server(
                            lambda r, w, s=svc, p=port: self._forward(r, w, s, p), vip, port["port"]
                        )
                    )
        self._write_dns()
        # --local: the cluster domain is answered from the records alone, so a headless name with no
        # Ready pod is NXDOMAIN at once (as the cluster DNS answers), never a timed-out SERVFAIL
        self._dns = subprocess.Popen(
            [
                "dnsmasq",
                "--keep-in-foreground",
                "--no-resolv",
                "--no-hosts",
                "--no-negcache",
                "--local-ttl=0",
                "--local=/cluster.local/",
                f"--addn-hosts={self.work / 'dns-hosts'}",
                f"--listen-address={self.node_ip}",
                "--bind-interfaces",
                "--user=root",
                f"--pid-file={self.work / 'dnsmasq.pid'}",
                f"--log-facility={self.log_dir / 'dnsmasq.log'}",
            ],
        )
        hpa_min = {
            o["spec"]["scaleTargetRef"]["name"]: o["spec"].get("minReplicas", 1)
            for o in self.objects
            if o["kind"] == "HorizontalPodAutoscaler"
        }
        for name, dep in self.deployments.items():
            for _ in range(dep["spec"].get("replicas", hpa_min.get(name, 1))):
                await self.add_pod(name)

    def _target_port(self, pod: Pod, port: dict[str, Any]) -> int:
        target = port.get("targetPort", port["port"])
        if isinstance(target, int):
            return target
        for c in pod.containers:
            for p in c.spec.get("ports", []):
                if p.get("name") == target:
                    return int(p["containerPort"])
        raise KeyError(f"pod {pod.name} has no port named {target}")

    async def _forward(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, svc: dict[str, Any], port: dict[str, Any]
    ) -> None:
        """kube-proxy's userspace mode: one connection to a Ready endpoint (round robin)."""
        pods = self.endpoints(svc)
        if not pods:
            writer.close()
            return
        pod = pods[next(self._rr) % len(pods)]
        try:
            up_r, up_w = await asyncio.open_connection(pod.ip, self._target_port(pod, port))
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    def vip(self, service: str) -> str:
        """The virtual address (ClusterIP) of a ClusterIP Service."""
        return self._vips[service]

    # ----- pods ---------------------------------------------------------------------------
    async def add_pod(self, deployment: str) -> Pod:
        """Schedule one more pod of `deployment`: its namespace, volumes, init containers (each
        to success), then its containers and their probes."""
        dep = self.deployments[deployment]
        tpl = dep["spec"]["template"]
        name = f"{deployment}-{next(self._names)}"
        ip = self.net.add_host(name)
        ns = self.net.hosts[name][0]
        self._etc_netns(ns, name, ip)
        spec = tpl["spec"]
        pod = Pod(
            name,
            deployment,
            dict(tpl["metadata"].get("labels", {})),
            spec,
            ns,
            ip,
            self._volumes(name, spec),
            [Container(c["name"], c) for c in spec["containers"]],
        )
        self.pods[name] = pod
        self.events.append(f"{time.monotonic():.1f} pod {name} scheduled ({ip})")
        for init in spec.get("initContainers", []):
            proc = self._run(pod, init)
            code = await asyncio.to_thread(proc.wait)
            if code != 0:
                raise RuntimeError(
                    f"init container {init['name']} of {name} exited {code}; log: {self._log(pod, init['name'])}"
                )
        for c in pod.containers:
            c.proc, c.env = self._run(pod, c.spec), self._env(pod, c.spec)
            pod.tasks.append(asyncio.create_task(self._probe_loop(pod, c)))
        return pod

    def _volumes(self, pod: str, spec: dict[str, Any]) -> dict[str, tuple[Path, bool]]:
        out: dict[str, tuple[Path, bool]] = {}
        group = spec.get("securityContext", {}).get("fsGroup")
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]
                out[v["name"]] = (self.claims[claim["claimName"]], bool(claim.get("readOnly")))
                continue
            folder = self.work / "pods" / pod / v["name"]
            folder.mkdir(parents=True)
            if "secret" in v or "configMap" in v:
                src = v.get("secret") or v["configMap"]
                data = (
                    self.secrets.get(src["secretName"], {}) if "secret" in v else self.configmaps.get(src["name"], {})
                )
                if not data and not src.get("optional"):
                    raise KeyError(f"pod {pod}: volume {v['name']} needs {src} which was not given")
                items = src.get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    (folder / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                    (folder / item["path"]).write_text(data[item["key"]])
                    os.chmod(folder / item["path"], src.get("defaultMode", 0o644) & 0o777)
                readonly = True
            elif "emptyDir" in v:
                readonly = False
            else:
                raise NotImplementedError(f"pod {pod}: volume kind of {v}")
            if group is not None:  # fsGroup: the volume is the pod group's
                for path in [folder, *folder.rglob("*")]:
                    os.chown(path, -1, group)
                    os.chmod(path, os.stat(path).st_mode | (0o2070 if path.is_dir() else 0o040))
            out[v["name"]] = (folder, readonly)
        return out

    def _env(self, pod: Pod, c: dict[str, Any]) -> dict[str, str]:
        env = {"PATH": f"{self.bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOSTNAME": pod.name}
        for src in c.get("envFrom", []):
            data = (
                self.configmaps.get(src["configMapRef"]["name"], {})
                if "configMapRef" in src
                else self.secrets.get(src["secretRef"]["name"], {})
            )
            env.update({src.get("prefix", "") + k: v for k, v in data.items()})
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(str(e["value"]), env)
                continue
            ref = e["valueFrom"]
            if "configMapKeyRef" in ref:
                env[e["name"]] = self.configmaps[ref["configMapKeyRef"]["name"]][ref["configMapKeyRef"]["key"]]
            elif "secretKeyRef" in ref:
                env[e["name"]] = self.secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
            elif "fieldRef" in ref:
                env[e["name"]] = {
                    "metadata.namespace": self.namespace,
                    "metadata.name": pod.name,
                    "status.podIP": pod.ip,
                }[ref["fieldRef"]["fieldPath"]]
            elif "resourceFieldRef" in ref:
                r = ref["resourceFieldRef"]
                kind, res = r["resource"].split(".")
                named = next(
                    x
                    for x in pod.spec["containers"] + pod.spec.get("initContainers", [])
                    if x["name"] == r.get("containerName", c["name"])
                )
                env[e["name"]] = cpu_value(named["resources"][kind][res], str(r.get("divisor", "1")))
        return env

    def _argv(self, c: dict[str, Any], env: dict[str, str]) -> list[str]:
        entry, cmd = self.images[c["image"].split(":")[0].rsplit("/", 1)[-1]]
        argv = c["command"] + c.get("args", []) if "command" in c else entry + c.get("args", cmd)
        return [expand(a, env) for a in argv]

    def _log(self, pod: Pod, container: str) -> Path:
        return self.log_dir / f"{pod.name}-{container}.log"

    def _run(self, pod: Pod, c: dict[str, Any]) -> subprocess.Popen:
        """Start one container: a mount namespace in the pod's network namespace, an overlay
        root with the volumes bound in, then the container's process as its user."""
        env = self._env(pod, c)
        argv = self._argv(c, env)
        sc = {**pod.spec.get("securityContext", {}), **c.get("securityContext", {})}
        root = self.work / "roots" / f"{pod.name}-{c['name']}-{time.monotonic_ns()}"
        for d in ("upper", "work", "root"):
            (root / d).mkdir(parents=True)
        for src, dest in self.files:  # the image's own files (COPY)
            (root / "upper" / dest.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, root / "upper" / dest.lstrip("/"))
        r = root / "root"
        script = [f"mount -t overlay overlay -o lowerdir=/,upperdir={root}/upper,workdir={root}/work {r}"]
        script += [f"mount --rbind /{d} {r}/{d}" for d in ("proc", "dev", "sys")]
        script += [f"mount --bind /etc/{f} {r}/etc/{f}" for f in ("resolv.conf", "hosts")]  # the pod's (ip netns exec)
        # the image's files are readable by any user: let the container's user reach this checkout's environment
        exe = Path(sys.executable).resolve()
        for path in {*self.bin_dir.parents, *exe.parents, self.bin_dir}:
            if str(path) != "/":
                script.append(f"chmod o+rx {r}{shlex.quote(str(path))}")
        for m in c.get("volumeMounts", []):
            host, readonly = pod.volumes[m["name"]]
            target = f"{r}{m['mountPath']}"
            script += [
                f"mkdir -p {shlex.quote(target)}",
                f"mount --bind {shlex.quote(str(host))} {shlex.quote(target)}",
            ]
            if readonly or m.get("readOnly"):
                script.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
        # the image's software (this checkout and its environment, where the image has /opt/venv)
        # stays visible where a volume covers its path (a checkout under /tmp, which an emptyDir hides)
        mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
        # (an overlay of it, so the container's user may enter it, as an image's files are readable)
        for i, keep in enumerate((self.bin_dir.parents[1], exe.parents[1])):
            if any(str(keep) == mp or str(keep).startswith(mp.rstrip("/") + "/") for mp in mounts):
                target = shlex.quote(f"{r}{keep}")
                upper, work = root / f"keep{i}-upper", root / f"keep{i}-work"
                upper.mkdir()
                work.mkdir()
                script += [
                    f"mkdir -p {target}",
                    f"mount -t overlay overlay -o lowerdir={shlex.quote(str(keep))},upperdir={upper},"
                    f"workdir={work} {target}",
                    f"chmod o+rx {target}",
                ]
        if sc.get("readOnlyRootFilesystem"):
            script.append(f"mount -o remount,bind,ro {r}")
        user = f"--userspec={sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}" if "runAsUser" in sc else ""
        groups = f"--groups={sc['fsGroup']}" if "fsGroup" in pod.spec.get("securityContext", {}) else ""
        envs = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        script.append(
            f"cd {r} && exec chroot {user} {groups} {r} /usr/bin/env -i {envs} "
            + " ".join(shlex.quote(a) for a in argv)
        )
        log = open(self._log(pod, c["name"]), "ab")  # noqa: SIM115 (the child holds it)
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                pod.netns,
                "unshare",
                "-m",
                "--propagation",
                "private",
                "sh",
                "-euc",
                "\n".join(script),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.events.append(f"{time.monotonic():.1f} {pod.name}/{c['name']} started: {' '.join(argv)}")
        return proc

    # ----- probes -------------------------------------------------------------------------
    async def _probe(self, pod: Pod, c: Container, probe: dict[str, Any]) -> bool:
        timeout = probe.get("timeoutSeconds", 1)
        if "grpc" in probe:
            g = probe["grpc"]
            async with grpc.aio.insecure_channel(f"{pod.ip}:{g['port']}") as channel:
                try:
                    answer = await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=g.get("service", "")), timeout=timeout
                    )
                except grpc.aio.AioRpcError:
                    return False
                return answer.status == health_pb2.HealthCheckResponse.SERVING
        if "exec" in probe:
            return await self.exec_in(pod, c, probe["exec"]["command"], timeout) == 0
        raise NotImplementedError(f"probe {probe}")

    async def exec_in(self, pod: Pod, c: Container, command: list[str], timeout_s: float) -> int:
        """Run `command` inside a running container (its namespaces, root and user), like
        `kubectl exec`; its exit code (-1 when it timed out or the container is gone)."""
        if c.proc is None or c.proc.poll() is not None:
            return -1
        target = _container_pid(c.proc.pid)
        if target is None:
            return -1
        sc = {**pod.spec.get("securityContext", {}), **c.spec.get("securityContext", {})}
        ids = (
            ["-S", str(sc["runAsUser"]), "-G", str(sc.get("runAsGroup", sc["runAsUser"]))] if "runAsUser" in sc else []
        )
        env = [f"{k}={v}" for k, v in c.env.items()]
        proc = await asyncio.create_subprocess_exec(
            "nsenter",
            "-t",
            str(target),
            "-n",
            "-m",
            "-r",
            "-w",
            *ids,
            "/usr/bin/env",
            "-i",
            *env,
            *command,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            return await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            proc.kill()
            return -1

    async def _probe_loop(self, pod: Pod, c: Container) -> None:
        """startupProbe until it passes (liveness and readiness wait for it), then readiness and
        liveness at their periods; a container past its liveness (or startup) failureThreshold is
        killed and started again (restartPolicy Always), as is one whose process exits."""
        spec = c.spec
        t0 = time.monotonic()
        due = {
            k: t0 + spec[k].get("initialDelaySeconds", 0)
            for k in ("startupProbe", "readinessProbe", "livenessProbe")
            if k in spec
        }
        c.started = "startupProbe" not in spec
        while not pod.terminating:
            if c.proc is not None and c.proc.poll() is not None:
                self.events.append(f"{time.monotonic():.1f} {pod.name}/{c.name} exited {c.proc.returncode}; restarting")
                c.ready, c.started, c.failures = False, "startupProbe" not in spec, {}
                c.restarts += 1
                c.proc = self._run(pod, spec)
                due = {k: time.monotonic() for k in due}
            now = time.monotonic()
            kinds = ["startupProbe"] if not c.started else [k for k in ("readinessProbe", "livenessProbe") if k in due]
            if not c.started and "startupProbe" not in spec:
                kinds = []
            for kind in kinds:
                if now < due[kind]:
                    continue
                probe = spec[kind]
                due[kind] = now + probe.get("periodSeconds", 10)
                ok = await self._probe(pod, c, probe)
                c.failures[kind] = 0 if ok else c.failures.get(kind, 0) + 1
                if kind == "startupProbe" and ok:
                    c.started = True
                    self.events.append(f"{time.monotonic():.1f} {pod.name}/{c.name} started (startup probe)")
                    due = {k: time.monotonic() for k in due if k != "startupProbe"}
                elif kind == "readinessProbe":
                    was = pod.ready
                    if ok and probe.get("successThreshold", 1) <= 1:
                        c.ready = True
                    elif not ok and c.failures[kind] >= probe.get("failureThreshold", 3):
                        c.ready = False
                    if pod.ready != was:
                        self.events.append(f"{time.monotonic():.1f} {pod.name} {'Ready' if pod.ready else 'NotReady'}")
                        self._write_dns()
                elif not ok and c.failures[kind] >= probe.get("failureThreshold", 3):  # startup or liveness
                    self.events.append(f"{time.monotonic():.1f} {pod.name}/{c.name} failed its {kind}; killing it")
                    if c.proc is not None:
                        os.killpg(c.proc.pid, signal.SIGKILL)
            if c.started and "readinessProbe" not in spec and not c.ready:
                c.ready = True
                self._write_dns()
            nxt = min(due.values(), default=time.monotonic() + 1)
            await asyncio.sleep(max(0.05, min(1.0, nxt - time.monotonic())))

    async def wait_ready(self, deployment: str | None, count: int, timeout_s: float) -> None:
        """Wait until `count` pods (of `deployment`, or all) are Ready."""
        deadline = time.monotonic() + timeout_s
        while True:
            pods = [p for p in self.pods.values() if deployment in (None, p.deployment)]
            if sum(p.ready for p in pods) >= count:
                return
            for p in pods:
                for c in p.containers:
                    if c.restarts > 3:
                        raise RuntimeError(f"{p.name}/{c.name} keeps exiting; log: {self._log(p, c.name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{count} Ready pods of {deployment or 'every Deployment'} not within "
                    f"{timeout_s:g} s; events:\n" + "\n".join(self.events[-20:])
                )
            await asyncio.sleep(0.2)

    async def delete_pod(self, name: str) -> None:
        """Delete a pod as Kubernetes does: out of the endpoints (DNS, proxy) at once, the
        preStop hooks, SIGTERM, and SIGKILL at terminationGracePeriodSeconds from now."""
        pod = self.pods[name]
        pod.terminating = True
        self._write_dns()
        self.events.append(f"{time.monotonic():.1f} pod {name} deleted")
        grace = pod.spec.get("terminationGracePeriodSeconds", 30)
        deadline = time.monotonic() + grace
        for t in pod.tasks:
            t.cancel()

        async def stop(c: Container) -> None:
            hook = c.spec.get("lifecycle", {}).get("preStop", {})
            if "exec" in hook:
                await self.exec_in(pod, c, hook["exec"]["command"], grace)
            if c.proc is None:
                return
            self.events.append(f"{time.monotonic():.1f} {name}/{c.name} SIGTERM")
            self.sigterms.append(f"{name}/{c.name}")
            with _suppress_gone():  # to the container's main process, as the runtime does
                os.kill(c.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.to_thread(c.proc.wait), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                self.events.append(f"{time.monotonic():.1f} {name}/{c.name} SIGKILL (grace period over)")
                with _suppress_gone():
                    os.killpg(c.proc.pid, signal.SIGKILL)
                await asyncio.to_thread(c.proc.wait)

        await asyncio.gather(*(stop(c) for c in pod.containers))
        del self.pods[name]
        self.net.remove_host(name)

    async def close(self) -> None:
        for p in list(self.pods.values()):
            p.terminating = True
            for t in p.tasks:
                t.cancel()
            for c in p.containers:
                if c.proc is not None and c.proc.poll() is None:
                    with _suppress_gone():
                        os.killpg(c.proc.pid, signal.SIGKILL)
                    await asyncio.to_thread(c.proc.wait)
        for server in self._proxies:
            server.close()
        if self._dns is not None:
            self._dns.kill()
            self._dns.wait()
        self.net.close()
        for etc in self._etc:
            shutil.rmtree(etc, ignore_errors=True)
        subprocess.run(["umount", "-R", str(self.work)], capture_output=True)
        shutil.rmtree(self.work, ignore_errors=True)


class _suppress_gone:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, ProcessLookupError)


def enter_netns(name: str) -> None:
    """Move the calling thread (call it from the main thread before any other thread exists:
    threads made later, gRPC's and asyncio's, inherit it) into the named network namespace."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{name}") as f:
        if libc.setns(f.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")


def _container_pid(launcher: int) -> int | None:
    """The container's own process under its launcher (ip netns exec -> unshare -> sh -> chroot
    exec's the command): the deepest descendant of `launcher` whose root is not /."""
    pid = launcher
    while True:
        try:
            if os.readlink(f"/proc/{pid}/root") != "/":
                return pid
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return None
        if not children:
            return None
        pid = int(children[0])
