"""`--ray` across nodes: a head and a worker node started with `ray start` on this machine (1 CPU each), the tiny release.

Batch: a multi-schema JSONL scored on both nodes (each node's lines counted); the worker node's raylet SIGKILLed
mid-run (a machine lost): the run finishes on the head with the output byte for byte the local batch's, no line lost
or written twice. Serve: a replica on each node under load, the worker node killed: every request answered (200, or a
clean 503 that names the lost replica), none hanging; the node started again: both replicas serve again.
Run alone with `python -m pytest -q tests/test_ray_nodes.py`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from clef_flash.batch import BatchJob

pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*")]

MAX_LENGTH = 400
SCHEMAS = (
    {"questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"}}},
    {"questions": {"team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "Charges", "bugs": None}}}},
)
LINES = 40  # blocks of 2 lines, 2 schemas: 20 blocks, enough that the kill lands mid-run


@pytest.fixture(scope="module")
def cluster():
    """A head and a worker node of 1 CPU each (`ray start`), this process their driver; nothing of them left after."""
    ray = pytest.importorskip("ray")
    from clef_flash.testing.ray_nodes import LocalNodes

    nodes = LocalNodes(cpus=1)
    try:
        nodes.start("head")
        nodes.start("worker")
        ray.init(address=nodes.address, configure_logging=False, log_to_driver=False)
        yield nodes
    finally:
        from ray import serve

        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        nodes.stop()
        assert not nodes.pids(), "Ray processes of this cluster were left behind"


def node_ids() -> dict[str, str]:
    """node name (its custom resource) -> Ray node id, of the live nodes."""
    import ray

    return {
        name: node["NodeID"] for node in ray.nodes() if node["Alive"] for name in ("head", "worker") if name in node["Resources"]
    }


@pytest.fixture(scope="module")
def spec(cluster, tiny_dir):
    from clef_flash.distributed import EngineSpec

    return EngineSpec.resolve(str(tiny_dir), precision="fp32", device="cpu", max_length=MAX_LENGTH, threads=1)


@pytest.fixture(scope="module")
def requests_and_answers(tiny_dir, one_torch_thread, module_tmp) -> tuple[Path, list[Path], bytes]:
    """A JSONL of states (a broken line and a blank one among them), two schema files, and the local batch's output."""
    from clef_flash import load

    folder = module_tmp("nodes")
    lines = [json.dumps({"state": f"ticket {index}: charged twice for the plan", "id": f"t{index}"}) for index in range(LINES)]
    lines[3], lines[6] = "{not json", ""
    source = folder / "in.jsonl"
    source.write_text("".join(line + "\n" for line in lines))
    schemas = []
    for number, schema in enumerate(SCHEMAS):
        schemas.append(folder / f"schema{number}.json")
        schemas[-1].write_text(json.dumps(schema))
    model = load(tiny_dir, device="cpu", precision="fp32", max_length=MAX_LENGTH)
    BatchJob.open(source, folder / "local.jsonl", schema_path=schemas, model=made_with()).run(model, batch_size=2)
    return source, schemas, (folder / "local.jsonl").read_bytes()


def made_with() -> dict:
    return {"source": "tiny", "revision": None, "precision": "fp32", "max_length": MAX_LENGTH}


class KillTheWorkerNode:
    """A progress meter that SIGKILLs the worker node's raylet once both nodes have scored lines."""

    def __init__(self, cluster, nodes: Counter[str]):
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


def test_batch_on_two_nodes_survives_losing_the_worker_node(cluster, spec, requests_and_answers, tmp_path):
    """Two scoring actors of 0.75 CPU (one fits a node); the worker node is lost mid-run: its blocks are scored
    again on the head, and the output is the local batch's byte for byte (same blocks, one thread each)."""
    from clef_flash.distributed.ray_batch import run_ray_batch

    if "worker" not in cluster.nodes:
        cluster.start("worker")
    source, schemas, expected = requests_and_answers
    job = BatchJob.open(source, tmp_path / "ray.jsonl", schema_path=schemas, model=made_with())
    scored: Counter[str] = Counter()
    progress = KillTheWorkerNode(cluster, scored)
    started = time.perf_counter()
    summary = run_ray_batch(job, spec, batch_size=2, workers=2, cpus_per_worker=0.75, progress=progress, nodes=scored)
    seconds = time.perf_counter() - started
    names = {node_id: name for name, node_id in progress.ids.items()}
    print(f"lines scored per node: { {names[node]: count for node, count in scored.items()} }; worker node killed after "
          f"{progress.killed_after} of {summary.written} lines written; {seconds:.1f} s")
    assert progress.killed_after is not None and progress.killed_after < summary.written, "the kill did not land mid-run"
    written = (tmp_path / "ray.jsonl").read_bytes()
    keys = [(row["line"], row["schema"]) for row in map(json.loads, written.splitlines())]
    assert len(keys) == len(set(keys)) == 2 * (LINES - 1)  # none lost, none twice (the blank line has none)
    assert written == expected



def test_a_node_with_another_plan_refuses_to_score(cluster, spec, requests_and_answers, tmp_path):
    """As a node of another CPU would resolve (another W8A8 kernel): the engine refuses, nothing is written."""
    import dataclasses

    from clef_flash.distributed.ray_batch import run_ray_batch
    from clef_flash.errors import ClefError

    source, schemas, _ = requests_and_answers
    job = BatchJob.open(source, tmp_path / "out.jsonl", schema_path=schemas, model=made_with())
    other = dataclasses.replace(spec, plan_key=spec.plan_key.replace("None", "onednn", 1))
    with pytest.raises(ClefError, match=r"resolved another plan than the driver .* one output never mixes plans"):
        run_ray_batch(job, other, batch_size=2, workers=1, cpus_per_worker=0.75)
    assert (tmp_path / "out.jsonl").read_bytes() == b""

SETTINGS = {"api_key": "nodes-key", "batch_wait_ms": 0}
AUTH = {"authorization": "Bearer nodes-key"}
TICKET = {"model": "clef-flash", "state": "Charged twice, refund please.", "questions": SCHEMAS[0]["questions"]}


def replicas_by_node() -> dict[str, int]:
    """node name -> Serve replicas on it (each replica takes 0.75 of the node's 1 CPU: a node holds at most one)."""
    from ray._private.state import available_resources_per_node

    free = available_resources_per_node()
    return {name: int(free.get(node_id, {}).get("CPU", 1.0) < 0.5) for name, node_id in node_ids().items()}


def running_replicas() -> int:
    from ray import serve

    from clef_flash.distributed.ray_serve import APP_NAME

    application = serve.status().applications.get(APP_NAME)
    return 0 if application is None else application.deployments["ClefFlash"].replica_states.get("RUNNING", 0)


class Load:
    """`clients` threads posting a record every `pause` s; each outcome is (status or "hang"/exception name, body,
    seconds, start). Light: on a 2-core machine the nodes' own restarts must not starve."""

    def __init__(self, url: str, clients: int = 2, pause: float = 0.05, timeout: float = 30.0):
        self.pause = pause
        self.url, self.timeout, self.outcomes = url, timeout, []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.client, daemon=True) for _ in range(clients)]

    def client(self) -> None:
        import httpx

        with httpx.Client(timeout=self.timeout) as http:
            while not self.stopping.is_set():
                started = time.monotonic()
                try:
                    response = http.post(self.url + "/v1/systemone", json=TICKET, headers=AUTH)
                    outcome = (response.status_code, response.text[:300])
                except httpx.TimeoutException:
                    outcome = ("hang", "")
                except httpx.HTTPError as error:
                    outcome = (type(error).__name__, str(error)[:300])
                self.outcomes.append((*outcome, time.monotonic() - started, started))
                time.sleep(self.pause)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(self.timeout + 5)

    def since(self, moment: float) -> list[tuple]:
        return [outcome for outcome in self.outcomes if outcome[3] >= moment]


def wait_for(condition, seconds: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < seconds, f"{what}: not within {seconds} s"
        time.sleep(0.2)
    return time.monotonic() - started


def test_serve_on_two_nodes_answers_through_losing_a_node(cluster, spec):
    import httpx
    from ray import serve

    from clef_flash.distributed.ray_serve import APP_NAME, serve_on_ray
    from clef_flash.testing.ray_nodes import free_port

    if "worker" not in cluster.nodes:  # the batch test lost it
        cluster.start("worker")
    port = free_port()
    serve_on_ray(spec, SETTINGS, port=port, replicas=2, cpus_per_replica=0.75, proxy_location="HeadOnly", blocking=False)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: running_replicas() == 2 and httpx.get(url + "/health").status_code == 200, 60, "two replicas")
        assert replicas_by_node() == {"head": 1, "worker": 1}
        with Load(url) as load:
            time.sleep(2.0)
            killed = time.monotonic()
            cluster.kill_node("worker")
            lost = wait_for(lambda: running_replicas() == 1, 60, "the lost replica noticed")
            time.sleep(2.0)  # one replica serves
            restarted = time.monotonic()
            cluster.start("worker")
            recovery = wait_for(lambda: running_replicas() == 2 and replicas_by_node() == {"head": 1, "worker": 1}, 90, "recovery")
            recovered = time.monotonic()
            time.sleep(2.0)
        outcomes = load.outcomes
        statuses = Counter(outcome[0] for outcome in outcomes)
        errors = [outcome for outcome in outcomes if outcome[0] != 200]
        print(f"{len(outcomes)} requests: {dict(statuses)}; slowest {max(outcome[2] for outcome in outcomes):.1f} s; "
              f"lost replica noticed in {lost:.1f} s; node restarted -> both replicas running in {recovered - restarted:.1f} s "
              f"(of which after `ray start` returned {recovery:.1f} s)")
        for status, body, seconds, started in errors:
            print(f"  {status} after {seconds:.2f} s at t={started - killed:+.2f} s: {body[:200]}")
        assert statuses[200] and not [outcome for outcome in errors if outcome[0] != 503], errors[:5]
        assert len(errors) <= 6, errors  # at most what was in flight on the lost replica, and the proxy's retries
        after = load.since(recovered)
        assert after and all(outcome[0] == 200 for outcome in after)
    finally:
        serve.delete(APP_NAME)
