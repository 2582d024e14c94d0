"""Dynamic batching: a bounded queue of encoded records and one model worker thread.

The event loop validates and encodes a request, then `submit`s its record and awaits the job's
future; it never runs the model. The worker takes the oldest record, waits up to `batch_wait_s`
(counted from when that record arrived) for company, and runs as many queued records as fit the
token budget in one `Clef.score` call. Results go back to each job's event loop thread-safely.

A job whose client went away is `cancel`led: removed from the queue if still there, its result
dropped if it was already running (a running forward cannot be interrupted).

A job may be a task instead of a record (`submit_task`: an explanation, which runs many records of its own): the
worker runs it in its turn, counted against the token budget by the tokens it runs, so that nothing else uses the
model meanwhile.

Nothing waits on a dead worker: if the worker thread ends by an error, every queued and running job
fails with `WorkerUnavailable` and `submit` refuses new ones (`alive` is what /health reads). A
batch whose results do not match its records fails the records left over, loudly.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engine import QuestionResult, Timings, fitting
from ..errors import InferenceError
from ..request.records import EncodedRecord
from .metrics import ServerMetrics

if TYPE_CHECKING:
    from ..clef import Clef
    from .settings import ServerSettings

log = logging.getLogger("clef_flash.server")


class QueueFull(Exception):
    """The queue holds `max_queue` records already; the caller should answer 429."""


class WorkerUnavailable(Exception):
    """The model worker is not running (it died, or the server is shutting down); the caller answers 503."""


@dataclass(eq=False)
class Job:
    record: EncodedRecord | None  # None for a task
    future: asyncio.Future[list[QuestionResult]]
    loop: asyncio.AbstractEventLoop
    request_id: str = ""  # for the log
    enqueued: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when the worker took it into a batch
    finished: float | None = None
    task: Callable[[], Any] | None = None  # run on the model worker instead of scoring a record; its result answers
    task_tokens: int = 0  # the tokens the task runs (what it counts against a batch's budget)

    @property
    def tokens(self) -> int:
        return self.task_tokens if self.record is None else self.record.token_count

    def queue_ms(self) -> float:
        return ((self.started or self.enqueued) - self.enqueued) * 1000

    def model_ms(self) -> float:
        if self.started is None or self.finished is None:
            return 0.0
        return (self.finished - self.started) * 1000


def _resolve(future: asyncio.Future, result: list[QuestionResult] | None, error: BaseException | None) -> None:
    """Runs on the job's event loop. A cancelled future (client gone) is left alone."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Batcher:
    def __init__(
        self,
        model: Clef,
        metrics: ServerMetrics,
        *,
        batch_tokens: int,
        max_batch: int = 64,
        batch_wait_s: float = 0.005,
        max_queue: int = 256,
    ):
        if batch_tokens < 1 or max_batch < 1 or max_queue < 1 or batch_wait_s < 0:
            raise ValueError("batch_tokens, max_batch and max_queue must be positive; batch_wait_s at least 0")
        self.model = model
        self.metrics = metrics
        self.batch_tokens = batch_tokens
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.max_queue = max_queue
        self._queue: deque[Job] = deque()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._running: list[Job] = []  # the batch in the model now
        self._running_since: float | None = None
        self.death: str | None = None  # why the worker thread ended, if it did by an error

    # -- the event loop's side ----------------------------------------------------------------

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def alive(self) -> bool:
        """The worker thread is running and takes jobs."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def busy_for(self) -> float:
        """Seconds the batch now in the model has run (0 when idle): a stuck forward shows here."""
        since = self._running_since
        return 0.0 if since is None else time.perf_counter() - since

    def submit(self, record: EncodedRecord, request_id: str = "") -> Job:
        """Queue a record; raises QueueFull when the queue is at `max_queue`, WorkerUnavailable
        when the worker is not running."""
        loop = asyncio.get_running_loop()
        return self.enqueue(Job(record=record, future=loop.create_future(), loop=loop, request_id=request_id))

    def submit_task(self, task: Callable[[], Any], tokens: int, request_id: str = "") -> Job:
        """Queue `task` (run on the model worker, its return value the job's result; it runs `tokens` tokens), as
        `submit` queues a record."""
        loop = asyncio.get_running_loop()
        return self.enqueue(Job(record=None, future=loop.create_future(), loop=loop, request_id=request_id, task=task, task_tokens=tokens))

    def enqueue(self, job: Job) -> Job:
        with self._changed:
            if not self.alive:
                raise WorkerUnavailable(self.death or "the model worker is not running")
            if len(self._queue) >= self.max_queue:
                raise QueueFull
            self._queue.append(job)
            self._changed.notify()
        return job

    def cancel(self, job: Job) -> bool:
        """Forget a job whose client went away. True when it was still queued (never run)."""
        job.future.cancel()
        with self._changed:
            try:
                self._queue.remove(job)
            except ValueError:
                return False
        self.metrics.dropped.inc()
        return True

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._work, name="clef-flash-model", daemon=True)
            self._thread.start()

    def abandon(self, reason: str) -> int:
        """Fail every queued and running job with `WorkerUnavailable(reason)` (a running forward
        goes on; its results are dropped). How many jobs were failed."""
        with self._changed:
            jobs, self._queue = [*self._running, *self._queue], deque()
        for job in jobs:
            self._answer(job, None, WorkerUnavailable(reason))
        return len(jobs)

    def stop(self, timeout: float = 30.0) -> None:
        """Fail what is queued or running (503), end the worker, and wait up to `timeout` for it
        (a forward cannot be interrupted; the thread is a daemon)."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self.abandon("the server is shutting down")
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # -- the worker's side --------------------------------------------------------------------

    def _work(self) -> None:
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    return
                self._run(batch)
                with self._changed:
                    self._running, self._running_since = [], None
        except BaseException as error:  # the worker is gone: nobody may wait for it (not re-raised: logged here)
            self.death = f"the model worker stopped: {type(error).__name__}: {error}"
            log.critical("%s; failing every queued request", self.death, exc_info=True)
            with self._changed:
                self._stopping = True
            self.abandon(self.death)
            with self._changed:
                self._running, self._running_since = [], None

    def _fits(self) -> int:
        """How many queued jobs, oldest first, one forward can take: padded tokens within budget."""
        return fitting((job.tokens for job in self._queue), self.batch_tokens, self.max_batch)

    def _next_batch(self) -> list[Job] | None:
        with self._changed:
            while not self._queue and not self._stopping:
                self._changed.wait()
            if self._stopping:
                return None
            # Wait for company until the oldest record has waited batch_wait_s, or the batch is full.
            while not self._stopping and self._queue:
                count = self._fits()
                remaining = self._queue[0].enqueued + self.batch_wait_s - time.perf_counter()
                if count < len(self._queue) or count >= self.max_batch or remaining <= 0:
                    break
                self._changed.wait(remaining)
            if self._stopping or not self._queue:
                return None if self._stopping else []
            batch = [self._queue.popleft() for _ in range(self._fits())]
            started = time.perf_counter()
            for job in batch:
                job.started = started
            self._running, self._running_since = batch, started
        return batch

    def _run(self, batch: list[Job]) -> None:
        for job in [job for job in batch if job.task is not None]:
            self._run_task(job)
        batch = [job for job in batch if job.task is None]
        if not batch:
            return
        timings = Timings()
        try:
            results = self.model.score([job.record for job in batch], timings)
        except Exception as error:
            self.metrics.forwards.inc(timings.forwards)
            self.metrics.tokens_reused.inc(timings.tokens_reused)
            if len(batch) > 1:
                # Run each record alone, so that one bad record fails only its own request.
                log.warning("a batch of %d records failed (%s); retrying them one by one", len(batch), error)
                for job in batch:
                    job.started = time.perf_counter()
                    self._run([job])
                return
            job = batch[0]
            log.exception("inference failed (request id %s, %d tokens)", job.request_id, job.record.token_count)
            self.metrics.failures.inc()
            self._answer(job, None, InferenceError(f"inference failed: {type(error).__name__}: {error}"))
            return
        finished = time.perf_counter()
        self.metrics.forwards.inc(timings.forwards)
        self.metrics.tokens_reused.inc(timings.tokens_reused)
        self.metrics.batch_size.observe(len(batch))
        self.metrics.input_tokens.inc(sum(job.record.token_count for job in batch))
        results = list(results)
        if len(results) != len(batch) or any(result is None for result in results):
            answered = sum(result is not None for result in results[: len(batch)])
            log.error("the model returned %d results for a batch of %d records", answered, len(batch))
        for index, job in enumerate(batch):
            job.finished = finished
            result = results[index] if index < len(results) else None
            if result is None:  # never dropped silently: the request fails, loudly
                self.metrics.failures.inc()
                self._answer(job, None, InferenceError(f"the model returned no result for this record (batch of {len(batch)})"))
                continue
            self.metrics.record_tokens.observe(job.record.token_count)
            self._answer(job, result, None)

    def _run_task(self, job: Job) -> None:
        job.started = job.started or time.perf_counter()
        try:
            result = job.task()
        except Exception as error:  # a task's inputs were checked when it was made: this is the model failing
            log.exception("a task failed (request id %s)", job.request_id)
            self.metrics.failures.inc()
            self._answer(job, None, InferenceError(f"inference failed: {type(error).__name__}: {error}"))
            return
        job.finished = time.perf_counter()
        self._answer(job, result, None)

    @staticmethod
    def _answer(job: Job, result: Any, error: BaseException | None) -> None:
        try:
            job.loop.call_soon_threadsafe(_resolve, job.future, result, error)
        except RuntimeError:  # the job's event loop has closed: nobody is waiting
            pass


def build_batcher(model: Clef, metrics: ServerMetrics, settings: ServerSettings, kind: type[Batcher] = Batcher) -> Batcher:
    """The queue and model runner with the settings' limits: by default the in-process queue and worker
    thread (Ray Serve passes its `@serve.batch` one: distributed/ray_serve.py)."""
    return kind(
        model,
        metrics,
        batch_tokens=settings.batch_tokens or model.batch_tokens,
        max_batch=settings.max_batch,
        batch_wait_s=settings.batch_wait_ms / 1000,
        max_queue=settings.max_queue,
    )
