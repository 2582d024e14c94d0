"""`--ray` on two nodes, and losing one (issue 43): the README's figures.

    python benchmarks/ray_multinode.py [--model tiny | DIR (e.g. benchmarks/.peer/bundle-9b-part)] [--records 96]
                                       [--cpus 1] [--batch-size 4] [--json benchmarks/results/ray-multinode.json]

A head and a worker node started with `ray start` on this machine (`clef_flash.testing.ray_nodes`: --cpus CPUs and an
80 MiB object store each, their own sessions), this process their driver:
- 1 node vs 2: `run_ray_batch` with one scoring actor on the head alone (the worker node not started yet), then one on
  each node: records/s with actor start and model load, and after the first block (the steady rate).
- kill and resume: two actors, the worker node's raylet SIGKILLed once both nodes have scored: lines scored per node,
  lines scored twice (the lost node's blocks), lines lost / written twice (0 / 0), bytes equal to the local batch's.
- Serve: a replica on each node under light load (2 clients), the worker node killed, started again 2 s later: the
  requests' statuses, the errors, the slowest answer, the time until Serve noticed, from `ray start` until both
  replicas serve again, and the front's count of requests forwarded again (their replica lost in flight) or 503.
Nodes on one machine share its cores: on a 2-core machine 2 nodes of 1 CPU are not two machines. Run it on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import clef_flash
from clef_flash.batch import BatchJob
from clef_flash.checkpoint.random_release import tiny_release
from clef_flash.distributed import EngineSpec
from clef_flash.distributed.ray_batch import run_ray_batch
from clef_flash.machine import this_machine
from clef_flash.testing.ray_nodes import KillTheWorkerNode, LocalNodes, node_ids, running_replicas, serve_through_a_lost_node, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ray_batch import Clock, write_input  # noqa: E402

SETTINGS = {"api_key": "bench-key", "batch_wait_ms": 0}
AUTH = {"authorization": "Bearer bench-key"}


def steady(clock: Clock) -> float:
    """Records/s after the first block (actor start and model load left out)."""
    (first, _), (last, _) = clock.times[0], clock.times[-1]
    return sum(lines for _, lines in clock.times[1:]) / (last - first) if last > first else float("nan")


def scored_run(spec: EngineSpec, source: Path, out: Path, made_with: dict, *, workers: int, cpus: float, batch_size: int) -> dict:
    job = BatchJob.open(source, out, model=made_with, overwrite=True)
    clock, nodes = Clock(), Counter()
    started = time.perf_counter()
    summary = run_ray_batch(job, spec, batch_size=batch_size, workers=workers, cpus_per_worker=cpus, progress=clock, nodes=nodes)
    seconds = time.perf_counter() - started
    names = {node_id: name for name, node_id in node_ids().items()}
    return {
        "workers": workers,
        "records_per_s_with_start": round(summary.written / seconds, 2),
        "records_per_s_steady": round(steady(clock), 2),
        "lines_per_node": {names.get(node, node): count for node, count in nodes.items()},
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--records", type=int, default=96)
    parser.add_argument("--cpus", type=int, default=1, help="CPUs of each node (default 1)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--json", help="write the figures here as JSON")
    args = parser.parse_args()

    import ray
    from ray import serve

    from clef_flash.distributed.ray_serve import APP_NAME, serve_on_ray
    from clef_flash.testing.ray_nodes import free_port

    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"ray-multinode-{os.getpid()}"
    work.mkdir(parents=True)
    source = write_input(work / "in.jsonl", args.records)
    model_dir = str(tiny_release()) if args.model == "tiny" else args.model  # a path every node reads
    made_with = {"source": model_dir, "revision": None, "precision": args.precision, "max_length": None}
    cpus = args.cpus - 0.25  # one engine per node; a read task's 0.25 beside it on the head
    threads = max(1, round(cpus))
    local = clef_flash.load(model_dir, device="cpu", precision=args.precision)
    import torch

    torch.set_num_threads(threads)
    BatchJob.open(source, work / "local.jsonl", model=made_with).run(local, batch_size=args.batch_size)
    del local
    expected = (work / "local.jsonl").read_bytes()

    cluster = LocalNodes(cpus=args.cpus)
    figures: dict = {"machine": this_machine().cpu, "model": args.model, "records": args.records, "node_cpus": args.cpus}
    try:
        cluster.start("head")
        ray.init(address=cluster.address, configure_logging=False, log_to_driver=False)
        spec = EngineSpec.resolve(model_dir, precision=args.precision, device="cpu", threads=threads)
        figures["one_node"] = scored_run(spec, source, work / "one.jsonl", made_with, workers=1, cpus=cpus, batch_size=args.batch_size)
        cluster.start("worker")
        figures["two_nodes"] = scored_run(spec, source, work / "two.jsonl", made_with, workers=2, cpus=cpus, batch_size=args.batch_size)
        for run in ("one", "two"):
            figures[f"{run}_equals_local"] = (work / f"{run}.jsonl").read_bytes() == expected

        job = BatchJob.open(source, work / "kill.jsonl", model=made_with)
        nodes: Counter[str] = Counter()
        progress = KillTheWorkerNode(cluster, nodes)
        started = time.perf_counter()
        summary = run_ray_batch(job, spec, batch_size=args.batch_size, workers=2, cpus_per_worker=cpus, progress=progress, nodes=nodes)
        written = (work / "kill.jsonl").read_bytes()
        keys = [row["line"] for row in map(json.loads, written.splitlines())]
        figures["kill_and_resume"] = {
            "lines_per_node": progress.scored_by_name(),
            "killed_after_lines": progress.killed_after,
            "lines_scored_twice": sum(nodes.values()) - summary.written,
            "lines_lost": len(expected.splitlines()) - len(set(keys)),
            "lines_written_twice": len(keys) - len(set(keys)),
            "equals_local": written == expected,
            "seconds": round(time.perf_counter() - started, 1),
        }

        cluster.start("worker")
        port = free_port()
        serve_on_ray(spec, SETTINGS, port=port, replicas=2, cpus_per_replica=cpus, proxy_location="HeadOnly", blocking=False)
        wait_for(lambda: running_replicas() == 2, 120, "two replicas")
        ticket = {"model": "clef-flash", "state": "Charged twice, refund please.", "questions": {"refund": {"type": "noul"}}}
        fault = serve_through_a_lost_node(cluster, f"http://127.0.0.1:{port}", ticket, AUTH, cpus_per_replica=cpus)
        print(fault.summary())
        figures["serve"] = {
            "requests": len(fault.outcomes),
            "statuses": {str(status): count for status, count in Counter(o.status for o in fault.outcomes).items()},
            "errors": [{"status": e.status, "at_s": round(e.started - fault.killed, 2), "body": e.body[:120]} for e in fault.errors()],
            "slowest_s": round(max(o.seconds for o in fault.outcomes), 2),
            "noticed_s": round(fault.noticed_s, 1),
            "recovery_s": round(fault.restarted_s, 1),
            # the front's own count: requests whose replica was lost in flight, forwarded once more (or answered 503)
            "front": serve.get_deployment_handle("Front", APP_NAME).stats.remote().result(timeout_s=30),
        }
        serve.delete(APP_NAME)
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        cluster.stop()
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
