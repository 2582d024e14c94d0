"""`clef-flash batch --ray`: batch scoring on a Ray cluster, with the guarantees of the local job.

    driver     BatchJob.open (progress file, what is done) -> plan: the fixed blocks of `batch_size`
               input lines that still have a line to write (offsets only, from one scan)
    Ray Data   read_datasource(InputBlocks): read tasks on the driver's node read each block's lines
               (a JSONL byte range, or Parquet rows), one Ray block per input block
               -> map_batches(BlockScorer, batch_size=1): an actor pool, one engine per actor, built
               once from an EngineSpec (source + the driver's plan, never weights; a worker whose own plan
               differs says so, and the run's Summary.notes carry it)
    driver     iter_batches (preserve_order): each scored block, in input order -> BatchJob.append:
               its missing lines appended, flushed and fsynced, as the local job does

So the output is the local job's: one line per input line (per schema) in input order, error lines,
the same blocks (a record has the same batch neighbours, so with equal thread counts the bytes are
equal), and the same resume: a rerun after the driver died skips what is written, and a block cut
short is scored again whole with only its missing lines written. A worker that dies is restarted by
Ray and its block retried (blocks are deterministic), so nothing is lost or written twice. The output
is one file written by the driver, not Ray Data's writers (a directory of files in no fixed order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
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
RESERVED_CPUS = 0.5  # what the default leaves for the read tasks and the driver on the smallest node


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
        self.model = spec.load()
        self.note = spec.plan_note(self.model)  # the job's record says so too (run_ray_batch's notes)
        self.schemas = schemas

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        blocks, lines, schemas, outputs, errors, notes = [], [], [], [], [], []
        for block, numbers, raws in zip(*(batch.column(name).to_pylist() for name in ("block", "line", "raw"))):
            rows = [row for number, raw in zip(numbers, raws) for row in decode_rows(number, raw, self.schemas)]
            scored = score_block(self.model, rows)
            blocks.append(block)
            lines.append([key[0] for key, _, _ in scored])
            schemas.append([key[1] for key, _, _ in scored])
            outputs.append([output for _, output, _ in scored])
            errors.append([error for _, _, error in scored])
            notes.append(self.note)
        return pa.table(
            {
                "block": pa.array(blocks, pa.int64()),
                "line": pa.array(lines, pa.list_(pa.int64())),
                "schema": pa.array(schemas, pa.list_(pa.int64())),
                "output": pa.array(outputs, pa.list_(pa.binary())),
                "error": pa.array(errors, pa.list_(pa.bool_())),
                "note": pa.array(notes, pa.string()),
            }
        )


def scored_blocks(tables: Any, notes: list[str]) -> Iterator[list[OutputLine]]:
    """The scorers' tables, as the output lines of each block; their workers' notes join `notes` (each once)."""
    for table in tables:
        for block in table.to_pylist():
            if block["note"] is not None and block["note"] not in notes:
                notes.append(block["note"])
            yield [((line, schema), output, error) for line, schema, output, error in zip(block["line"], block["schema"], block["output"], block["error"])]


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
) -> Summary:
    """Score what `job`'s output lacks on Ray (joining `address`, or starting a local cluster) and
    append it as `job.run` would. Each worker runs `spec` with max(1, round(cpus_per_worker)) threads
    unless the spec says otherwise."""
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
            override_num_blocks=max(1, math.ceil(len(blocks) / BLOCKS_PER_READ)),  # read tasks; each yields its blocks
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
        notes: list[str] = []
        try:
            return dataclasses.replace(job.append(scored_blocks(tables, notes), progress), notes=notes)
        except ray.exceptions.RayError as error:
            raise ClefError(f"a Ray worker failed: {worker_failure(error)}") from error


@contextlib.contextmanager
def ordered_execution() -> Iterator[None]:
    """Ray Data's process-wide context, for this job only: blocks in input order, no progress bars (ours
    counts lines), no execution banner; what it was is put back afterwards."""
    import ray.data
    from ray.util.debug import log_once

    context = ray.data.DataContext.get_current()
    before = (context.execution_options.preserve_order, context.enable_progress_bars, context.print_on_execution_start)
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    log_once("ray_data_progress_manager_disabled")  # and Ray Data need not warn that they are off
    try:
        yield
    finally:
        context.execution_options.preserve_order, context.enable_progress_bars, context.print_on_execution_start = before


def worker_failure(error: Exception) -> str:
    """The worker's own exception, in one line, from the Ray error that carries it."""
    cause = getattr(error, "cause", None)  # a failed task: the worker's exception
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    lines = str(error).strip().splitlines()  # an actor that died in its constructor: the traceback's last line
    return lines[-1] if lines else type(error).__name__


__all__ = ["Block", "BlockScorer", "plan_blocks", "run_ray_batch"]
