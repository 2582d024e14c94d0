"""The front of `serve --ray` without a cluster (distributed/forwarding.py): a request forwarded whole through the
app in-process answers byte for byte as the app does, the app never sees a disconnect before its caller goes, and a
caller gone cancels the job; a request whose replica is lost is forwarded once more, then answered 503 in the
route's shape; an app's own error is never retried."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import threading

import httpx
import pytest

pytest.importorskip("fastapi")

from clef_flash.distributed.forwarding import Answer, Forwarded, Forwarder, call_app, read_request
from clef_flash.server import create_app

SETTINGS = {"api_key": "front-key", "max_body_bytes": 4096, "max_image_body_bytes": 4096, "max_video_body_bytes": 8192, "max_parsing_bytes": 16384, "batch_wait_ms": 0}
AUTH = {"authorization": "Bearer front-key"}
QUESTIONS = {"urgent": {"type": "noul", "instructions": "Is it urgent?"}}
WORKERS_AI = "/client/v4/accounts/acc/ai/run/@cf/cloudflare/clef-flash"


def ticket(state: str = "Charged twice, refund please.") -> dict:
    return {"model": "clef-flash", "state": state, "questions": QUESTIONS}


class Lost(Exception):
    """Stands in for Ray's actor death (ray_serve.REPLICA_LOST)."""


def forwarder(forward, **options) -> Forwarder:
    return Forwarder(forward, (Lost,), **{"body_limit": 8192, "deadline_s": 30.0, "retry_after_s": 1, **options})


@contextlib.asynccontextmanager
async def clients(app, front):
    """httpx over ASGI to the app itself and to the front before it, the app's lifespan run and its warm-up done."""
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://clef.test", timeout=60) as direct,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://clef.test", timeout=60) as fronted,
    ):
        while (await direct.get("/health")).status_code != 200:
            await asyncio.sleep(0.01)
        yield direct, fronted


CASES = [  # (method, path, body, headers)
    ("POST", "/v1/systemone", json.dumps(ticket()).encode(), AUTH),
    ("POST", "/v1/systemone", json.dumps(ticket()).encode(), {}),  # 401
    ("POST", "/v1/systemone", b"{not json", AUTH),  # 422
    ("POST", "/v1/systemone", json.dumps(ticket("word " * 1000)).encode(), AUTH),  # 413 from the bytes read
    ("POST", "/v1/systemone", b"x" * 9000, {**AUTH, "content-length": "9000"}),  # past the front's limit: 413 all the same
    ("POST", "/v1/systemone", gzip.compress(json.dumps(ticket("x" * 9000)).encode()), {**AUTH, "content-encoding": "gzip"}),
    ("POST", WORKERS_AI, json.dumps(ticket()).encode(), AUTH),
    ("POST", WORKERS_AI, b"[1]", AUTH),
    ("GET", "/v1/models?x=1", None, AUTH),
    ("GET", "/openapi.json", None, {}),
    ("GET", "/", None, {}),
    ("GET", "/nowhere", None, {}),
]


def test_a_forwarded_request_is_answered_byte_for_byte_as_the_app_answers(model):
    async def scenario():
        app = create_app(model, **SETTINGS)
        front = forwarder(lambda request: call_app(app, request))
        async with clients(app, front) as (direct, fronted):
            for method, path, body, headers in CASES:
                headers = {"content-type": "application/json", "x-request-id": "same-id", **headers}
                local = await direct.request(method, path, content=body, headers=headers)
                forwarded = await fronted.request(method, path, content=body, headers=headers)
                timing = "server-timing"  # the durations differ
                assert forwarded.status_code == local.status_code, path
                assert [item for item in forwarded.headers.multi_items() if item[0] != timing] == [
                    item for item in local.headers.multi_items() if item[0] != timing
                ], path
                assert forwarded.content == local.content, (path, forwarded.text[:200])
            return front.stats()

    assert asyncio.run(scenario()) == {"retried": 0, "unavailable": 0, "errors": {}}


def test_the_app_sees_no_disconnect_until_the_call_is_cancelled_and_then_drops_the_job(model, monkeypatch):
    """One request holds the model (a gate), a second waits in the queue: neither is answered 499 early; cancelling
    the second call (its client gone, as Serve cancels it) takes its job out of the queue."""
    opened, entered = threading.Event(), threading.Event()
    score = model.score

    def held(records, timings=None):
        entered.set()
        assert opened.wait(30), "the gate was never opened"
        return score(records, timings)

    def request(state: str) -> Forwarded:
        scope = {"type": "http", "method": "POST", "path": "/v1/systemone", "root_path": "", "query_string": b""}
        headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer front-key")]
        return Forwarded({**scope, "headers": headers}, json.dumps(ticket(state)).encode())

    async def scenario():
        app = create_app(model, **{**SETTINGS, "max_batch": 1})
        async with clients(app, forwarder(lambda request: call_app(app, request))):
            monkeypatch.setattr(model, "score", held)
            first = asyncio.create_task(call_app(app, request("first")))
            await asyncio.to_thread(entered.wait, 10)
            abandoned = asyncio.create_task(call_app(app, request("abandoned")))
            while app.state.batcher.depth < 1:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)
            assert not first.done() and not abandoned.done()  # the body sent, no disconnect reported
            abandoned.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await abandoned
            depth = app.state.batcher.depth
            opened.set()
            return depth, await first, app.state.metrics.value("dropped_total")

    depth, first, dropped = asyncio.run(scenario())
    assert (depth, dropped, first.status) == (0, 1, 200)
    assert json.loads(first.body)["answers"]["urgent"]["type"] == "noul"


def test_the_front_reads_no_more_of_a_body_than_the_app_would():
    async def read(chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[bytes, int]:
        messages = [{"type": "http.request", "body": chunk, "more_body": True} for chunk in chunks]
        messages[-1]["more_body"] = False
        taken = len(messages)

        async def receive():
            return messages.pop(0)

        scope = {"type": "http", "method": "POST", "path": "/v1/systemone", "headers": headers, "state": {"not": "forwarded"}}
        request = await read_request(scope, receive, limit=10)
        assert "state" not in request.scope and request.scope["headers"] == headers
        return request.body, taken - len(messages)

    assert asyncio.run(read([b"12345", b"67890"], [])) == (b"1234567890", 2)  # at the limit: whole
    assert asyncio.run(read([b"12345", b"6789012", b"345", b"678"], [])) == (b"12345678901", 2)  # past it: limit + 1, then no more
    assert asyncio.run(read([b"x" * 11], [(b"content-length", b"11")])) == (b"", 0)  # the app refuses it from the header


def answer(status: int, body: dict) -> Answer:
    return Answer(status, [(b"content-type", b"application/json")], json.dumps(body).encode())


class Replicas:
    """A fake handle: each attempt takes the next outcome (an Answer, or an error to raise)."""

    def __init__(self, *outcomes):
        self.outcomes, self.attempts = list(outcomes), 0

    async def forward(self, request: Forwarded) -> Answer:
        self.attempts += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


async def through(front: Forwarder, path: str = "/v1/systemone") -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://clef.test") as client:
        return await client.post(path, json=ticket(), headers={"x-request-id": "lost-1"})


def test_a_request_on_a_lost_replica_is_forwarded_once_more_then_answered_503():
    replicas = Replicas(Lost("died"), answer(200, {"ok": True}))
    front = forwarder(replicas.forward)
    retried = asyncio.run(through(front))
    assert (retried.status_code, retried.json(), replicas.attempts) == (200, {"ok": True}, 2)

    replicas = Replicas(Lost("died"), Lost("died too"), Lost("never asked"))
    front = forwarder(replicas.forward, retry_after_s=3)
    lost = asyncio.run(through(front))
    assert (lost.status_code, replicas.attempts, lost.headers["retry-after"]) == (503, 2, "3")
    reason = "the replica answering this request was lost, and so was the one it was retried on; retry after 3 s"
    assert lost.json() == {"detail": reason}  # /v1's shape, FastAPI's
    assert lost.headers["x-request-id"] == lost.headers["x-typesafe-request-id"] == "lost-1"
    assert front.stats() == {"retried": 1, "unavailable": 1, "errors": {"Lost": 2}}

    cloudflare = asyncio.run(through(forwarder(Replicas(Lost(), Lost()).forward), WORKERS_AI))
    assert cloudflare.status_code == 503 and cloudflare.headers["cf-ai-req-id"] == "lost-1"
    assert cloudflare.json() == {"result": None, "success": False, "errors": [{"code": 3040, "message": reason.replace("3 s", "1 s")}], "messages": []}


def test_an_answer_or_another_error_is_never_retried():
    for status in (429, 500, 503):
        replicas = Replicas(answer(status, {"detail": "the app's own"}), answer(200, {}))
        response = asyncio.run(through(forwarder(replicas.forward)))
        assert (response.status_code, response.json(), replicas.attempts) == (status, {"detail": "the app's own"}, 1)
    replicas = Replicas(RuntimeError("a bug"), answer(200, {}))
    response = asyncio.run(through(forwarder(replicas.forward)))
    assert (response.status_code, replicas.attempts) == (500, 1)
    assert response.json() == {"detail": "internal error; request id lost-1 (the server's log has the cause)"}


def test_no_answer_within_the_deadline_is_a_503_and_the_attempt_is_cancelled():
    cancelled = asyncio.Event()

    async def never(request: Forwarded) -> Answer:
        try:
            await asyncio.Future()
        finally:
            cancelled.set()

    async def scenario():
        return await through(forwarder(never, deadline_s=0.05)), cancelled.is_set()

    response, was_cancelled = asyncio.run(scenario())
    assert response.status_code == 503 and was_cancelled
    assert response.json() == {"detail": "no replica answered within 0.05 s; retry after 1 s"}
