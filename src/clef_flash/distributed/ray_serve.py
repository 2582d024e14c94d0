"""`clef-flash serve --ray`: the System One server on Ray Serve, a front deployment before the model's replicas.

Each `ClefFlash` replica loads one engine and runs the very app `create_app` builds for the local
server, in-process (`forwarding.call_app`): the same routes, bodies, limits, errors, health and metrics
by construction; the app's lifespan (the batcher, the warm-up) runs for as long as the replica. The one
seam is the batcher: `ServeBatcher` keeps the local batcher's interface and its batch runner
(`Batcher._run`: metrics, a failed batch retried one record at a time, 500s), and replaces its queue and
worker thread with Ray Serve's `@serve.batch`.

`Front`, the HTTP ingress, holds no model: pinned to the head node (whose loss is the cluster's), it
reads each request whole and forwards it to a replica through a DeploymentHandle. A request whose
replica is lost in flight (its node gone: Ray's actor death, `REPLICA_LOST`) is forwarded once more,
to another replica (scoring is a pure function of the request); if that one is lost too, or no replica
answers within the request deadline and a margin, the front answers 503 + Retry-After in the route's
own error shape. The app's answers, 4xx and 5xx included, pass through untouched; a client that goes
away cancels its request on the replica too (the job leaves the queue).

Ray Serve's proxy sits in front: it adds its own `x-request-id` (the app echoes it, so the front drops
the app's copy rather than send the header twice), and answers some things itself (README: its 503
backpressure and its timeouts).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import time
from typing import TYPE_CHECKING, Any

from ray import serve
from ray.exceptions import ObjectLostError, RayActorError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..server.app import create_app
from ..server.batcher import build_batcher
from ..server.settings import ServerSettings
from ..server.batcher import Batcher, Job, QueueFull, WorkerUnavailable
from ..server.metrics import ServerMetrics
from ..engine import fitting
from . import EngineSpec, connect
from .forwarding import Answer, Forwarded, Forwarder, call_app

if TYPE_CHECKING:
    from ..clef import Clef

APP_NAME = "clef-flash"
HEADROOM_REQUESTS = 16  # requests a replica takes beyond its queue and batch: /health, /metrics, the demo
HEAD_NODE = {"node:__internal_head__": 0.001}  # Ray's own resource of the head node: a sliver pins an actor there
# A replica lost with a request in flight: its actor died or is unreachable (RayActorError: ActorDiedError,
# ActorUnavailableError), or its answer was lost with its node's object store (ObjectLostError).
REPLICA_LOST = (RayActorError, ObjectLostError)
DEADLINE_MARGIN_S = 30.0  # the front waits an attempt this much past the app's request deadline: no replica took it


class ServeBatcher(Batcher):
    """`Batcher` with `@serve.batch` as its queue: records wait in Ray Serve's batch queue (bounded here
    by `max_queue`, so a full replica answers 429 as the local server does) and run as a batch of at
    most `max_batch` records whose padded tokens fit `batch_tokens`, one batch at a time, off the loop."""

    def __init__(self, model: Clef, metrics: ServerMetrics, **limits: Any):
        super().__init__(model, metrics, **limits)
        self._waiting: set[Job] = set()  # submitted, not yet taken into a batch
        self._tasks: set[asyncio.Task] = set()

        def batch_size(jobs: list[Job]) -> int:
            """What Serve counts against `max_batch`: over it once the padded tokens pass the budget."""
            fits = fitting((job.tokens for job in jobs), self.batch_tokens, self.max_batch)
            return len(jobs) if fits == len(jobs) else self.max_batch + 1

        async def score_batch(jobs: list[Job]) -> list[None]:
            started = time.perf_counter()
            for job in jobs:
                self._waiting.discard(job)
                job.started = started
            live = [job for job in jobs if not job.future.cancelled()]
            if live:
                self._running, self._running_since = live, started  # what the watchdog (busy_for) reads
                try:
                    await asyncio.to_thread(self._run, live)  # answers each job's future, as the worker thread does
                finally:
                    self._running, self._running_since = [], None
            return [None] * len(jobs)

        self._enqueue = serve.batch(
            max_batch_size=self.max_batch, batch_wait_timeout_s=self.batch_wait_s, batch_size_fn=batch_size
        )(score_batch)

    @property
    def depth(self) -> int:
        return len(self._waiting)

    @property
    def alive(self) -> bool:
        """Serve's batch queue runs while the replica does (no worker thread of ours to watch)."""
        return not self._stopping

    def enqueue(self, job: Job) -> Job:
        loop = job.loop
        if self._stopping:
            raise WorkerUnavailable("the server is shutting down")
        if len(self._waiting) >= self.max_queue:
            raise QueueFull
        self._waiting.add(job)
        task = loop.create_task(self._enqueue(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    def cancel(self, job: Job) -> bool:
        job.future.cancel()
        if job not in self._waiting:
            return False
        self._waiting.discard(job)  # Serve's queue skips a cancelled job when its batch comes
        self.metrics.dropped.inc()
        return True

    def start(self) -> None:
        pass  # Serve's batch queue starts with the first record

    def abandon(self, reason: str) -> int:
        jobs = [*self._running, *self._waiting]
        self._waiting.clear()
        for job in jobs:
            self._answer(job, None, WorkerUnavailable(reason))
        return len(jobs)

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self.abandon("the server is shutting down")


class OneRequestIdHeader:
    """Drops `x-request-id` from the front's answers (the app's, or the front's own 503): Ray Serve's proxy
    adds the same id itself (the app received it from the proxy and echoed it), and one header is what
    the local server sends."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_once(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [(name, value) for name, value in message["headers"] if name.lower() != b"x-request-id"]
            await send(message)

        await self.app(scope, receive, send_once)


@serve.deployment(name="ClefFlash")
class ClefFlash:
    """A replica: one engine and the local server's app around it, which answers each request the front forwards."""

    async def __init__(self, spec: EngineSpec, settings: dict[str, Any]):
        self.model = spec.load()
        make_batcher = functools.partial(build_batcher, kind=ServeBatcher)
        self.app = create_app(self.model, make_batcher=make_batcher, **settings)
        self.lifespan = contextlib.AsyncExitStack()  # the app's lifespan, exited when Serve stops the replica
        await self.lifespan.enter_async_context(self.app.router.lifespan_context(self.app))

    async def forward(self, request: Forwarded) -> Answer:
        return await call_app(self.app, request)

    async def __del__(self) -> None:  # Serve awaits it when it stops the replica
        await self.lifespan.aclose()


@serve.deployment(name="Front")
@serve.ingress()
class Front:
    """The ingress: every request forwarded to a `ClefFlash` replica by `model`, a lost one once more (`Forwarder`)."""

    def __init__(self, model: Any, settings: dict[str, Any]):
        checked = ServerSettings(**settings)
        self.model = model  # a DeploymentHandle of ClefFlash
        self.forwarder = Forwarder(
            self.forward,
            REPLICA_LOST,
            body_limit=checked.max_video_body_bytes,  # the app's largest: it reads no more
            deadline_s=checked.request_timeout_s + DEADLINE_MARGIN_S,
            retry_after_s=checked.retry_after_s,
        )

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return OneRequestIdHeader(self.forwarder)

    async def forward(self, request: Forwarded) -> Answer:
        response = self.model.forward.remote(request)
        try:
            return await response
        except asyncio.CancelledError:  # the client went away, or the deadline passed: so does the request
            response.cancel()
            raise

    def stats(self) -> dict[str, Any]:
        """Requests forwarded twice, answered 503 here, and the errors of the failed attempts by type."""
        return self.forwarder.stats()


def deployment(
    spec: EngineSpec,
    settings: dict[str, Any],
    *,
    replicas: int = 1,
    cpus_per_replica: float = 1.0,
    gpus_per_replica: float = 0.0,
) -> Any:
    """The bound application: the front (no CPU, on the head node) before `replicas` engines, each taking up
    to its queue, a batch and some headroom at once, so that the app's own limits (429) answer before Serve
    queues; the front takes all of theirs at once, and more."""
    checked = ServerSettings(**settings)
    per_replica = checked.max_queue + checked.max_batch + HEADROOM_REQUESTS
    model = ClefFlash.options(
        num_replicas=replicas,
        max_ongoing_requests=per_replica,
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
    ).bind(spec, settings)
    return Front.options(
        num_replicas=1,
        max_ongoing_requests=replicas * per_replica + HEADROOM_REQUESTS,
        ray_actor_options={"num_cpus": 0, "resources": HEAD_NODE},
    ).bind(model, settings)


def serve_on_ray(
    spec: EngineSpec,
    settings: dict[str, Any],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    replicas: int = 1,
    cpus_per_replica: float = 1.0,
    gpus_per_replica: float = 0.0,
    blocking: bool = True,
    proxy_location: str | None = None,
) -> Any:
    """Deploy on Ray (joining `address`, or a new local cluster) behind Serve's proxy on host:port.
    Blocking: until interrupted, then the application is deleted (and Serve shut down when this call
    started the cluster). Otherwise returns the front's deployment handle. `proxy_location`: Serve's default
    (a proxy on every node, each on host:port) or "HeadOnly" (nodes that share a host: one port)."""
    started = connect(address)
    serve.start(http_options={"host": host, "port": port}, **({"proxy_location": proxy_location} if proxy_location else {}))
    app = deployment(spec, settings, replicas=replicas, cpus_per_replica=cpus_per_replica, gpus_per_replica=gpus_per_replica)
    handle = serve.run(app, name=APP_NAME, route_prefix="/")
    if not blocking:
        return handle
    signal.signal(signal.SIGTERM, _interrupt)  # `kill`, `docker stop`: clean up as for Ctrl-C
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown() if started else serve.delete(APP_NAME)
    return None


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


__all__ = ["APP_NAME", "REPLICA_LOST", "ClefFlash", "Front", "ServeBatcher", "deployment", "serve_on_ray"]
