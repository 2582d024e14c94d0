"""The MCP server through the official SDK's own client (mcp 2.3): over stdio, as a desktop agent
launches `clef-flash mcp`, and over streamable HTTP behind a bearer key; in process for the rest.
Every answer is compared with `Clef.answer` on the same request, every error with the request's 422."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("mcp")
pytest.importorskip("fastapi")

import anyio
import httpx
import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

import clef_flash
from clef_flash.errors import RequestInvalid
from clef_flash.request.protocol import SystemOneRequest, SystemOneResponse
from clef_flash.server.app import ServerSettings
from clef_flash.server.mcp_tools import CLASSIFY_INSTRUCTIONS, CLASSIFY_QUESTION, ToolServer
from clef_flash.server.transport import uvicorn_server
from clef_flash.sets import SETS_DIR_ENV, SetStore
from clef_flash.testing.server import server_thread

API_KEY = "mcp-test-key"
STATE = "My card was charged twice. Please refund me today."
QUESTIONS = {
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "Charges and refunds", "engineering": None}},
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["Can wait", "Today", "Now"]},
}
DECIDE = {"model": "clef-flash", "state": STATE, "questions": QUESTIONS}
CLASSIFY = {"text": STATE, "labels": ["billing", {"label": "engineering", "description": "Bugs and outages"}, "sales"]}
TRIAGE = {"description": "Route a support ticket", "questions": {"team": QUESTIONS["team"], "refund": QUESTIONS["refund"]}}
BAD_DECIDE = {"state": STATE, "questions": {"team": {"type": "choice", "criteria": {"billing": None}}}}


@pytest.fixture(scope="module")
def sets_dir(module_tmp) -> Path:
    root = module_tmp("sets")
    SetStore(root).add("triage", TRIAGE)
    return root


def expected_classify(model) -> dict:
    """classify's answer, from `Clef.answer` on the choice question it stands for."""
    criteria = {"billing": None, "engineering": "Bugs and outages", "sales": None}
    question = {"type": "choice", "instructions": CLASSIFY_INSTRUCTIONS, "criteria": criteria}
    body = model.answer({"state": STATE, "questions": {CLASSIFY_QUESTION: question}})
    answer = dict(body["answers"][CLASSIFY_QUESTION])
    assert answer.pop("type") == "choice"
    return {**answer, "usage": body["usage"]}


def refusal(model, request) -> dict:
    """The 422 body the HTTP server answers `request` with."""
    with pytest.raises(RequestInvalid) as refused:
        model.prepare(request)
    return refused.value.detail()


def structured(result) -> dict:
    """A tool result's structured content, checked against its text (what a text-only client reads)."""
    assert json.loads(result.content[0].text) == result.structured_content
    return result.structured_content


async def tour(client: Client, model) -> None:
    """What every transport must do: list the tools, answer as `Clef.answer`, refuse as the 422."""
    listed = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert list(listed) == ["decide", "classify", "explain", "triage"]
    assert listed["decide"].input_schema == SystemOneRequest.model_json_schema()
    assert listed["decide"].output_schema == listed["triage"].output_schema == SystemOneResponse.model_json_schema()
    assert listed["classify"].input_schema["required"] == ["text", "labels"]
    assert listed["triage"].input_schema["required"] == ["state"]
    assert "Route a support ticket" in listed["triage"].description

    decided = await client.call_tool("decide", DECIDE)
    assert not decided.is_error and structured(decided) == model.answer(DECIDE)
    classified = await client.call_tool("classify", CLASSIFY)
    assert not classified.is_error and structured(classified) == expected_classify(model)
    triaged = await client.call_tool("triage", {"state": STATE})
    assert not triaged.is_error and structured(triaged) == model.answer({"state": STATE, "questions": TRIAGE["questions"]})

    refused = await client.call_tool("decide", BAD_DECIDE)
    assert refused.is_error and structured(refused) == refusal(model, BAD_DECIDE)
    assert structured(refused)["detail"][0]["loc"] == ["body", "questions", "team", "criteria"]


# -- stdio: the command a desktop agent runs ------------------------------------------------------


def test_stdio_as_a_desktop_agent_launches_it(model, tiny_dir, sets_dir):
    source = Path(clef_flash.__file__).parents[1]  # this checkout's src/, ahead of any installed copy
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "clef_flash.cli", "mcp", "--model", str(tiny_dir), "--precision", "fp32"],
        env={
            "PYTHONPATH": os.pathsep.join(filter(None, [str(source), os.environ.get("PYTHONPATH")])),
            SETS_DIR_ENV: str(sets_dir),
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",  # as this process runs the model: the same float sums
            "TOKENIZERS_PARALLELISM": "false",
        },
    )
    with tempfile.TemporaryFile("w+") as errlog:

        async def main() -> None:
            async with Client(stdio_client(params, errlog=errlog), read_timeout_seconds=120) as client:
                await tour(client, model)

        try:
            anyio.run(main)
        finally:
            errlog.seek(0)
            log = errlog.read()
            print(log)  # shown when the test fails
        assert "MCP over stdio" in log and "saved sets: triage" in log


# -- streamable HTTP, behind the bearer key ---------------------------------------------------------


@pytest.fixture(scope="module")
def http_url(model, sets_dir):
    tools = ToolServer(model, ServerSettings(api_key=API_KEY, batch_wait_ms=0), SetStore(sets_dir))
    with server_thread(tools.http_app(), wait_for_health=False, make_server=uvicorn_server) as running:
        yield running.url + "/mcp"


def test_http_with_the_sdk_client(model, http_url):
    async def main() -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=120)) as http:
            async with Client(streamable_http_client(http_url, http_client=http), read_timeout_seconds=120) as client:
                await tour(client, model)

    anyio.run(main)


def test_http_enforces_the_bearer_key(http_url):
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "0"}},
    }
    accept = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
    for authorization in (None, "Bearer wrong-key", f"Basic {API_KEY}", API_KEY):
        headers = {**accept, **({"authorization": authorization} if authorization else {})}
        refused = httpx.post(http_url, json=initialize, headers=headers, timeout=30)
        assert refused.status_code == 401, authorization
        assert refused.headers["www-authenticate"] == "Bearer" and "Authorization: Bearer" in refused.json()["detail"]
    accepted = httpx.post(http_url, json=initialize, headers={**accept, "authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert accepted.status_code == 200, accepted.text  # the same request: only the key differed


# -- in process: the finer points -----------------------------------------------------------------


def call(model, sets_dir, name: str, arguments: dict):
    async def main():
        async with Client(ToolServer(model, sets=SetStore(sets_dir)).server) as client:
            return await client.call_tool(name, arguments)

    return anyio.run(main)


@pytest.mark.parametrize(
    ("arguments", "locations"),
    [
        ({"labels": ["a", "b"]}, [["body", "text"]]),
        ({"text": STATE}, [["body", "labels"]]),
        ({"text": STATE, "labels": ["a"]}, [["body", "labels"]]),
        ({"text": STATE, "labels": ["a", "a", 3]}, [["body", "labels", 1], ["body", "labels", 2]]),
        ({"text": STATE, "labels": ["a", {"label": "b", "description": 7}]}, [["body", "labels", 1]]),
        ({"text": STATE, "labels": ["a", ""]}, [["body", "labels", 1]]),
        ({"text": STATE, "labels": ["a", "b"], "instructions": 5}, [["body", "instructions"]]),
    ],
)
def test_classify_errors_name_its_own_arguments(model, sets_dir, arguments, locations):
    result = call(model, sets_dir, "classify", arguments)
    assert result.is_error
    assert [item["loc"] for item in structured(result)["detail"]] == locations


@pytest.mark.parametrize(
    ("name", "arguments", "location"),
    [
        ("triage", {"text": STATE}, ["body", "state"]),
        ("triage", {"state": STATE, "questions": QUESTIONS}, ["body", "questions"]),
        ("decide", {**DECIDE, "model": "gpt-4"}, ["body", "model"]),
        ("decide", {**DECIDE, "state": None}, ["body", "state"]),
    ],
)
def test_tool_errors_carry_the_http_location(model, sets_dir, name, arguments, location):
    result = call(model, sets_dir, name, arguments)
    assert result.is_error and [item["loc"] for item in structured(result)["detail"]] == [location]


def test_a_set_saved_while_running_is_a_tool(model, tmp_path):
    store = SetStore(tmp_path)
    tools = ToolServer(model, sets=store)

    async def main() -> None:
        async with Client(tools.server) as client:
            assert [tool.name for tool in (await client.list_tools()).tools] == ["decide", "classify", "explain"]
            missing = await client.call_tool("triage", {"state": STATE})
            assert missing.is_error and "no question set named 'triage'" in structured(missing)["detail"]
            store.add("triage", TRIAGE)
            listed = await client.list_tools(cache_mode="refresh")
            assert [tool.name for tool in listed.tools] == ["decide", "classify", "explain", "triage"]
            answered = await client.call_tool("triage", {"state": STATE})
            assert structured(answered) == model.answer({"state": STATE, "questions": TRIAGE["questions"]})

    anyio.run(main)
