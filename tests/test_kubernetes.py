"""The Kubernetes examples (``examples/kubernetes/``) and the agent's ``/ready``: manifests validated offline, and
each example's pods run on this machine with exactly the environment their operator gives them.

Theory of operation
-------------------
No control plane can run here, so the operators are replaced by what they do to a pod, read from their source
(kubeflow/training-operator ``pkg/controller.v1/pytorch/{envvar,elastic,master}.go``: :func:`pytorchjob_env`; an
Indexed Job's completion index through the downward API, as Kubeflow Trainer v2 and JobSet use it: :func:`pod_env`),
and the cluster's network by network namespaces: one per pod, joined by veth pairs on a bridge, the pod's hostname
set in its own UTS namespace, and the cluster DNS by the namespace's own ``/etc/hosts`` (``ip netns exec`` bind-mounts
``/etc/netns/<namespace>/hosts`` over ``/etc/hosts``): every name the operator's variables use resolves, in every
pod, to the pod it names, as the Services' DNS records would. The bridge has an address in the root namespace, so
this process reaches the pods' probe ports as a kubelet reaches a pod's IP.

Each pod runs the manifest's container command as written (``aelastic run /app/train.py``: ``aelastic`` is this
interpreter's ``-m aelastic``, ``/app/train.py`` a gloo all-reduce written for the test), in an environment that
holds only the container's ``env`` (field references resolved), what the operator adds and a container's basics
(``PATH``, ``HOME``, ``HOSTNAME``): nothing from this process leaks in. The probes of the manifest are then asked
what a kubelet would ask them.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import httpx
import pytest
from helpers.procs import poll_until

from aelastic.agent.control import ready, serve_control
from aelastic.agent.figures import AgentMetrics
from aelastic.agent.workers import WorkerState

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "kubernetes"
MANIFESTS = sorted(EXAMPLES.glob("*.yaml"))
DEADLINE = 120.0  # generous: two agents and four torch workers on a small, shared machine
JOIN_TIMEOUT, READ_TIMEOUT, STATIC_TIMEOUT = 600, 60, 900  # c10d's join_timeout and read_timeout; static's timeout
CORE_API_VERSIONS = ("v1", "batch/v1", "apps/v1")
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"

yaml = pytest.importorskip("yaml", reason="the manifests are YAML: PyYAML comes with kubernetes-validate")


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def workload(path: Path) -> dict[str, Any]:
    """The manifest's workload (the PyTorchJob or the Job), not its Service."""
    return next(doc for doc in documents(path) if doc["kind"] != "Service")


def pod_template(doc: dict[str, Any]) -> dict[str, Any]:
    if doc["kind"] == "PyTorchJob":
        return dict(doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"])
    return dict(doc["spec"]["template"])


def main_container(doc: dict[str, Any]) -> dict[str, Any]:
    containers = pod_template(doc)["spec"]["containers"]
    assert len(containers) == 1, "one container per pod: the agent"
    return dict(containers[0])


# --- /ready: the rule and the endpoint -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "stopped", "unhealthy", "alive", "rounds", "status", "reason"),
    [
        ("INIT", None, {}, 0, 0, 503, "waiting for the first rendezvous round"),
        ("INIT", None, {}, 0, 1, 503, "rendezvous round complete: workers starting"),
        ("HEALTHY", None, {}, 2, 1, 200, "workers running after a complete rendezvous round"),
        ("HEALTHY", None, {}, 0, 1, 503, "workers exited: the run ends or restarts"),
        ("HEALTHY", "membership change: node left", {}, 0, 1, 503,
         "workers stopped: membership change: node left; re-rendezvous"),
        ("INIT", "worker rank 0 failed", {}, 0, 1, 503, "workers stopped: worker rank 0 failed; re-rendezvous"),
        ("HEALTHY", None, {1: "no heartbeat for 30s"}, 2, 1, 503, "local rank 1 is unhealthy: no heartbeat for 30s"),
        ("SUCCEEDED", None, {}, 0, 1, 503, "run over: workers succeeded"),
        ("FAILED", None, {}, 0, 1, 503, "run over: workers failed"),
    ],
)  # fmt: skip
def test_ready_rule(
    state: str, stopped: str | None, unhealthy: dict[int, str], alive: int, rounds: int, status: int, reason: str
) -> None:
    metrics = AgentMetrics("r", 1, state=WorkerState(state), stopped_reason=stopped, unhealthy=unhealthy,
                           workers_alive=alive, rendezvous_count=rounds)  # fmt: skip
    assert ready(metrics) == (status, {"state": state, "workers_alive": alive, "reason": reason})


@pytest.mark.anyio
async def test_ready_follows_the_agent_through_a_round_a_restart_and_the_end() -> None:
    """The recorder's calls in the order an agent makes them; /ready beside /health on one endpoint."""
    metrics = AgentMetrics("trainer", 1)
    async with anyio.create_task_group() as tg:
        port = await tg.start(lambda task_status: serve_control(metrics, 0, host="127.0.0.1", with_metrics=False,
                                                                 task_status=task_status))  # fmt: skip
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

            async def both() -> tuple[tuple[int, str], tuple[int, str]]:
                health, readiness = await client.get("/health"), await client.get("/ready")
                return ((health.status_code, health.json()["reason"]),
                        (readiness.status_code, readiness.json()["reason"]))  # fmt: skip

            assert await both() == ((200, "workers starting"), (503, "waiting for the first rendezvous round"))
            metrics.rendezvous_done(0.5)
            metrics.running(2, 1.0)
            running = "workers running after a complete rendezvous round"
            assert await both() == ((200, "workers running"), (200, running))
            assert (await client.head("/ready")).status_code == 200
            metrics.set_alive(0)
            metrics.restarted("membership", "membership change: a node joined", 2.0)
            metrics.set_state(WorkerState.INIT)  # the next attempt's rendezvous
            (health, _), (status, reason) = await both()
            assert (health, status) == (503, 503)
            assert reason == "workers stopped: membership change: a node joined; restart 1 (membership); re-rendezvous"
            metrics.rendezvous_done(0.5)
            metrics.running(2, 3.0)
            assert (await both())[1] == (200, running)
            metrics.set_alive(0)
            metrics.set_state(WorkerState.SUCCEEDED)
            assert await both() == ((503, "run over: workers succeeded"), (503, "run over: workers succeeded"))
            missing = await client.get("/nope")
            assert (missing.status_code, missing.text) == (404, "not found: /health, /ready\n")
        tg.cancel_scope.cancel()


# --- the manifests, offline ----------------------------------------------------------------------------------------


def test_the_examples_are_there() -> None:
    assert [path.name for path in MANIFESTS] == ["indexed-job.yaml", "pytorchjob.yaml"]


def test_core_kinds_validate_strictly_and_custom_resources_get_a_warning() -> None:
    """``kubernetes-validate --strict`` (unknown fields are errors) passes every core-kind resource of every
    manifest; the PyTorchJob is a custom resource it has no schema for, which it says (checked below instead)."""
    pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the test extra) validates offline")
    command = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent)) or "kubernetes-validate"
    done = subprocess.run([command, "--strict", *map(str, MANIFESTS)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for path in MANIFESTS:
        for doc in documents(path):
            if doc["apiVersion"] in CORE_API_VERSIONS:
                what = f"{path.relative_to(ROOT)} passed for resource {doc['kind'].lower()}/{doc['metadata']['name']}"
                assert any(what in line for line in lines), done.stdout
            else:
                assert any(line.startswith("WARN") and doc["kind"] in line for line in lines), done.stdout
    assert not any(line.startswith("ERROR") for line in lines), done.stdout


def test_the_pytorchjob_pod_template_validates_strictly_as_a_core_pod_template() -> None:
    """What kubernetes-validate cannot check in a custom resource, the pod template, is a core type: validated as a
    ``v1/PodTemplate``."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the test extra)")
    for path in MANIFESTS:
        doc = workload(path)
        if doc["apiVersion"] in CORE_API_VERSIONS:
            continue
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": doc["metadata"]["name"]},
                   "template": pod_template(doc)}  # fmt: skip
        try:
            kubernetes_validate.validate(wrapped, kubernetes_validate.latest_version(), strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name}: {str(exc).splitlines()[0]}")


# The PyTorchJob's fields as training-operator v1 declares them (pkg/apis/kubeflow.org/v1/pytorch_types.go,
# common_types.go): what the CRD's structural schema would accept.
PYTORCHJOB_SPEC = {"runPolicy", "elasticPolicy", "pytorchReplicaSpecs", "nprocPerNode"}
ELASTIC_POLICY = {"minReplicas": int, "maxReplicas": int, "rdzvBackend": str, "rdzvPort": int, "rdzvHost": str,
                  "rdzvId": str, "rdzvConf": list, "standalone": bool, "nProcPerNode": int, "maxRestarts": int,
                  "metrics": list}  # fmt: skip
REPLICA_SPEC = {"replicas", "template", "restartPolicy"}
RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}


def test_the_pytorchjob_has_the_operators_structure() -> None:
    doc = workload(EXAMPLES / "pytorchjob.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    spec = doc["spec"]
    assert set(spec) <= PYTORCHJOB_SPEC, set(spec) - PYTORCHJOB_SPEC
    policy = spec["elasticPolicy"]
    assert set(policy) <= set(ELASTIC_POLICY), set(policy) - set(ELASTIC_POLICY)
    for key, value in policy.items():
        assert isinstance(value, ELASTIC_POLICY[key]), (key, value)
    assert policy["rdzvBackend"] in ("c10d", "etcd", "etcd-v2")
    assert set(spec["pytorchReplicaSpecs"]) <= {"Master", "Worker"}
    for replica in spec["pytorchReplicaSpecs"].values():
        assert set(replica) <= REPLICA_SPEC, set(replica) - REPLICA_SPEC
        assert replica["restartPolicy"] in RESTART_POLICIES
    workers = spec["pytorchReplicaSpecs"]["Worker"]["replicas"]
    assert policy["minReplicas"] <= workers <= policy["maxReplicas"]
    container = main_container(doc)
    assert container["name"] == "pytorch", "the operator sets its variables in the container named pytorch"
    assert "pytorchjob-port" in {port["name"] for port in container["ports"]}
    # The rendezvous Service (see the manifest) selects worker 0 by the labels the operator puts on its pods.
    service = next(d for d in documents(EXAMPLES / "pytorchjob.yaml") if d["kind"] == "Service")
    assert policy["rdzvHost"] == service["metadata"]["name"]
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {
        "training.kubeflow.org/job-name": doc["metadata"]["name"],
        "training.kubeflow.org/replica-type": "worker",
        "training.kubeflow.org/replica-index": "0",
    }


def probe_port(container: Mapping[str, Any], probe: Mapping[str, Any]) -> int:
    port = probe["httpGet"]["port"]
    if isinstance(port, int):
        return port
    return int(next(p["containerPort"] for p in container["ports"] if p["name"] == port))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.stem)
def test_probes_check_health_and_readiness_on_the_agents_port(path: Path) -> None:
    doc = workload(path)
    container = main_container(doc)
    assert container["command"] == ["aelastic", "run", "/app/train.py"], "no flag: the environment configures it"
    env = {e["name"]: e.get("value") for e in container["env"]}
    port = int(env["TORCHELASTIC_HEALTH_CHECK_PORT"])
    startup, liveness, readiness = (container[p] for p in ("startupProbe", "livenessProbe", "readinessProbe"))
    assert [p["httpGet"]["path"] for p in (startup, liveness, readiness)] == ["/health", "/health", "/ready"]
    assert {probe_port(container, p) for p in (startup, liveness, readiness)} == {port}
    assert (liveness["periodSeconds"], liveness["failureThreshold"]) == (10, 3)
    # /health answers once the agent has opened its rendezvous (reached the store): the startup probe waits that
    # long and the join on top (c10d: read_timeout + join_timeout; static: its store timeout).
    elastic = doc["kind"] == "PyTorchJob"
    needed = READ_TIMEOUT + JOIN_TIMEOUT if elastic else STATIC_TIMEOUT
    assert startup["periodSeconds"] * startup["failureThreshold"] >= needed
    # A restart's 503s from /health must fit in the liveness probe's window: the stop's grace and a re-rendezvous.
    grace = float(env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or 30)
    if elastic:
        assert grace < liveness["periodSeconds"] * liveness["failureThreshold"]


# --- what the operators put in a pod -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodSpec:
    """One pod as its controller makes it: its hostname, the names the cluster DNS gives it, its environment."""

    hostname: str
    dns_names: tuple[str, ...]
    env: dict[str, str]


def container_port(container: Mapping[str, Any], name: str) -> int:
    return int(next(p["containerPort"] for p in container.get("ports", ()) if p["name"] == name))


def pytorchjob_env(job: Mapping[str, Any], rtype: str, index: int) -> dict[str, str]:
    """The variables training-operator v1 appends to a PyTorchJob pod's container (``setPodEnv`` in
    ``pkg/controller.v1/pytorch/envvar.go`` with ``master.go`` and ``elastic.go``), in its order."""
    spec, name = job["spec"], job["metadata"]["name"]
    replicas = spec["pytorchReplicaSpecs"]
    total = sum(int(r["replicas"]) for r in replicas.values())
    nproc = spec.get("nprocPerNode", "auto")
    env = {"PYTHONUNBUFFERED": "0"}
    if "Master" in replicas:
        rank = index + 1 if rtype == "Worker" else index
        env["MASTER_PORT"] = str(container_port(main_container_of(replicas["Master"]), "pytorchjob-port"))
        env["MASTER_ADDR"] = f"{name}-master-0"
        env["WORLD_SIZE"] = str(total * (int(nproc) if nproc.isdigit() else 1))
        env["RANK"] = str(rank)
        env["PET_NPROC_PER_NODE"] = nproc
        env["PET_NODE_RANK"] = str(rank)
    policy = spec.get("elasticPolicy")
    if policy is None:
        env["PET_NNODES"] = str(total)
        return env
    host = policy.get("rdzvHost", f"{name}-worker-0")
    port = policy.get("rdzvPort") or container_port(main_container_of(replicas["Worker"]), "pytorchjob-port")
    env["PET_RDZV_ENDPOINT"] = f"{host}:{port}"
    env["PET_RDZV_BACKEND"] = policy.get("rdzvBackend", "c10d")
    if "minReplicas" in policy or "maxReplicas" in policy:
        env["PET_NNODES"] = f"{policy['minReplicas']}:{policy['maxReplicas']}"
    else:
        env["PET_NNODES"] = str(replicas["Worker"]["replicas"])
    if "maxRestarts" in policy:
        env["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
    if "nProcPerNode" in policy:
        env["PET_NPROC_PER_NODE"] = str(policy["nProcPerNode"])
    if "rdzvId" in policy:
        env["PET_RDZV_ID"] = policy["rdzvId"]
    if policy.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])
    if policy.get("standalone"):
        env["PET_STANDALONE"] = ""
    return env


def main_container_of(replica: Mapping[str, Any]) -> dict[str, Any]:
    return dict(next(c for c in replica["template"]["spec"]["containers"] if c["name"] == "pytorch"))


def pod_env(container: Mapping[str, Any], annotations: Mapping[str, str], hostname: str) -> dict[str, str]:
    """The container's own ``env``, field references resolved as the kubelet does (the downward API)."""
    env = {"HOSTNAME": hostname}
    for item in container.get("env", ()):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        path = item["valueFrom"]["fieldRef"]["fieldPath"]
        match = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", path)
        assert match, f"{item['name']}: a field reference this test does not resolve: {path}"
        env[item["name"]] = annotations[match[1]]
    return env


def pods_of(path: Path) -> list[PodSpec]:
    """The pods the manifest's controller would create, in index order."""
    doc = workload(path)
    name = doc["metadata"]["name"]
    container = main_container(doc)
    pods = []
    if doc["kind"] == "PyTorchJob":
        host = doc["spec"]["elasticPolicy"].get("rdzvHost")
        for index in range(doc["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]):
            hostname = f"{name}-worker-{index}"  # the operator's pod name, hostname and per-pod Service
            env = {**pod_env(container, {}, hostname), **pytorchjob_env(doc, "Worker", index)}
            names = (hostname, f"{hostname}.{hostname}", *((host,) if host and index == 0 else ()))
            pods.append(PodSpec(hostname, names, env))
    else:
        spec = doc["spec"]
        assert spec["completionMode"] == "Indexed"
        subdomain = spec["template"]["spec"]["subdomain"]
        for index in range(spec["completions"]):
            hostname = f"{name}-{index}"  # an Indexed Job's pod hostname
            annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
            env = {**pod_env(container, annotations, hostname), "JOB_COMPLETION_INDEX": str(index)}
            pods.append(PodSpec(hostname, (f"{hostname}.{subdomain}", hostname), env))
    return pods


def test_the_operator_environment_is_what_the_operators_give() -> None:
    """The model of the operators above, pinned: PyTorchJob's elastic variables and an Indexed Job's rank."""
    elastic = pods_of(EXAMPLES / "pytorchjob.yaml")
    assert [pod.env for pod in elastic] == [
        {"HOSTNAME": f"aelastic-elastic-worker-{i}", "PET_NPROC_PER_NODE": "2",
         "TORCHELASTIC_HEALTH_CHECK_PORT": "29600", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "10", "PYTHONUNBUFFERED": "0",
         "PET_RDZV_ENDPOINT": "aelastic-elastic-rdzv:29400", "PET_RDZV_BACKEND": "c10d", "PET_NNODES": "1:2",
         "PET_MAX_RESTARTS": "3", "PET_RDZV_ID": "aelastic-elastic"}
        for i in range(2)
    ]  # fmt: skip
    indexed = pods_of(EXAMPLES / "indexed-job.yaml")
    assert [pod.env for pod in indexed] == [
        {"HOSTNAME": f"aelastic-indexed-{i}", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2",
         "PET_MASTER_ADDR": "aelastic-indexed-0.aelastic-indexed", "PET_MASTER_PORT": "29500", "PET_NODE_RANK": str(i),
         "TORCHELASTIC_HEALTH_CHECK_PORT": "29600", "JOB_COMPLETION_INDEX": str(i)}
        for i in range(2)
    ]  # fmt: skip


# --- the pods, on this machine -------------------------------------------------------------------------------------

# /app/train.py: a gloo all-reduce; each worker records what it saw, then waits for <out>/go (so the probes can be
# asked while the workers run) and meets the others at a barrier.
TRAINER = """\
import json, os, socket, time
import torch
import torch.distributed as dist

OUT = {out!r}
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
record = dict(rank=rank, world_size=world, sum=total.item(), host=socket.gethostname(), pid=os.getpid(),
              local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]), group_rank=int(os.environ["GROUP_RANK"]))
path = os.path.join(OUT, "rank%d-%d.json" % (rank, os.getpid()))
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.rename(path + ".tmp", path)
while not os.path.exists(os.path.join(OUT, "go")):
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
"""


@dataclass(frozen=True)
class Pod:
    spec: PodSpec
    netns: str
    addr: str
    link: str
    log: Path


class Cluster:
    """The pods of one test in network namespaces on a bridge; see the module docstring."""

    def __init__(self, tmp_path: Path, specs: list[PodSpec]) -> None:
        tag = secrets.token_hex(3)
        # 10.251-254.x.0/24: the fault suite's subnets use 10.1-250, so a parallel run never shares one.
        self.subnet = f"10.{251 + int(tag[:2], 16) % 4}.{int(tag[2:4], 16)}"
        self.bridge = f"akb{tag}"
        self.pods = [
            Pod(spec, f"ak-{tag}-{i}", f"{self.subnet}.{i + 1}", f"akv{tag}{i}", tmp_path / f"{spec.hostname}.log")
            for i, spec in enumerate(specs)
        ]
        self.procs: list[subprocess.Popen[bytes]] = []
        self._made: list[str] = []

    def build(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)  # this process probes the pods, as a kubelet
        ip("link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{pod.addr} {' '.join(pod.spec.dns_names)}\n" for pod in self.pods
        )  # fmt: skip
        for pod in self.pods:
            ip("netns", "add", pod.netns)
            self._made.append(pod.netns)
            etc = Path("/etc/netns") / pod.netns
            etc.mkdir(parents=True)
            (etc / "hosts").write_text(hosts)
            ip("link", "add", pod.link, "type", "veth", "peer", "name", "eth0", "netns", pod.netns)
            ip("link", "set", pod.link, "master", self.bridge, "up")
            ip("-n", pod.netns, "addr", "add", f"{pod.addr}/24", "dev", "eth0")
            ip("-n", pod.netns, "link", "set", "eth0", "up")
            ip("-n", pod.netns, "link", "set", "lo", "up")

    def start(self, pod: Pod, argv: list[str]) -> subprocess.Popen[bytes]:
        """``argv`` as the pod's container: its network, its hostname, only its environment."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/root", **pod.spec.env}
        wrapper = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', pod.spec.hostname]
        with pod.log.open("ab") as log:
            proc = subprocess.Popen(["ip", "netns", "exec", pod.netns, *wrapper, *argv], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
        self.procs.append(proc)
        return proc

    def teardown(self) -> None:
        for netns in self._made:
            pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, check=False)
            for pid in map(int, pids.stdout.split()):
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        for netns in self._made:
            deadline = time.monotonic() + 30
            while subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.strip():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)  # SIGKILLed workers of a SIGKILLed agent: reaped by init, no event here
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
            shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)

    def logs(self) -> str:
        return "\n".join(f"--- {pod.spec.hostname}:\n{pod.log.read_text(errors='replace')[-3000:]}"
                         for pod in self.pods if pod.log.exists())  # fmt: skip


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def namespaces_permitted() -> str | None:
    """None if this process may build network namespaces, else why not."""
    if os.geteuid() != 0:
        return "the pods run in network namespaces: that needs root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "the pods run in network namespaces: that needs iproute2 (ip) and util-linux (unshare)"
    probe = f"ak-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    if made.returncode != 0:
        return f"'ip netns add' is not permitted here: {made.stderr.strip()}"
    return None


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a kubelet's probe goes to the pod


def probe(addr: str, port: int, path: str) -> tuple[int, dict[str, Any]] | None:
    """What a kubelet's httpGet probe gets: the status and the JSON body; None when nothing answers yet."""
    try:
        with _DIRECT.open(f"http://{addr}:{port}{path}", timeout=5) as answer:
            return int(answer.status), json.loads(answer.read())
    except urllib.error.HTTPError as answer:
        return int(answer.code), json.loads(answer.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def wait_for(what: str, check: Callable[[], T | None], cluster: Cluster) -> T:
    """Poll ``check`` (a probe is a poll by nature) until it returns something; on timeout fail with the logs."""
    return poll_until(what, check, DEADLINE, 0.05, cluster.logs)


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[[list[PodSpec]], Cluster]]:
    pytest.importorskip("torch")
    why = namespaces_permitted()
    if why is not None:
        pytest.skip(why)
    made: list[Cluster] = []

    def make(specs: list[PodSpec]) -> Cluster:
        cluster = Cluster(tmp_path, specs)
        made.append(cluster)
        cluster.build()
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.teardown()


@pytest.mark.torch
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.stem)
def test_two_pods_with_the_operators_environment_train_in_one_world(
    path: Path, tmp_path: Path, make_cluster: Callable[[list[PodSpec]], Cluster]
) -> None:
    """Both pods run the manifest's command with the operator's environment and nothing else: one world of 4 ranks
    all-reduces to the end; the probes answer as documented before the round, during the run and not after it."""
    doc = workload(path)
    container = main_container(doc)
    out = tmp_path / "out"
    out.mkdir()
    trainer = tmp_path / "train.py"
    trainer.write_text(TRAINER.format(out=str(out)))
    # The container's command, as written: aelastic is this interpreter's, /app/train.py the trainer above.
    argv = [{"aelastic": sys.executable, "/app/train.py": str(trainer)}.get(arg, arg) for arg in container["command"]]
    argv[1:1] = ["-m", "aelastic"]
    port = probe_port(container, container["readinessProbe"])
    cluster = make_cluster(pods_of(path))
    first, second = cluster.pods

    # Node 0 alone: its agent answers (the startup and liveness probes pass) but no round is complete.
    agents = [cluster.start(first, argv)]
    health = wait_for("answer from node 0's /health", lambda: probe(first.addr, port, "/health"), cluster)
    assert health == (200, {"state": "INIT", "workers_alive": 0, "reason": "workers starting"})
    assert probe(first.addr, port, "/ready") == (
        503, {"state": "INIT", "workers_alive": 0, "reason": "waiting for the first rendezvous round"}
    )  # fmt: skip

    agents.append(cluster.start(second, argv))

    def records() -> list[dict[str, Any]] | None:
        found = [json.loads(p.read_text()) for p in out.glob("rank*.json")]
        final = [r for r in found if r["world_size"] == 4]
        return final if len(final) == 4 else None

    final = wait_for("all-reduce in a world of 4", records, cluster)
    assert sorted(r["rank"] for r in final) == [0, 1, 2, 3]
    assert {r["sum"] for r in final} == {10.0}  # 1 + 2 + 3 + 4: every rank in one world
    assert {r["local_world_size"] for r in final} == {2}
    assert {r["host"]: r["group_rank"] for r in final} == {first.spec.hostname: 0, second.spec.hostname: 1}
    for pod in cluster.pods:
        answer = wait_for(f"200 from {pod.spec.hostname}'s /ready",
                          lambda pod=pod: (lambda a: a if a and a[0] == 200 else None)(probe(pod.addr, port, "/ready")),
                          cluster)  # fmt: skip
        assert answer == (200, {"state": "HEALTHY", "workers_alive": 2,
                                "reason": "workers running after a complete rendezvous round"})  # fmt: skip
        assert probe(pod.addr, port, "/health") == (
            200, {"state": "HEALTHY", "workers_alive": 2, "reason": "workers running"}
        )  # fmt: skip

    (out / "go").touch()
    for agent in agents:
        try:
            code = agent.wait(DEADLINE)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"an agent still runs after {DEADLINE:g} s\n{cluster.logs()}") from None
        assert code == 0, cluster.logs()
    # Every record of a smaller world (a first round node 0 completed alone) was restarted away: none is final.
    assert len(list(out.glob("rank*.json"))) >= 4
