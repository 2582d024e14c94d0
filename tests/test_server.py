"""The System One server on the tiny release: the official client, every error path, batching,
disconnects, a fuzzed body, health and metrics. In process (TestClient / httpx over ASGI) where
that is enough; a real uvicorn on a loopback port for the SDK and for client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import random
import re
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clef_flash.server import create_app
from clef_flash.server.body import _zstd
from clef_flash.request.samples import random_request
from clef_flash.testing.server import running_server

QUESTIONS = {
    "team": {
        "type": "choice",
        "instructions": "Which team should handle this ticket?",
        "criteria": {"billing": "Charges and refunds", "technical": "Bugs and outages", "sales": None},
    },
    "urgency": {"type": "score", "instructions": "How urgent is it?", "criteria": ["Can wait", "Today", "Now"]},
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
}


def ticket(state: str = "My card was charged twice. Please refund me today.", **fields) -> dict:
    return {"model": "clef-flash", "state": state, "questions": QUESTIONS, **fields}


def wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 30
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, client.get("/health").json()
        time.sleep(0.01)


@contextlib.contextmanager
def serving(model, **settings):
    with TestClient(create_app(model, **settings)) as client:
        wait_ready(client)
        yield client


@pytest.fixture(scope="module")
def client(model):
    with serving(model, batch_wait_ms=0) as client:
        yield client


@contextlib.asynccontextmanager
async def async_serving(app):
    """httpx over ASGI in this event loop, with the app's lifespan (worker start, warm-up) run."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://clef.test", timeout=60) as client:
            while (await client.get("/health")).status_code != 200:
                await asyncio.sleep(0.01)
            yield client


class Gate:
    """Stands in for `model.score`: notes the records it gets, and holds the worker until opened."""

    def __init__(self, model, monkeypatch, *, fail_on: str | None = None):
        self.real = model.score
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.states: list[str] = []
        self.fail_on = fail_on
        self.tokenizer = model.tokenizer
        monkeypatch.setattr(model, "score", self.score)

    def score(self, records, timings=None):
        self.states.extend(self.tokenizer.decode(record.input_ids) for record in records)
        self.entered.set()
        assert self.opened.wait(30), "the gate was never opened"
        if self.fail_on is not None and any(self.fail_on in state for state in self.states[-len(records) :]):
            raise RuntimeError("simulated device failure")
        return self.real(records, timings)


def metric(client, name: str, **labels) -> float:
    text = client.get("/metrics").text
    label_text = ",".join(f'{key}="{value}"' for key, value in labels.items())
    pattern = re.escape(name + (f"{{{label_text}}}" if labels else "")) + r" (\S+)"
    found = re.search("^" + pattern + "$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


# -- the official client -------------------------------------------------------------------------


def test_typesafe_sdk_parses_every_answer(model):
    typesafe_sdk = pytest.importorskip("typesafe_sdk")
    import httpx2

    long_state = "Subject: double charge\n\n" + "I was charged twice for the annual plan and want a refund. " * 40
    sent: list[dict] = []
    http = httpx2.Client(event_hooks={"request": [lambda request: sent.append(dict(request.headers))]})
    with running_server(create_app(model, api_key="sdk-test-key")) as base_url, typesafe_sdk.TypeSafeClient(
        api_key="sdk-test-key",
        base_url=base_url,
        model="clef-flash",
        retry=typesafe_sdk.RetryPolicy(max_retries=0),
        http_client=http,
    ) as sdk:
        questions = {
            "refund": typesafe_sdk.Noul(instructions="Does the customer ask for a refund?"),
            "team": typesafe_sdk.Choice(
                instructions="Which team?", criteria={"billing": "Charges and refunds", "technical": None}
            ),
            "urgency": typesafe_sdk.Score(instructions="How urgent is it?", criteria=["Can wait", "Today", "Now"]),
        }
        for state in ("Charged twice, refund please.", long_state, {"subject": "refund", "body": long_state}):
            result = sdk.system_one(state=state, questions=questions)
            expected = model.answer(
                {"model": "clef-flash", "state": state, "questions": {k: v.model_dump(exclude_none=True) for k, v in questions.items()}}
            )
            assert result.model == "clef-flash"
            assert result.usage.input_tokens == expected["usage"]["input_tokens"]
            assert result.nouls["refund"].noul == expected["answers"]["refund"]["noul"]
            choice = expected["answers"]["team"]
            assert (result.choices["team"].choice, result.choices["team"].confidence) == (choice["choice"], choice["confidence"])
            assert result.choices["team"].probabilities == choice["probabilities"]
            score = expected["answers"]["urgency"]
            assert result.scores["urgency"].score == score["score"]
            assert result.scores["urgency"].legend == {int(k): v for k, v in score["legend"].items()}
            assert result.scores["urgency"].probabilities == {int(k): v for k, v in score["probabilities"].items()}
            assert len(result.request_id) == 32
        models = sdk.models.list()
        assert models.models[0].name == "clef-flash"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", models.models[0].release_date)
        with pytest.raises(typesafe_sdk.TypeSafeUnprocessableEntityError, match="'model' must be one of"):
            sdk.system_one(state="hi", questions=questions, model="jev-latest")
    # The SDK compresses bodies of 1 KiB and more with zstd: both kinds reached the server.
    encodings = [headers.get("content-encoding") for headers in sent if "content-type" in headers]
    assert "zstd" in encodings and None in encodings, encodings


def test_typesafe_sdk_sees_auth_errors(model):
    typesafe_sdk = pytest.importorskip("typesafe_sdk")
    with running_server(create_app(model, api_key="right")) as base_url:
        retry = typesafe_sdk.RetryPolicy(max_retries=0)
        sdk = typesafe_sdk.TypeSafeClient(api_key="wrong", base_url=base_url, model="clef-flash", retry=retry)
        with sdk, pytest.raises(typesafe_sdk.TypeSafeAuthenticationError, match="API key"):
            sdk.system_one(state="hi", questions={"q": typesafe_sdk.Noul(instructions="?")})


# -- routes ----------------------------------------------------------------------------------------


def test_systemone_answers_as_the_engine_does(client, model):
    response = client.post("/v1/systemone", json=ticket())
    assert response.status_code == 200
    assert response.json() == model.answer(ticket())
    assert list(response.json()["answers"]) == ["team", "urgency", "refund"]
    assert "model;dur=" in response.headers["server-timing"]


@pytest.mark.parametrize("name", ["clef-flash", "@cf/cloudflare/clef-flash", "clef", "", None, "absent"])
def test_model_aliases_are_accepted(client, name):
    body = ticket()
    if name == "absent":
        del body["model"]
    else:
        body["model"] = name
    response = client.post("/v1/systemone", json=body)
    assert response.status_code == 200
    assert response.json()["model"] == (name if name and name != "absent" else "clef-flash")


def test_other_model_names_are_refused(client):
    response = client.post("/v1/systemone", json=ticket(model="jev-latest"))
    assert response.status_code == 422
    (item,) = response.json()["detail"]
    assert item["type"] == "model_not_served" and item["loc"] == ["body", "model"]
    assert "'jev-latest'" in item["msg"] and "'clef-flash'" in item["msg"]


def test_models_and_health(client, model):
    models = client.get("/v1/models").json()["models"]
    assert [entry["name"] for entry in models] == ["clef-flash", "@cf/cloudflare/clef-flash", "clef"]
    assert all(set(entry) == {"name", "description", "release_date"} for entry in models)
    assert "RANDOM WEIGHTS" in models[0]["description"]
    health = client.get("/health").json()
    assert health["status"] == "ready" and health["model"] == "clef-flash"
    assert health["fingerprint"]["config"] == model.checkpoint.fingerprint
    assert re.fullmatch(r"[0-9a-f]{64}", health["fingerprint"]["weights"])
    assert (health["precision"], health["device"], health["random_weights"]) == ("fp32", "cpu", True)
    assert isinstance(health["precision_reason"], str) and health["precision_reason"]


def test_weights_fingerprint_tells_releases_apart(tmp_path):
    from clef_flash.checkpoint.sources import weights_fingerprint
    from clef_flash.checkpoint.random_release import write_random_release

    first = write_random_release(tmp_path / "a", "tiny", seed=0)
    second = write_random_release(tmp_path / "b", "tiny", seed=1)
    assert weights_fingerprint(first) == weights_fingerprint(first)
    assert weights_fingerprint(first) != weights_fingerprint(second)
    start = time.perf_counter()
    weights_fingerprint(first)
    assert time.perf_counter() - start < 2.0


def test_workers_ai_route_wraps_the_answer(client, model):
    for path in ("/client/v4/accounts/acct/ai/run/@cf/cloudflare/clef-flash", "/accounts/acct/ai/run/@cf/cloudflare/clef-flash"):
        response = client.post(path, json={k: v for k, v in ticket().items() if k != "model"})
        assert response.status_code == 200
        assert response.json() == {"result": model.answer(ticket()), "success": True, "errors": [], "messages": []}
        assert response.headers["cf-ai-req-id"] == response.headers["x-request-id"]


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("@cf/cloudflare/clef-flash", b"{not json", 400, 6003),
        ("@cf/cloudflare/clef-flash", {"state": "hi", "questions": {}}, 400, 5006),
        ("@cf/cloudflare/clef-flash", {"state": "hi", "questions": {"q": {"type": "box"}}}, 400, 5006),
        ("@cf/cloudflare/clef-flash", {"state": "hi", "questions": {"q": {"type": "noul", "extra": 1}}}, 422, 5012),
        ("@cf/cloudflare/clef-flash", ticket(model="jev-latest"), 422, 5012),
        ("@cf/cloudflare/clef", ticket(), 400, 7000),
    ],
)
def test_workers_ai_errors_use_cloudflare_codes(client, path, body, status, code):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = client.post(f"/client/v4/accounts/acct/ai/run/{path}", **kwargs)
    assert response.status_code == status
    envelope = response.json()
    assert envelope["success"] is False and envelope["result"] is None and envelope["messages"] == []
    (error,) = envelope["errors"]
    assert error["code"] == code and isinstance(error["message"], str) and error["message"]


def test_request_ids(client):
    generated = client.get("/health").headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    echoed = client.post("/v1/systemone", json=ticket(), headers={"x-request-id": "trace-42"})
    assert echoed.headers["x-request-id"] == echoed.headers["x-typesafe-request-id"] == "trace-42"
    assert client.get("/nowhere", headers={"x-request-id": "x" * 500}).headers["x-request-id"] != "x" * 500


def test_demo_page_is_offline(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "support-ticket triage" in page.text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page.text)  # no CDN, no network assets
    assert "@import" not in page.text


# -- limits and errors -------------------------------------------------------------------------------


def test_invalid_bodies_get_the_protocol_detail(client):
    not_json = client.post("/v1/systemone", content=b"{oops")
    assert not_json.status_code == 422
    assert not_json.json()["detail"][0]["type"] == "json_invalid"
    empty = client.post("/v1/systemone", content=b"")
    assert empty.status_code == 422 and empty.json()["detail"][0]["loc"] == ["body"]
    bad = client.post("/v1/systemone", json={"state": "hi", "questions": {"q": {"type": "choice", "criteria": {"a": None}}}})
    assert bad.status_code == 422
    assert bad.json()["detail"][0]["loc"] == ["body", "questions", "q", "criteria"]
    assert "2 to 255 options; got 1" in bad.json()["detail"][0]["msg"]


def test_over_length_records_are_refused_before_inference(client, model, monkeypatch):
    monkeypatch.setattr(model, "max_length", 150)
    forwards = metric(client, "clef_flash_forwards_total")
    response = client.post("/v1/systemone", json=ticket("word " * 400))
    assert response.status_code == 422
    (item,) = response.json()["detail"]
    assert item["type"] == "record_too_long" and item["ctx"]["limit"] == 150
    assert item["ctx"]["token_count"] > 150 and str(item["ctx"]["token_count"]) in item["msg"] and "150" in item["msg"]
    assert metric(client, "clef_flash_forwards_total") == forwards


def test_body_size_limits(model):
    limit = 4096
    small = json.dumps(ticket()).encode()
    big = json.dumps(ticket("x" * limit)).encode()
    with serving(model, max_body_bytes=limit, max_image_body_bytes=limit, max_video_body_bytes=limit, batch_wait_ms=0) as client:
        assert client.post("/v1/systemone", content=small).status_code == 200
        by_header = client.post("/v1/systemone", content=big)
        assert by_header.status_code == 413 and "4096" in by_header.json()["detail"]
        streamed = client.post("/v1/systemone", content=iter([big[:3000], big[3000:]]))  # chunked, no Content-Length
        assert streamed.status_code == 413 and "more than" in streamed.json()["detail"]
        bomb = gzip.compress(big)
        assert len(bomb) < limit
        decompressed = client.post("/v1/systemone", content=bomb, headers={"content-encoding": "gzip"})
        assert decompressed.status_code == 413 and "decompressed" in decompressed.json()["detail"]
        cloudflare = client.post("/accounts/a/ai/run/@cf/cloudflare/clef-flash", content=big)
        assert cloudflare.status_code == 413 and cloudflare.json()["errors"][0]["code"] == 5021


def test_compressed_bodies(client, model):
    raw = json.dumps(ticket("A long ticket. " * 100)).encode()
    expected = model.answer(ticket("A long ticket. " * 100))
    assert client.post("/v1/systemone", content=gzip.compress(raw), headers={"content-encoding": "gzip"}).json() == expected
    zstd = _zstd()
    if zstd is not None:
        from backports.zstd import (
            compress,  # what typesafe-sdk[zstd] compresses with before Python 3.14
        )

        two_frames = compress(raw[:100]) + compress(raw[100:])
        response = client.post("/v1/systemone", content=two_frames, headers={"content-encoding": "zstd"})
        assert response.json() == expected
        broken = client.post("/v1/systemone", content=compress(raw)[:-9], headers={"content-encoding": "zstd"})
        assert broken.status_code == 400 and "zstd" in broken.json()["detail"]
    garbage = client.post("/v1/systemone", content=b"not gzip", headers={"content-encoding": "gzip"})
    assert garbage.status_code == 400 and "gzip" in garbage.json()["detail"]
    unknown = client.post("/v1/systemone", content=raw, headers={"content-encoding": "br"})
    assert unknown.status_code == 415 and "'br'" in unknown.json()["detail"]


def test_api_key(model):
    with serving(model, api_key="s3cret", batch_wait_ms=0) as client:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}, {"authorization": "Basic s3cret"}):
            response = client.post("/v1/systemone", json=ticket(), headers=headers)
            assert response.status_code == 401, headers
            assert response.headers["www-authenticate"] == "Bearer" and "API key" in response.json()["detail"]
        assert client.get("/v1/models").status_code == 401
        good = {"authorization": "Bearer s3cret"}
        assert client.post("/v1/systemone", json=ticket(), headers=good).status_code == 200
        assert client.get("/v1/models", headers=good).status_code == 200
        cloudflare = client.post("/client/v4/accounts/a/ai/run/@cf/cloudflare/clef-flash", json=ticket())
        assert cloudflare.status_code == 401 and cloudflare.json()["errors"] == [{"code": 10000, "message": cloudflare.json()["errors"][0]["message"]}]
        health = client.get("/health")  # health, metrics and the demo page stay open
        assert health.status_code == 200 and health.json()["api_key_required"] is True
        assert client.get("/metrics").status_code == 200 and client.get("/").status_code == 200


def test_full_queue_answers_429_with_retry_after(model, monkeypatch):
    async def scenario():
        app = create_app(model, max_queue=2, batch_wait_ms=0, max_batch=1)
        async with async_serving(app) as client:
            gate = Gate(model, monkeypatch)
            running = asyncio.create_task(client.post("/v1/systemone", json=ticket("first")))
            await asyncio.to_thread(gate.entered.wait, 10)  # the worker holds "first"
            queued = [asyncio.create_task(client.post("/v1/systemone", json=ticket(f"queued {i}"))) for i in range(2)]
            while app.state.batcher.depth < 2:
                await asyncio.sleep(0.005)
            refused = await client.post("/v1/systemone", json=ticket("one too many"))
            cloudflare = await client.post("/accounts/a/ai/run/@cf/cloudflare/clef-flash", json=ticket("too"))
            gate.opened.set()
            answered = await asyncio.gather(running, *queued)
            return refused, cloudflare, answered

    refused, cloudflare, answered = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "2 records are queued" in refused.json()["detail"]
    assert cloudflare.status_code == 429 and cloudflare.json()["errors"][0]["code"] == 3040
    assert [response.status_code for response in answered] == [200, 200, 200]


def test_inference_failure_is_a_500_and_the_server_keeps_serving(model, monkeypatch):
    async def scenario():
        app = create_app(model, batch_wait_ms=200)
        async with async_serving(app) as client:
            gate = Gate(model, monkeypatch, fail_on="poison")
            gate.opened.set()
            # Batched together: the batch fails, then each record runs alone; only the poisoned one fails.
            both = await asyncio.gather(
                client.post("/v1/systemone", json=ticket("poison")), client.post("/v1/systemone", json=ticket("fine"))
            )
            cloudflare = await client.post("/accounts/a/ai/run/@cf/cloudflare/clef-flash", json=ticket("poison"))
            after = await client.post("/v1/systemone", json=ticket("after"))
            return both, cloudflare, after, (await client.get("/metrics")).text

    (poisoned, fine), cloudflare, after, metrics_text = asyncio.run(scenario())
    assert poisoned.status_code == 500
    # The request id to find the cause in the log; never the exception's text.
    request_id = poisoned.headers["x-request-id"]
    assert poisoned.json()["detail"] == f"inference failed; request id {request_id} (the server's log has the cause)"
    assert fine.status_code == 200 and after.status_code == 200
    assert cloudflare.status_code == 529 and cloudflare.json()["errors"][0]["code"] == 5012
    message = cloudflare.json()["errors"][0]["message"]
    assert "Clef inference failed" in message and cloudflare.headers["cf-ai-req-id"] in message
    assert "simulated" not in poisoned.text + message
    assert "clef_flash_inference_failures_total 2" in metrics_text


def test_health_answers_while_the_model_is_busy(model, monkeypatch):
    async def scenario():
        app = create_app(model)
        gate = Gate(model, monkeypatch)  # before start-up: the warm-up request is held too
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            await asyncio.to_thread(gate.entered.wait, 10)
            start = time.perf_counter()
            warming = await client.get("/health")
            elapsed = time.perf_counter() - start
            models = await client.get("/v1/models")
            gate.opened.set()
            while (ready := await client.get("/health")).status_code != 200:
                await asyncio.sleep(0.01)
            return warming, elapsed, models, ready

    warming, elapsed, models, ready = asyncio.run(scenario())
    assert warming.status_code == 503 and warming.json()["status"] == "warming_up"
    assert elapsed < 1.0 and models.status_code == 200
    assert ready.json()["status"] == "ready"


# -- batching and disconnects ------------------------------------------------------------------------


@pytest.mark.slow  # a long end-to-end or oracle run: the full suite (CI) runs it, the quick loop does not
def test_concurrent_requests_are_batched_with_the_same_answers(model):
    rng = random.Random(6)
    requests = [random_request(rng, state_words=rng.randint(5, 60)) for _ in range(32)]

    async def scenario():
        app = create_app(model, batch_wait_ms=500)  # generous: all 32 arrive well within it
        solo = create_app(model)  # one at a time: the default wait (5 ms), not 500 ms a request
        async with async_serving(app) as client, async_serving(solo) as solo_client:
            batches = lambda app: app.state.metrics.value("batch_records_count")  # noqa: E731
            before = batches(app), batches(solo)
            together = await asyncio.gather(*(client.post("/v1/systemone", json=request) for request in requests))
            alone = [await solo_client.post("/v1/systemone", json=request) for request in requests]
            return together, alone, batches(app) - before[0], batches(solo) - before[1]

    together, alone, batches_together, batches_alone = asyncio.run(scenario())
    print(f"\n32 requests: {batches_together} batches concurrently, {batches_alone} one at a time")
    assert batches_alone == 32 and batches_together <= 4
    worst = 0.0
    for batched, single in zip(together, alone):
        assert batched.status_code == single.status_code == 200
        batched, single = batched.json(), single.json()
        assert batched["usage"] == single["usage"] and batched["answers"].keys() == single["answers"].keys()
        for a, b in zip(batched["answers"].values(), single["answers"].values()):
            for key in ("noul", "score", "confidence"):
                if key in a:
                    worst = max(worst, abs(a[key] - b[key]))
            for option, p in a.get("probabilities", {}).items():
                worst = max(worst, abs(p - b["probabilities"][option]))
    print(f"worst |batched - alone| on 4-decimal values: {worst:.1e}")
    assert worst <= 1e-4  # batch invariance up to float rounding, seen through 4-decimal rounding


def test_a_cancelled_request_leaves_the_queue(model, monkeypatch):
    async def scenario():
        app = create_app(model, batch_wait_ms=0, max_batch=1)
        async with async_serving(app) as client:
            gate = Gate(model, monkeypatch)
            running = asyncio.create_task(client.post("/v1/systemone", json=ticket("first")))
            await asyncio.to_thread(gate.entered.wait, 10)
            abandoned = asyncio.create_task(client.post("/v1/systemone", json=ticket("abandoned")))
            while app.state.batcher.depth < 1:
                await asyncio.sleep(0.005)
            abandoned.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await abandoned
            depth_after_cancel = app.state.batcher.depth
            gate.opened.set()
            first = await running
            return depth_after_cancel, first, app.state.metrics.value("dropped_total"), gate.states

    depth, first, dropped, states = asyncio.run(scenario())
    assert depth == 0 and dropped == 1 and first.status_code == 200
    assert not any("abandoned" in state for state in states)


def test_a_disconnected_client_leaves_the_queue(model, monkeypatch):
    app = create_app(model, batch_wait_ms=0, max_batch=1)
    with running_server(app) as base_url:
        gate = Gate(model, monkeypatch)
        first: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: first.append(httpx.post(base_url + "/v1/systemone", json=ticket("first"), timeout=60)))
        thread.start()
        assert gate.entered.wait(10)
        body = json.dumps(ticket("abandoned")).encode()
        port = int(base_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(
                b"POST /v1/systemone HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\n\r\n".encode()
                + body
            )
            deadline = time.monotonic() + 10
            while app.state.batcher.depth < 1:
                assert time.monotonic() < deadline
                time.sleep(0.005)
        deadline = time.monotonic() + 10  # the socket is closed: the server notices and drops the job
        while app.state.batcher.depth > 0:
            assert time.monotonic() < deadline, "the abandoned request stayed queued"
            time.sleep(0.005)
        gate.opened.set()
        thread.join(30)
        assert first[0].status_code == 200
        assert app.state.metrics.value("dropped_total") == 1
        assert not any("abandoned" in state for state in gate.states)
        assert 'clef_flash_requests_total{route="/v1/systemone",status="499"} 1' in httpx.get(base_url + "/metrics").text


def test_metrics(client):
    client.post("/v1/systemone", json=ticket())
    client.post("/v1/systemone", json={"state": "hi"})
    text = client.get("/metrics").text
    assert re.search(r'^clef_flash_requests_total\{route="/v1/systemone",status="200"\} [0-9.]+$', text, re.MULTILINE)
    assert re.search(r'^clef_flash_requests_total\{route="/v1/systemone",status="422"\} [0-9.]+$', text, re.MULTILINE)
    buckets = [line for line in text.splitlines() if line.startswith("clef_flash_request_duration_seconds_bucket{")]
    assert any('route="/v1/systemone"' in line and 'le="+Inf"' in line for line in buckets)
    for name in ("clef_flash_queue_depth 0", "clef_flash_input_tokens_total", "clef_flash_batch_records_bucket", "clef_flash_forwards_total"):
        assert name in text
    assert client.get("/metrics").headers["content-type"].startswith("text/plain; version=0.0.4")


# -- fuzz --------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
texts = st.text(max_size=30)
# Mostly well-formed questions (so that many bodies reach the model), with any field sometimes wrong.
well_formed_questions = st.one_of(
    st.fixed_dictionaries({"type": st.just("noul")}, optional={"instructions": texts, "criteria": st.fixed_dictionaries({}, optional={"true": texts, "false": st.none() | texts})}),
    st.fixed_dictionaries(
        {"type": st.just("choice"), "criteria": st.dictionaries(st.text(min_size=1, max_size=12), st.none() | texts, min_size=2, max_size=6)},
        optional={"instructions": texts | json_values},
    ),
    st.fixed_dictionaries(
        {"type": st.just("score"), "criteria": st.lists(texts, min_size=2, max_size=10)}, optional={"instructions": texts}
    ),
)
any_questions = st.fixed_dictionaries(
    {"type": st.sampled_from(["noul", "choice", "score", "box", 3, None])},
    optional={
        "instructions": json_values,
        "criteria": st.dictionaries(st.text(max_size=12), st.none() | texts, max_size=5) | st.lists(texts, max_size=11) | json_values,
        "extra": json_values,
    },
)
question_ids = st.text(min_size=1, max_size=20) | st.text(max_size=110)
bodies = st.fixed_dictionaries(
    {"state": texts | json_values, "questions": st.dictionaries(question_ids, well_formed_questions, min_size=1, max_size=4)},
    optional={"model": st.sampled_from(["clef-flash", "clef", None]), "images": st.just([]) | json_values},
) | st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["clef-flash", "clef", "jev-latest", "", None, 7]),
        "state": json_values,
        "questions": st.dictionaries(question_ids, well_formed_questions | any_questions, max_size=4) | json_values,
        "images": json_values,
    },
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies | json_values, raw=st.binary(max_size=64), as_raw=st.sampled_from([False, False, True]))
def test_fuzzed_bodies_never_get_a_5xx(client, body, raw, as_raw):
    content = raw if as_raw else json.dumps(body).encode()
    response = client.post("/v1/systemone", content=content)
    assert response.status_code in (200, 422), response.text
    assert response.json()


# -- the command line ----------------------------------------------------------------------------


def test_serve_command(model, monkeypatch, capsys):
    import clef_flash.loader
    import clef_flash.server
    from clef_flash.cli import main

    calls = {}

    def load(source, **options):
        calls["load"] = (source, options)
        return model

    monkeypatch.setattr(clef_flash.loader, "load", load)
    monkeypatch.setattr(clef_flash.server, "serve", lambda served, **options: calls.setdefault("serve", (served, options)))
    monkeypatch.setenv("CLEF_FLASH_API_KEY", "from-env")
    arguments = ["--max-length", "512", "--batch-wait-ms", "0", "--max-batch", "1", "--state-cache-mb", "64"]
    assert main(["serve", "--model", "tiny", "--port", "9001", *arguments]) == 0
    assert calls["load"] == (
        "tiny",
        {
            "device": "auto",
            "precision": None,
            "revision": None,
            "verify": False,
            "resident_layers": None,
            "state_cache_mb": 64.0,
            "segment_tokens": None,  # load's default (2048)
            "graphs": None,  # load's default (lazy capture on a GPU)
            "coreml_runner": None,
            "calibration": None,  # no fitted temperatures: the model's own probabilities
            "max_length": 512,
        },
    )
    served, options = calls["serve"]
    assert served is model
    assert options == {
        "host": "127.0.0.1",
        "port": 9001,
        "log_level": "info",
        "api_key": "from-env",
        "max_body_bytes": 1 << 20,
        "max_image_body_bytes": 12 << 20,
        "max_video_body_bytes": 34 << 20,
        "batch_tokens": None,
        "batch_wait_ms": 0.0,
        "max_batch": 1,
        "max_queue": 256,
        "max_parsing_bytes": 68 << 20,
        "request_timeout_s": 300.0,
        "header_timeout_s": 10.0,
        "body_timeout_s": 30.0,
        "max_connections": 1024,
        "shutdown_timeout_s": 30.0,
    }
    assert "(random weights) on http://127.0.0.1:9001/: the answers mean nothing" in capsys.readouterr().err
