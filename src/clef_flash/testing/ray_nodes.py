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
import time
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

    cpus: float = 1.0
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
        self._kill(self.pids(), grace=0.0)
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


__all__ = ["LocalNodes", "Node", "free_port"]
