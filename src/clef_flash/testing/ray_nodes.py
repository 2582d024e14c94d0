"""Ray nodes started as a user starts them on several machines (`ray start --head`, `ray start --address`), here on one
machine, for the multi-node tests and benchmarks/ray_multinode.py. Test-only: nothing outside tests and benchmarks imports it.

Each node is its own session (`setsid`): what Ray started for it, its raylet and that raylet's workers, are found by that
session id (and by this cluster's own temp dir in their command lines), so `kill_node` and `stop` touch this cluster's
processes only, never another Ray on the machine (`ray stop` would stop every Ray of this user).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

OBJECT_STORE_BYTES = 80 * 1024**2  # Ray's floor is 75 MiB; blocks of records are kilobytes
HEALTH_CHECKS = {"period_ms": 1000, "timeout_ms": 2000, "failure_threshold": 5}
AGENT_PORT_FLAGS = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ray_cli() -> str:
    """The `ray` command beside this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else shutil.which("ray") or "ray"


def session_of(pid: int) -> int | None:
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    return None


def command_line(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


def live(pid: int) -> bool:
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    return False


@dataclass
class Node:
    name: str
    session: int  # the `ray start` process's pid: the session id of everything it started
    resources: dict[str, float]


@dataclass
class LocalNodes:
    """A head and worker nodes of `cpus` CPUs each, on this machine; `stop` leaves none of their processes."""

    cpus: int = 1
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cf-ray-", dir="/tmp")))  # short: socket paths
    port: int = field(default_factory=free_port)
    nodes: dict[str, Node] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def environment(self) -> dict[str, str]:
        # No token auth between these local nodes (a ~/.ray/auth_token makes `ray start` require it); no usage stats.
        # A lost node is declared dead after 5 missed 1 s health checks (Ray's default: 5 of 3 s, then ~30 s in all).
        return {
            **os.environ,
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            **{f"RAY_health_check_{name}": str(value) for name, value in HEALTH_CHECKS.items()},
        }

    def start(self, name: str) -> Node:
        """Start node `name` ("head" first); it carries a custom resource `name` so work can be pinned to it."""
        head = not self.nodes
        args = [ray_cli(), "start", "--num-cpus", str(self.cpus), "--object-store-memory", str(OBJECT_STORE_BYTES)]
        args += ["--disable-usage-stats", "--resources", f'{{"{name}": 1}}']
        for flag in AGENT_PORT_FLAGS:  # two nodes on one host: every per-node port must differ
            args += [flag, str(free_port())]
        if head:
            args += ["--head", "--port", str(self.port), "--include-dashboard", "false", "--temp-dir", str(self.root)]
            args += ["--ray-client-server-port", str(free_port())]
        else:
            args += ["--address", self.address]
        started = subprocess.Popen(args, env=self.environment(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        output, _ = started.communicate(timeout=120)
        if started.returncode:
            self.stop()
            raise RuntimeError(f"`ray start` of node {name} failed:\n{output.decode()[-3000:]}")
        self.nodes[name] = Node(name, started.pid, {"CPU": self.cpus, name: 1.0})
        return self.nodes[name]

    def pids(self, name: str | None = None) -> list[int]:
        """This cluster's live processes (of node `name` only, when given)."""
        sessions = {node.session for node in self.nodes.values() if name in (None, node.name)}
        marker = str(self.root).encode()
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid() and live(int(entry.name)):
                pid = int(entry.name)
                if session_of(pid) in sessions or (name is None and marker in command_line(pid)):
                    found.append(pid)
        return found

    def raylet(self, name: str) -> int:
        pids = [pid for pid in self.pids(name) if command_line(pid).split(b"\0")[0].endswith(b"/raylet")]
        if len(pids) != 1:
            raise RuntimeError(f"node {name}: {len(pids)} raylets")
        return pids[0]

    def kill_node(self, name: str) -> None:
        """SIGKILL node `name`'s raylet, as a machine lost: its workers exit when their raylet is gone; what is left of
        its session (log monitor, agents) is killed too, so that the node can be started again."""
        os.kill(self.raylet(name), signal.SIGKILL)
        self._kill(self.pids(name), grace=3.0)
        del self.nodes[name]

    def stop(self) -> None:
        for _ in range(3):  # a raylet killed as it starts a worker leaves that worker behind: look again
            pids = self.pids()
            if not pids:
                break
            self._kill(pids, grace=0.0)
        self.nodes.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill(self, pids: list[int], grace: float) -> None:
        deadline = time.monotonic() + grace
        while grace and any(live(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)  # let workers notice their raylet is gone, as they would on a real machine
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(live(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)




# -- what the tests and the benchmark run on such a cluster (its driver connected: `ray.init(address=nodes.address)`) --


def node_ids() -> dict[str, str]:
    """node name (its custom resource) -> Ray node id, of the live nodes."""
    import ray

    return {name: node["NodeID"] for node in ray.nodes() if node["Alive"] for name in node["Resources"] if name in ("head", "worker")}


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> float:
    """Seconds until `condition()` holds; an AssertionError naming `what` after `seconds`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < seconds, f"{what}: not within {seconds} s"
        time.sleep(0.2)
    return time.monotonic() - started


class KillTheWorkerNode:
    """A batch progress meter that kills the worker node's raylet once both nodes have scored lines (`nodes`: the
    Counter `run_ray_batch` fills)."""

    def __init__(self, cluster: LocalNodes, nodes: Counter[str]):
        self.cluster, self.nodes, self.lines = cluster, nodes, 0
        self.killed_after: int | None = None
        self.ids = node_ids()

    def advance(self, lines: int) -> None:
        self.lines += lines
        if self.killed_after is None and set(self.ids.values()) <= set(self.nodes):
            self.killed_after = self.lines
            self.cluster.kill_node("worker")

    def finish(self) -> None:
        pass

    def scored_by_name(self) -> dict[str, int]:
        names = {node_id: name for name, node_id in self.ids.items()}
        return {names.get(node, node): count for node, count in self.nodes.items()}


def replicas_by_node(cpus_per_replica: float) -> dict[str, int]:
    """node name -> Serve replicas on it, from its CPUs in use (one replica of `cpus_per_replica` > half a node each)."""
    from ray._private.state import available_resources_per_node

    free = available_resources_per_node()
    return {name: int(free.get(node_id, {}).get("CPU", 1.0) <= 1.0 - cpus_per_replica + 1e-9) for name, node_id in node_ids().items()}


def nodes_of(deployment: str) -> list[str]:
    """The names of the nodes where `deployment`'s live replicas run (Serve names their actors after the app and it)."""
    from ray._private.state import actors

    from ..distributed.ray_serve import APP_NAME

    names = {node_id: name for name, node_id in node_ids().items()}
    kind = f"ServeReplica:{APP_NAME}:{deployment}"
    return sorted(names.get(actor["Address"]["NodeID"], "?") for actor in actors(actor_state_name="ALIVE").values() if actor["ActorClassName"] == kind)


def running_replicas() -> int:
    from ray import serve

    from ..distributed.ray_serve import APP_NAME

    application = serve.status().applications.get(APP_NAME)
    return 0 if application is None else application.deployments["ClefFlash"].replica_states.get("RUNNING", 0)


@dataclass
class Outcome:
    status: int | str  # the HTTP status, "hang" (no answer within the timeout) or the client's exception
    body: str
    seconds: float
    started: float  # time.monotonic()


class Load:
    """`clients` threads posting `request` every `pause` s. Light: on a 2-core machine the nodes' restarts must not starve."""

    def __init__(self, url: str, request: dict, headers: dict, clients: int = 2, pause: float = 0.05, timeout: float = 30.0):
        self.url, self.request, self.headers = url, request, headers
        self.pause, self.timeout = pause, timeout
        self.outcomes: list[Outcome] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.client, daemon=True) for _ in range(clients)]

    def client(self) -> None:
        import httpx

        with httpx.Client(timeout=self.timeout) as http:
            while not self.stopping.is_set():
                started = time.monotonic()
                try:
                    response = http.post(self.url + "/v1/systemone", json=self.request, headers=self.headers)
                    status, body = response.status_code, response.text[:300]
                except httpx.TimeoutException:
                    status, body = "hang", ""
                except httpx.HTTPError as error:
                    status, body = type(error).__name__, str(error)[:300]
                self.outcomes.append(Outcome(status, body, time.monotonic() - started, started))
                time.sleep(self.pause)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(self.timeout + 5)


@dataclass
class ServeFault:
    outcomes: list[Outcome]
    killed: float  # when the worker node's raylet was killed (time.monotonic())
    noticed_s: float  # kill -> Serve counts one replica running
    restarted_s: float  # `ray start` of the worker node again -> both replicas running, one on each node
    recovered: float  # when both were running again

    def errors(self) -> list[Outcome]:
        return [outcome for outcome in self.outcomes if outcome.status != 200]

    def summary(self) -> str:
        statuses = Counter(outcome.status for outcome in self.outcomes)
        return (
            f"{len(self.outcomes)} requests: {dict(statuses)}; slowest {max(o.seconds for o in self.outcomes):.2f} s; "
            f"the lost replica noticed in {self.noticed_s:.1f} s; node started again -> both replicas serving in "
            f"{self.restarted_s:.1f} s"
        )


def serve_through_a_lost_node(
    cluster: LocalNodes,
    url: str,
    request: dict,
    headers: dict,
    *,
    cpus_per_replica: float,
    clients: int = 2,
    before_s: float = 2.0,
    alone_s: float = 2.0,
    after_s: float = 2.0,
) -> ServeFault:
    """Under load of `clients` (two replicas serving at `url`, one on each node): kill the worker node, serve on one
    replica for `alone_s`, start the node again, wait until both replicas serve, go on for `after_s`."""
    both = {"head": 1, "worker": 1}
    with Load(url, request, headers, clients=clients) as load:
        time.sleep(before_s)
        killed = time.monotonic()
        cluster.kill_node("worker")
        noticed = wait_for(lambda: running_replicas() == 1, 60, "the lost replica noticed")
        time.sleep(alone_s)
        restarted = time.monotonic()
        cluster.start("worker")
        wait_for(lambda: running_replicas() == 2 and replicas_by_node(cpus_per_replica) == both, 120, "both replicas back")
        recovered = time.monotonic()
        time.sleep(after_s)
    return ServeFault(load.outcomes, killed, noticed, recovered - restarted, recovered)


__all__ = ["KillTheWorkerNode", "Load", "LocalNodes", "Node", "ServeFault", "free_port", "node_ids", "nodes_of", "serve_through_a_lost_node", "wait_for"]
