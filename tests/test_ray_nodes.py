"""`--ray` across nodes: a head and a worker node started with `ray start` on this machine (1 CPU each), the tiny release.

Batch: a multi-schema JSONL scored on both nodes (each node's lines counted); the worker node's raylet SIGKILLed
mid-run (a machine lost): the run finishes on the head with the output byte for byte the local batch's, no line lost
or written twice. Serve: a replica on each node and the front on the head, under load, the worker node killed: every
request answered, none hanging, a request in flight on the lost replica forwarded again by the front, the errors few
and each a clean 503 (no proxy 500); the node started again: both replicas serve again (the batch test then runs on
the node as it came back). ~2.5 min on a
busy 2-core machine, most of it `ray start` and engines loading (a node restarted: ~40 s until its replica serves).
Run alone with `python -m pytest -q tests/test_ray_nodes.py`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from pathlib import Path

import pytest

from clef_flash.batch import BatchJob

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*")]

MAX_LENGTH = 400
SCHEMAS = (
    {"questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"}}},
    {"questions": {"team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "Charges", "bugs": None}}}},
)
LINES = 40  # blocks of 2 lines, 2 schemas: 20 blocks, enough that the kill lands mid-run
CPUS_PER_ENGINE = 0.75  # of a node's 1 CPU: one scoring actor or replica per node


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


# Each request waits a quarter second in its replica's batch queue, and 4 clients post: the kill mostly finds some in
# flight on the worker's replica (what the front forwards again).
SETTINGS = {"api_key": "nodes-key", "batch_wait_ms": 250}
CLIENTS = 4
AUTH = {"authorization": "Bearer nodes-key"}
TICKET = {"model": "clef-flash", "state": "Charged twice, refund please.", "questions": SCHEMAS[0]["questions"]}


def test_serve_on_two_nodes_answers_through_losing_a_node(cluster, spec):
    import httpx
    from ray import serve

    from clef_flash.distributed.ray_serve import APP_NAME, serve_on_ray
    from clef_flash.testing.ray_nodes import free_port, nodes_of, replicas_by_node, running_replicas, serve_through_a_lost_node, wait_for

    port = free_port()
    serve_on_ray(spec, SETTINGS, port=port, replicas=2, cpus_per_replica=CPUS_PER_ENGINE, proxy_location="HeadOnly", blocking=False)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: running_replicas() == 2 and httpx.get(url + "/health").status_code == 200, 60, "two replicas")
        assert replicas_by_node(CPUS_PER_ENGINE) == {"head": 1, "worker": 1} and nodes_of("Front") == ["head"]
        fault = serve_through_a_lost_node(cluster, url, TICKET, AUTH, cpus_per_replica=CPUS_PER_ENGINE, clients=CLIENTS)
        front = serve.get_deployment_handle("Front", APP_NAME).stats.remote().result(timeout_s=30)
        print(fault.summary())
        print(f"the front: {front['retried']} requests forwarded again, {front['unavailable']} answered 503; failed attempts {front['errors']}")
        for error in fault.errors():
            print(f"  {error.status} after {error.seconds:.2f} s at t={error.started - fault.killed:+.2f} s: {error.body[:200]}")
        assert sum(outcome.status == 200 for outcome in fault.outcomes) > 100
        # A request in flight on the lost replica is forwarded again; only when that fails too, a clean 503 in the
        # route's shape: never a hang, never the proxy's 500, and only about the kill.
        assert all(error.status == 503 and "retry after" in error.body for error in fault.errors()), fault.errors()[:3]
        assert len(fault.errors()) <= 6 and all(error.started < fault.recovered for error in fault.errors())
        assert nodes_of("Front") == ["head"]
    finally:
        serve.delete(APP_NAME)


def test_batch_on_two_nodes_survives_losing_the_worker_node(cluster, spec, requests_and_answers, tmp_path):
    """Two scoring actors of 0.75 CPU (one fits a node); the worker node is lost mid-run: its blocks are scored
    again on the head, and the output is the local batch's byte for byte (same blocks, one thread each)."""
    from clef_flash.distributed.ray_batch import run_ray_batch
    from clef_flash.testing.ray_nodes import KillTheWorkerNode

    source, schemas, expected = requests_and_answers  # the worker node is back from the Serve test; its replica gone
    job = BatchJob.open(source, tmp_path / "ray.jsonl", schema_path=schemas, model=made_with())
    scored: Counter[str] = Counter()
    progress = KillTheWorkerNode(cluster, scored)
    started = time.perf_counter()
    summary = run_ray_batch(job, spec, batch_size=2, workers=2, cpus_per_worker=CPUS_PER_ENGINE, progress=progress, nodes=scored)
    print(f"lines scored per node: {progress.scored_by_name()}; worker node killed after {progress.killed_after} of "
          f"{summary.written} lines written; {time.perf_counter() - started:.1f} s")
    assert progress.killed_after is not None and progress.killed_after < summary.written, "the kill did not land mid-run"
    written = (tmp_path / "ray.jsonl").read_bytes()
    keys = [(row["line"], row["schema"]) for row in map(json.loads, written.splitlines())]
    assert len(keys) == len(set(keys)) == 2 * (LINES - 1)  # none lost, none twice (the blank line has none)
    assert written == expected



def test_a_node_with_another_plan_refuses_to_score(cluster, spec, requests_and_answers, tmp_path):
    """As a node of another CPU would resolve (another W8A8 kernel): the engine refuses, nothing is written."""
    from clef_flash.distributed.ray_batch import run_ray_batch
    from clef_flash.errors import ClefError

    source, schemas, _ = requests_and_answers
    job = BatchJob.open(source, tmp_path / "out.jsonl", schema_path=schemas, model=made_with())
    other = dataclasses.replace(spec, plan_key=spec.plan_key.replace("None", "onednn", 1))
    with pytest.raises(ClefError, match=r"resolved another plan than the driver .* one output never mixes plans"):
        run_ray_batch(job, other, batch_size=2, workers=1, cpus_per_worker=CPUS_PER_ENGINE)
    assert (tmp_path / "out.jsonl").read_bytes() == b""
