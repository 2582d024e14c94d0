"""The server under hostile or unlucky conditions: over-long integers, clients that vanish or trickle,
too many connections, a burst of large bodies, browser content types, a dead or short-changing model
worker, and a shutdown with work in flight. Deadlines are set to a second or so here; the defaults
are in `ServerSettings`."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_server import Gate, async_serving, serving, ticket  # noqa: E402  (tests/ is on sys.path)

from clef_flash.server import create_app  # noqa: E402
from clef_flash.testing.server import server_thread  # noqa: E402


@pytest.fixture(scope="module")
def client(model):
    with serving(model, batch_wait_ms=0) as client:
        yield client


def closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """(whether the server closed the socket within `seconds`, what it sent before)."""
    sock.settimeout(seconds)
    received = b""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(4096)
            if not chunk:
                return True, received
            received += chunk
    except (TimeoutError, socket.timeout):
        return False, received
    except ConnectionResetError:
        return True, received
    return False, received


# -- 1. over-long integers --------------------------------------------------------------------------


def test_an_integer_past_the_digit_limit_is_a_422_with_its_location(client):
    long_integer = "9" * 5000
    in_state = '{"state": {"ticket": [1, ' + long_integer + "]}, " + json.dumps({"questions": ticket()["questions"]})[1:]
    response = client.post("/v1/systemone", content=in_state)
    assert response.status_code == 422, response.text
    (item,) = response.json()["detail"]
    assert item["type"] == "integer_too_long" and item["loc"] == ["body", "state", "ticket", 1]
    assert "5000 digits" in item["msg"]
    criteria = '{"state": "hi", "questions": {"q": {"type": "choice", "criteria": {"a": -' + long_integer + ', "b": null}}}}'
    response = client.post("/v1/systemone", content=criteria)
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "questions", "q", "criteria", "a"]
    cloudflare = client.post("/accounts/a/ai/run/@cf/cloudflare/clef-flash", content=criteria)
    assert cloudflare.status_code == 422 and cloudflare.json()["errors"][0]["code"] == 5012
    assert "questions.q.criteria.a" in cloudflare.json()["errors"][0]["message"]


# -- 2. a client gone mid-upload ----------------------------------------------------------------------


def test_a_client_gone_mid_upload_is_a_499_without_a_traceback(model, caplog):
    with server_thread(create_app(model, batch_wait_ms=0)) as running:
        with caplog.at_level(logging.INFO, logger="clef_flash"), socket.create_connection(("127.0.0.1", running.port)) as raw:
            raw.sendall(b"POST /v1/systemone HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 5000\r\n\r\n{\"st")
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while '{route="/v1/systemone",status="499"}' not in (text := httpx.get(running.url + "/metrics").text):
            assert time.monotonic() < deadline, text
            time.sleep(0.02)
    assert 'status="500"' not in text
    assert not [record for record in caplog.records if record.exc_info], [record.getMessage() for record in caplog.records]


# -- 3. read deadlines, the connection cap, the shutdown deadline ------------------------------------


def test_headers_trickled_a_byte_a_second_are_cut_at_the_header_deadline(model):
    with server_thread(create_app(model, header_timeout_s=1.5, batch_wait_ms=0)) as running:
        request = b"GET /health HTTP/1.1\r\nhost: localhost\r\nx-slow: " + b"a" * 100
        with socket.create_connection(("127.0.0.1", running.port)) as slow:
            start = time.monotonic()
            closed = False
            for byte in request:
                try:
                    slow.sendall(bytes([byte]))
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
                done, received = closed_within(slow, 1.0)  # one byte a second
                if done:
                    closed = True
                    break
            elapsed = time.monotonic() - start
        assert closed and 1.4 <= elapsed <= 3.0, elapsed
        assert received.startswith(b"HTTP/1.1 408"), received
        assert httpx.get(running.url + "/health").status_code == 200  # others are still served


def test_a_body_shorter_than_its_content_length_is_cut_at_the_body_deadline(model):
    with server_thread(create_app(model, body_timeout_s=1.0, batch_wait_ms=0)) as running:
        with socket.create_connection(("127.0.0.1", running.port)) as stalled:
            stalled.sendall(b"POST /v1/systemone HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n{\"state\": ")
            start = time.monotonic()
            closed, _ = closed_within(stalled, 5.0)
            elapsed = time.monotonic() - start
        assert closed and 0.9 <= elapsed <= 2.5, elapsed
        assert httpx.post(running.url + "/v1/systemone", json=ticket()).status_code == 200


def test_connections_past_the_cap_get_503_and_slow_ones_free_their_place(model):
    with server_thread(create_app(model, max_connections=3, header_timeout_s=1.0, batch_wait_ms=0)) as running:
        idle = [socket.create_connection(("127.0.0.1", running.port)) for _ in range(3)]
        try:
            time.sleep(0.2)
            with socket.create_connection(("127.0.0.1", running.port)) as one_more:
                closed, received = closed_within(one_more, 2.0)
            assert closed and received.startswith(b"HTTP/1.1 503"), received
            assert all(closed_within(sock, 3.0)[0] for sock in idle)  # each closed by its header deadline
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.1)
        assert httpx.get(running.url + "/health").status_code == 200


def test_shutdown_deadline_answers_what_is_left_503_and_exits(model, monkeypatch):
    app = create_app(model, shutdown_timeout_s=2.0, batch_wait_ms=0, max_batch=1)
    answers: list[int] = []

    def post(state: str) -> None:
        try:
            answers.append(httpx.post(running.url + "/v1/systemone", json=ticket(state), timeout=30).status_code)
        except httpx.HTTPError as error:
            answers.append(type(error).__name__)  # type: ignore[arg-type]

    with server_thread(app) as running:
        gate = Gate(model, monkeypatch)  # the worker holds the first request until opened: the rest queue
        clients = [threading.Thread(target=post, args=(f"ticket {i}",)) for i in range(4)]
        for thread in clients:
            thread.start()
        assert gate.entered.wait(10)
        while app.state.batcher.depth < 3:
            time.sleep(0.01)
        stalled = socket.create_connection(("127.0.0.1", running.port))
        stalled.sendall(b"POST /v1/systemone HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n{")
        time.sleep(0.1)
        start = time.monotonic()
        running.server.should_exit = True  # what SIGTERM does
        running.thread.join(10)
        elapsed = time.monotonic() - start
        gate.opened.set()
        for thread in clients:
            thread.join(10)
        stalled_closed, _ = closed_within(stalled, 1.0)
        stalled.close()
    assert not running.thread.is_alive() and elapsed <= 2.5, elapsed
    assert sorted(answers) == [503] * 4, answers  # the running one too: its forward was abandoned
    assert stalled_closed


# -- 4. the parse budget -----------------------------------------------------------------------------


def test_bodies_past_the_parse_budget_get_429_with_retry_after(model):
    limit = 4096

    async def scenario():
        app = create_app(
            model, max_body_bytes=limit, max_image_body_bytes=limit, max_video_body_bytes=limit, max_parsing_bytes=2 * limit, batch_wait_ms=0
        )
        async with async_serving(app) as client:
            release = asyncio.Event()
            body = json.dumps(ticket("x" * 3400)).encode()
            assert 3000 < len(body) <= limit

            async def slow_body():
                yield body[:3000]
                await release.wait()
                yield body[3000:]

            held = [asyncio.create_task(client.post("/v1/systemone", content=slow_body())) for _ in range(2)]
            while app.state.system_one.parse_budget.bytes < 6000:
                await asyncio.sleep(0.005)
            refused = await client.post("/v1/systemone", content=body)  # 6,000 held + this body > 8,192
            cloudflare = await client.post("/accounts/a/ai/run/@cf/cloudflare/clef-flash", content=body)
            release.set()
            first = await asyncio.gather(*held)
            after = await client.post("/v1/systemone", content=body)
            return refused, cloudflare, first, after, app.state.system_one.parse_budget

    refused, cloudflare, first, after, budget = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "parsing other requests" in refused.json()["detail"]
    assert cloudflare.status_code == 429 and cloudflare.json()["errors"][0]["code"] == 3040
    assert [response.status_code for response in first] == [200, 200] and after.status_code == 200
    assert (budget.bytes, budget.requests) == (0, 0)  # everything given back


def test_the_parse_budget_must_hold_a_compressed_body_and_its_copy(model):
    with pytest.raises(ValueError, match="at least twice max_video_body_bytes"):
        create_app(model, max_body_bytes=1 << 20, max_image_body_bytes=1 << 20, max_video_body_bytes=1 << 20, max_parsing_bytes=1 << 20)


# -- 5. content types --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_content_types_a_browser_sends_without_preflight_get_415(client, content_type):
    body = json.dumps(ticket()).encode()
    response = client.post("/v1/systemone", content=body, headers={"content-type": content_type})
    assert response.status_code == 415
    assert "application/json" in response.json()["detail"]
    cloudflare = client.post("/accounts/a/ai/run/@cf/cloudflare/clef-flash", content=body, headers={"content-type": content_type})
    assert cloudflare.status_code == 415 and cloudflare.json()["success"] is False


@pytest.mark.parametrize("content_type", [None, "application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_json_or_no_content_type_is_accepted(client, content_type):
    headers = {"content-type": content_type} if content_type else {}
    assert client.post("/v1/systemone", content=json.dumps(ticket()).encode(), headers=headers).status_code == 200


# -- 6. the OpenAPI document --------------------------------------------------------------------------


def test_openapi_publishes_the_request_and_response_schemas(client):
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path in ("/v1/systemone", "/client/v4/accounts/{account}/ai/run/@cf/cloudflare/clef-flash"):
        operation = spec["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": "#/components/schemas/SystemOneRequest"}
        assert {"200", "401", "413", "415", "422", "429", "500", "503"} <= set(operation["responses"])
    request = schemas["SystemOneRequest"]
    assert set(request["required"]) == {"state", "questions"}
    assert {"NoulQuestion", "ChoiceQuestion", "ScoreQuestion", "SystemOneResponse", "ValidationErrorBody"} <= set(schemas)
    ok = spec["paths"]["/v1/systemone"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/SystemOneResponse"}
    refs = json.dumps(spec)
    for name in {part.split('"')[0] for part in refs.split("#/components/schemas/")[1:]}:
        assert name in schemas, name  # every reference resolves


def test_openapi_states_the_served_rules_and_every_status(client, model):
    spec = client.get("/openapi.json").json()
    assert not [path for path in spec["paths"] if "model_path" in path]  # the one model is in the path
    model_names = spec["components"]["schemas"]["SystemOneRequest"]["properties"]["model"]["anyOf"][0]
    assert model_names["enum"] == [model.model_name, "@cf/cloudflare/clef-flash", "clef", ""]
    run = spec["paths"]["/client/v4/accounts/{account}/ai/run/@cf/cloudflare/clef-flash"]["post"]
    (account,) = run["parameters"]
    assert account["schema"]["pattern"] == "^[^/]+$"
    assert client.post("/client/v4/accounts/a%2Fb/ai/run/@cf/cloudflare/clef-flash", json=ticket()).status_code == 404
    assert {"400", "401", "404", "413", "415", "422", "429", "500", "503", "529"} <= set(run["responses"])
    for operation in (run, spec["paths"]["/v1/systemone"]["post"]):
        description = operation["description"]
        assert f"{model.max_length:,} tokens" in description and "record_too_long" in description
        assert "1,048,576 bytes" in description and "413" in description
    health = spec["paths"]["/health"]["get"]["responses"]
    assert health["503"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/HealthBody"}
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert {"text/plain", "application/openmetrics-text"} <= set(metrics)


# -- 7. the watchdog, deadlines on waits, short batches -----------------------------------------------


class WorkerKilled(BaseException):
    """Not an Exception: nothing in the worker catches it, as with a fault that ends the thread."""


def test_a_dead_worker_fails_health_and_requests_get_503(model, monkeypatch):
    async def scenario():
        app = create_app(model, batch_wait_ms=0)
        async with async_serving(app) as client:
            def die(records, timings=None):
                raise WorkerKilled("simulated")

            monkeypatch.setattr(model, "score", die)
            first = await asyncio.wait_for(client.post("/v1/systemone", json=ticket()), 10)
            health = await client.get("/health")
            later = await asyncio.wait_for(client.post("/v1/systemone", json=ticket()), 10)
            return first, health, later

    first, health, later = asyncio.run(scenario())
    assert first.status_code == 503 and "model worker stopped" in first.json()["detail"]
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert "WorkerKilled" in health.json()["error"]
    assert later.status_code == 503 and later.headers["retry-after"] == "1"


def test_requests_wait_for_the_model_no_longer_than_the_deadline(model, monkeypatch):
    async def scenario():
        app = create_app(model, batch_wait_ms=0, request_timeout_s=0.5)
        async with async_serving(app) as client:
            gate = Gate(model, monkeypatch)
            start = time.perf_counter()
            response = await asyncio.wait_for(client.post("/v1/systemone", json=ticket()), 10)
            elapsed = time.perf_counter() - start
            gate.opened.set()
            return response, elapsed, app.state.batcher.depth

    response, elapsed, depth = asyncio.run(scenario())
    assert response.status_code == 503 and "did not answer within 0.5 s" in response.json()["detail"]
    assert 0.4 <= elapsed < 5 and depth == 0


def test_a_batch_with_fewer_results_than_records_fails_the_rest_loudly(model, monkeypatch, caplog):
    async def scenario():
        app = create_app(model, batch_wait_ms=300)
        async with async_serving(app) as client:
            real = model.score
            monkeypatch.setattr(model, "score", lambda records, timings=None: real(records, timings)[:-1])
            responses = await asyncio.wait_for(
                asyncio.gather(*(client.post("/v1/systemone", json=ticket(f"ticket {i}")) for i in range(3))), 20
            )
            return responses, (await client.get("/metrics")).text

    responses, metrics_text = asyncio.run(scenario())
    statuses = [response.status_code for response in responses]
    failed = statuses.count(500)
    assert set(statuses) <= {200, 500} and failed >= 1, statuses  # every record answered, none left waiting
    assert "results for a batch of" in caplog.text
    assert f"clef_flash_inference_failures_total {failed}" in metrics_text
