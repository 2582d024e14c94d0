"""Batch scoring on Ray Data against the local batch (issue 16): the README's figures.

    python benchmarks/ray_batch.py [--model tiny | benchmarks/.peer/bundle-9b-part] [--records 192] [--workers 1,2]

On one machine, one local Ray cluster of its CPUs:
- local:   `BatchJob.run` in this process (torch's default threads), the model loaded before the clock starts.
- ray N:   `run_ray_batch` with N scoring actors (the default CPUs per worker: the cluster's less 0.5, shared;
           threads = that rounded), on a quarter of the records and on all of them: records/s from the
           difference (actor start and model load cancel out), and with them; the first run also gives
           the time from `ray.init` to the first answer (cluster start, actor start, model load, first
           block). With 1 worker (the local run's threads): the overhead per record, 1/rate(ray) - 1/rate(local).
- memory:  each scoring actor's peak RSS (VmHWM, sampled from /proc while it runs).
The outputs of every run are compared with the local one (the same lines; bytes equal when the blocks and
thread counts are). Run it on a quiet machine (load average < 1.5): it prints the load before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

import clef_flash
from clef_flash.batch import BatchJob
from clef_flash.distributed import EngineSpec
from clef_flash.machine import this_machine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import typical_request  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def write_input(path: Path, records: int) -> Path:
    """`records` typical tickets (~370 tokens, 3 questions), each state its own (no state reuse)."""
    lines = []
    for index in range(records):
        request = typical_request()
        request["state"] = f"Ticket {index}. " + request["state"]
        lines.append(json.dumps({**request, "id": index}))
    path.write_text("\n".join(lines) + "\n")
    return path


def descendants_titled(kind: str) -> list[int]:
    """Pids of this process's descendants whose command line holds `kind` (Ray sets actor titles)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                pass
    found = []
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor and ancestor != os.getpid():
            ancestor = parents.get(ancestor)
        try:
            if ancestor == os.getpid() and kind.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


class WorkerMemory(threading.Thread):
    """Samples the scoring actors' peak RSS (MB) every 0.2 s until stopped."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peaks: dict[int, float] = {}
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.2):
            for pid in descendants_titled("MapWorker("):
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                for line in status.splitlines():
                    if line.startswith("VmHWM:"):
                        self.peaks[pid] = max(self.peaks.get(pid, 0.0), int(line.split()[1]) / 1024)

    def stop(self) -> list[float]:
        self.stopping.set()
        self.join()
        return sorted(round(value) for value in self.peaks.values())


class Clock:
    """A progress meter that notes when each block is written (in input order, so the first blocks of
    several workers come late and then together)."""

    def __init__(self):
        self.times: list[tuple[float, int]] = []

    def advance(self, lines: int) -> None:
        self.times.append((time.perf_counter(), lines))

    def finish(self) -> None:
        pass


def lines_of(path: Path) -> list[tuple]:
    return [(row["line"], row["id"], "error" in row) for row in map(json.loads, path.read_text().splitlines())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--precision", help="default: this machine's for the model")
    parser.add_argument("--records", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/ray-batch-<model>.json)")
    args = parser.parse_args()
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"ray-batch-bench-{os.getpid()}"
    folder.mkdir(parents=True)
    source = write_input(folder / "in.jsonl", args.records)
    load_before = os.getloadavg()

    spec = EngineSpec.resolve(args.model, precision=args.precision, device="cpu")
    made_with = {"source": args.model, "precision": spec.precision}
    model = clef_flash.load(args.model, precision=spec.precision)
    model.answer(typical_request())  # warm
    local_out = folder / "local.jsonl"
    start = time.perf_counter()
    BatchJob.open(source, local_out, model=made_with).run(model, batch_size=args.batch_size)
    local_seconds = time.perf_counter() - start
    results = {
        "model": args.model,
        "precision": spec.precision,
        "records": args.records,
        "batch_size": args.batch_size,
        "cpu": this_machine().cpu,
        "cores": os.cpu_count(),
        "local": {"records_per_s": round(args.records / local_seconds, 2), "threads": torch.get_num_threads()},
    }
    del model

    import ray

    from clef_flash.distributed.ray_batch import plan_resources, run_ray_batch

    started = time.perf_counter()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, configure_logging=False, log_to_driver=False)
    short = write_input(folder / "short.jsonl", args.records // 4)
    for workers in map(int, args.workers.split(",")):
        runs = {}
        for name, path in (("short", short), ("full", source)):
            out = folder / f"ray-{workers}-{name}.jsonl"
            clock, memory = Clock(), WorkerMemory()
            memory.start()
            begin = time.perf_counter()
            run_ray_batch(BatchJob.open(path, out, model=made_with), spec, batch_size=args.batch_size, workers=workers, progress=clock)
            runs[name] = (time.perf_counter() - begin, clock.times[0][0] - begin, memory.stop(), out)
            if "init_to_first_answer_s" not in results:
                results["init_to_first_answer_s"] = round(clock.times[0][0] - started, 2)
            deadline = time.monotonic() + 60
            while descendants_titled("MapWorker(") and time.monotonic() < deadline:  # the next run's memory is its own
                time.sleep(0.2)
        (short_s, _, _, _), (full_s, first_block_s, peaks, out) = runs["short"], runs["full"]
        resources = plan_resources(workers, None, 0.0)
        run = {
            "cpus_per_worker": resources.cpus_per_worker,
            "threads_per_worker": max(1, round(resources.cpus_per_worker)),
            # the full job less the short one: actor start and model load cancel out
            "records_per_s": round((args.records - args.records // 4) / (full_s - short_s), 2),
            "records_per_s_with_start": round(args.records / full_s, 2),
            "first_block_s": round(first_block_s, 2),
            "worker_peak_rss_mb": peaks,
            "same_lines_as_local": lines_of(out) == lines_of(local_out),
            "same_bytes_as_local": out.read_bytes() == local_out.read_bytes(),
        }
        if workers == 1:  # the same threads as the local run: what Ray adds to each record
            local_rate = results["local"]["records_per_s"]
            run["overhead_ms_per_record_vs_local"] = round(1000 * (1 / run["records_per_s"] - 1 / local_rate), 1)
        results[f"ray_{workers}"] = run
        print(f"ray, {workers} worker(s): {json.dumps(run)}", flush=True)
    ray.shutdown()
    results["load_average_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(results, indent=2))
    name = Path(args.model).name if args.model != "tiny" else "tiny"
    out_path = Path(args.out) if args.out else RESULTS / f"ray-batch-{name}.json"
    out_path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
