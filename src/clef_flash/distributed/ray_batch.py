"""`clef-flash batch --ray`: batch scoring on a Ray cluster, with the guarantees of the local job.

    driver     BatchJob.open (progress file, what is done) -> plan: the fixed blocks of `batch_size`
               input lines that still have a line to write (offsets only, from one scan)
    Ray Data   read_datasource(InputBlocks): read tasks on the driver's node read each block's lines
               (a JSONL byte range, or Parquet rows), one Ray block per input block, at least 4 read
               tasks per actor (a read task's blocks reach one actor)
               -> map_batches(BlockScorer, batch_size=1): an actor pool, one engine per actor, built
               once from an EngineSpec (source + the driver's plan, never weights), all loaded before
               the first block; each scored block names the node that scored it
    driver     iter_batches (preserve_order): each scored block, in input order -> BatchJob.append:
               its missing lines appended, flushed and fsynced, as the local job does

So the output is the local job's: one line per input line (per schema) in input order, error lines,
the same blocks (a record has the same batch neighbours, so with equal thread counts the bytes are
equal), and the same resume: a rerun after the driver died skips what is written, and a block cut
short is scored again whole with only its missing lines written. A worker that dies is restarted by
Ray and its block retried (blocks are deterministic), so nothing is lost or written twice; a node that
dies takes its actors and the blocks it held with it, and those blocks are scored again on the nodes left. The output
is one file written by the driver, not Ray Data's writers (a directory of files in no fixed order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..batch import (
    BatchJob,
    OutputLine,
    Summary,
    check_batch_size,
    decode_rows,
    is_parquet,
    nonblank_lines,
    parquet_lines,
    schema_numbers,
    score_block,
)
from ..console import ProgressBar
from ..errors import ClefError
from . import EngineSpec, connect, require_ray

READ_CPUS = 0.25  # each read task's share: reading is light, and must not wait behind the scorers
BLOCKS_PER_READ = 16  # input blocks per read task: few tasks, each streaming its blocks one by one
READS_PER_WORKER = 4  # and at least this many read tasks per scoring actor, so that a small job reaches every actor
RESERVED_CPUS = 0.5  # what the default leaves for the read tasks and the driver on the smallest node
ENGINES_LOADED_S = 600  # the longest the scoring actors may take to load their engines (a 9B from a cold disk)


@dataclass(frozen=True)
class Block:
    """One fixed block of input lines: lines `index * B + 1 ..`, found at `start..stop` (JSONL: bytes;
    Parquet: rows from 0)."""

    index: int
    start: int
    stop: int


def plan_blocks(job: BatchJob, batch_size: int) -> list[Block]:
    """The blocks that still have a line to write (one scan of the input, keeping offsets only)."""
    check_batch_size(batch_size)
    numbers = schema_numbers(job.schemas)
    blocks = []

    def keep(index: int, start: int, stop: int, lines: list[int]) -> None:
        if any((line, number) not in job.done for line in lines for number in numbers):
            blocks.append(Block(index, start, stop))

    if is_parquet(job.input_path):
        import pyarrow.parquet as parquet

        rows = parquet.ParquetFile(job.input_path).metadata.num_rows
        for index, start in enumerate(range(0, rows, batch_size)):
            stop = min(rows, start + batch_size)
            keep(index, start, stop, list(range(start + 1, stop + 1)))
        return blocks
    with open(job.input_path, "rb") as handle:
        offset, index, start, lines = 0, 0, 0, []
        for number, raw in enumerate(handle, start=1):
            if (number - 1) // batch_size != index:
                keep(index, start, offset, lines)
                index, start, lines = (number - 1) // batch_size, offset, []
            if raw.strip():
                lines.append(number)
            offset += len(raw)
        keep(index, start, offset, lines)
    return blocks


def read_blocks(path: Path, batch_size: int, blocks: list[Block]) -> Iterator[Any]:
    """A read task: one Arrow table per block, `{block, line: [numbers], raw: [contents]}`."""
    import pyarrow as pa

    def table(block: Block, lines: list[tuple[int, bytes]]) -> Any:
        return pa.table(
            {
                "block": pa.array([block.index], pa.int64()),
                "line": pa.array([[number for number, _ in lines]], pa.list_(pa.int64())),
                "raw": pa.array([[raw for _, raw in lines]], pa.list_(pa.binary())),
            }
        )

    if is_parquet(path):
        for block in blocks:
            yield table(block, list(parquet_lines(path, block.start, block.stop)))
        return
    with open(path, "rb") as handle:
        for block in blocks:
            handle.seek(block.start)
            data = io.BytesIO(handle.read(block.stop - block.start))  # split on b"\n" alone, as a file is
            yield table(block, list(nonblank_lines(data, block.index * batch_size + 1)))


def input_blocks(path: Path, batch_size: int, blocks: list[Block]) -> Any:
    """The Ray Data datasource of `blocks` (defined here so that ray is imported only when used)."""
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class InputBlocks(Datasource):
        """The input's pending blocks, read on the driver's node (the input need only be there)."""

        def estimate_inmemory_data_size(self) -> int:
            return sum(block.stop - block.start for block in blocks) if not is_parquet(path) else 0

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None) -> list[Any]:
            size = max(1, math.ceil(len(blocks) / max(1, parallelism)))
            return [
                ReadTask(
                    lambda chunk=chunk: read_blocks(path, batch_size, chunk),
                    BlockMetadata(num_rows=len(chunk), size_bytes=None, input_files=[str(path)], exec_stats=None),
                )
                for chunk in (blocks[at : at + size] for at in range(0, len(blocks), size))
            ]

        @property
        def supports_distributed_reads(self) -> bool:
            return False

    return InputBlocks()


class BlockScorer:
    """A Ray Data actor: one engine, built once from the spec; scores one block per call."""

    def __init__(self, spec: EngineSpec, schemas: list[dict[str, Any]]):
        import ray

        self.model = spec.load()
        self.schemas = schemas
        self.node = ray.get_runtime_context().get_node_id()  # where this engine runs: the run's provenance

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        blocks, lines, schemas, outputs, errors = [], [], [], [], []
        for block, numbers, raws in zip(*(batch.column(name).to_pylist() for name in ("block", "line", "raw"))):
            rows = [row for number, raw in zip(numbers, raws) for row in decode_rows(number, raw, self.schemas)]
            scored = score_block(self.model, rows)
            blocks.append(block)
            lines.append([key[0] for key, _, _ in scored])
            schemas.append([key[1] for key, _, _ in scored])
            outputs.append([output for _, output, _ in scored])
            errors.append([error for _, _, error in scored])
        return pa.table(
            {
                "block": pa.array(blocks, pa.int64()),
                "line": pa.array(lines, pa.list_(pa.int64())),
                "schema": pa.array(schemas, pa.list_(pa.int64())),
                "output": pa.array(outputs, pa.list_(pa.binary())),
                "error": pa.array(errors, pa.list_(pa.bool_())),
                "node": pa.array([self.node] * len(blocks), pa.string()),
            }
        )


def scored_blocks(tables: Any, nodes: Counter[str] | None = None) -> Iterator[list[OutputLine]]:
    """The scorers' tables, as the output lines of each block; `nodes` counts the lines each Ray node scored."""
    for table in tables:
        for block in table.to_pylist():
            if nodes is not None:
                nodes[block["node"]] += len(block["line"])
            yield [((line, schema), output, error) for line, schema, output, error in zip(block["line"], block["schema"], block["output"], block["error"])]


def read_tasks(blocks: int, workers: int) -> int:
    """How many read tasks read `blocks` input blocks: one per BLOCKS_PER_READ, and at least READS_PER_WORKER per
    worker (each read task's blocks reach the scorers as one input, which one actor takes: with fewer inputs than
    actors, the others, on other nodes, would score nothing)."""
    return max(1, min(blocks, max(math.ceil(blocks / BLOCKS_PER_READ), READS_PER_WORKER * workers)))


@dataclass(frozen=True)
class Resources:
    workers: int
    cpus_per_worker: float
    gpus_per_worker: float


def plan_resources(workers: int, cpus_per_worker: float | None, gpus_per_worker: float) -> Resources:
    """By default each worker gets an equal share of the cluster's CPUs less RESERVED_CPUS (at most a
    node's less that), so that Ray Data's read tasks and the driver are never starved."""
    if workers < 1:
        raise ClefError(f"--workers must be at least 1; got {workers}")
    if cpus_per_worker is None:
        ray = require_ray()
        nodes = [node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node.get("Alive")]
        total, largest = sum(nodes), max(nodes, default=0.0)
        cpus_per_worker = max(READ_CPUS, min((total - RESERVED_CPUS) / workers, largest - RESERVED_CPUS))
        if gpus_per_worker:
            cpus_per_worker = min(cpus_per_worker, 1.0)  # a GPU worker needs a core to feed it, not more
    if cpus_per_worker <= 0 or gpus_per_worker < 0:
        raise ClefError("--cpus-per-worker must be more than 0 and --gpus-per-worker at least 0")
    return Resources(workers, cpus_per_worker, gpus_per_worker)


def run_ray_batch(
    job: BatchJob,
    spec: EngineSpec,
    *,
    batch_size: int = 32,
    workers: int = 1,
    cpus_per_worker: float | None = None,
    gpus_per_worker: float = 0.0,
    address: str | None = None,
    progress: ProgressBar | None = None,
    nodes: Counter[str] | None = None,
) -> Summary:
    """Score what `job`'s output lacks on Ray (joining `address`, or starting a local cluster) and
    append it as `job.run` would. Each worker runs `spec` with max(1, round(cpus_per_worker)) threads
    unless the spec says otherwise. `nodes`, when given, counts the lines each Ray node id scored
    (scored, not written: a block scored twice after a failure counts twice)."""
    require_ray()
    connect(address)
    import ray.data

    check_batch_size(batch_size)
    resources = plan_resources(workers, cpus_per_worker, gpus_per_worker)
    if spec.threads is None:
        spec = dataclasses.replace(spec, threads=max(1, round(resources.cpus_per_worker)))
    blocks = plan_blocks(job, batch_size)
    with ordered_execution():
        dataset = ray.data.read_datasource(
            input_blocks(job.input_path, batch_size, blocks),
            override_num_blocks=read_tasks(len(blocks), resources.workers),
            num_cpus=READ_CPUS,
        ).map_batches(
            BlockScorer,
            fn_constructor_kwargs={"spec": spec, "schemas": job.schemas},
            batch_size=1,  # one input block per call: the local job's batches
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=resources.workers, max_tasks_in_flight_per_actor=2),
            num_cpus=resources.cpus_per_worker,
            num_gpus=resources.gpus_per_worker or None,
        )
        tables = dataset.iter_batches(batch_size=None, batch_format="pyarrow") if blocks else iter(())
        try:
            return job.append(scored_blocks(tables, nodes), progress)
        except ray.exceptions.RayError as error:
            raise ClefError(f"a Ray worker failed: {worker_failure(error)}") from error


@contextlib.contextmanager
def ordered_execution() -> Iterator[None]:
    """Ray Data's process-wide context, for this job only: blocks in input order, no progress bars (ours
    counts lines), no execution banner, every engine loaded before the first block is handed out; what it
    was is put back afterwards."""
    import ray.data
    from ray.util.debug import log_once

    context = ray.data.DataContext.get_current()
    fields = ("enable_progress_bars", "print_on_execution_start", "wait_for_min_actors_s")
    before = (context.execution_options.preserve_order, *(getattr(context, name) for name in fields))
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    # Ray Data's default hands blocks to the first engine loaded: on several nodes one that loads first took every
    # block while the others were still loading. Waiting spreads the work, and a pool the cluster cannot hold fails
    # after this many seconds instead of waiting forever.
    context.wait_for_min_actors_s = ENGINES_LOADED_S
    log_once("ray_data_progress_manager_disabled")  # and Ray Data need not warn that they are off
    try:
        yield
    finally:
        context.execution_options.preserve_order = before[0]
        for name, value in zip(fields, before[1:]):
            setattr(context, name, value)


def worker_failure(error: Exception) -> str:
    """The worker's own exception, in one line, from the Ray error that carries it."""
    cause = getattr(error, "cause", None)  # a failed task: the worker's exception
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    lines = str(error).strip().splitlines()  # an actor that died in its constructor: the traceback's last line
    return lines[-1] if lines else type(error).__name__


__all__ = ["Block", "BlockScorer", "plan_blocks", "run_ray_batch"]
