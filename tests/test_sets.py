"""Saved question sets on the tiny release: add / list / rm, refusals with their locations, and one
set answered the same through the CLI, the HTTP server, batch and MCP."""

from __future__ import annotations

import json

import pytest

from clef_flash import cli
from clef_flash.errors import QuestionSetError, RequestInvalid
from clef_flash.request.protocol import parse_request
from clef_flash.sets import SETS_DIR_ENV, SetStore

TRIAGE = {
    "description": "Route a support ticket",
    "questions": {
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "Charges and refunds", "engineering": None}},
        "urgent": {"type": "noul", "instructions": "Is it urgent?"},
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["Can wait", "Today", "Now"]},
    },
}
STATE = "My card was charged twice. Please refund me today."


@pytest.fixture
def sets_dir(tmp_path, monkeypatch):
    root = tmp_path / "sets"
    monkeypatch.setenv(SETS_DIR_ENV, str(root))
    return root


def write_json(path, value):
    path.write_text(json.dumps(value))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_add_list_and_remove(sets_dir, tmp_path, capsys):
    schema = write_json(tmp_path / "triage.json", TRIAGE)
    code, out, _ = run(capsys, "sets", "add", "triage", str(schema))
    assert code == 0 and "team (choice), urgent (noul), urgency (score)" in out
    stored = json.loads((sets_dir / "triage.json").read_text())
    assert stored["format"] == "clef-flash-set" and stored["version"] == 1
    assert stored["questions"] == TRIAGE["questions"] and stored["description"] == TRIAGE["description"]

    code, out, err = run(capsys, "sets", "add", "triage", str(schema))
    assert code == 2 and "exists already" in err and "--replace" in err
    assert run(capsys, "sets", "add", "triage", str(schema), "--replace")[0] == 0
    assert run(capsys, "sets", "add", "ticket-2", str(schema))[0] == 0

    code, out, _ = run(capsys, "sets", "list")
    assert [line.split()[0] for line in out.splitlines()] == ["ticket-2", "triage"]
    code, out, _ = run(capsys, "sets", "list", "--json")
    assert [entry["name"] for entry in json.loads(out)] == ["ticket-2", "triage"]

    assert run(capsys, "sets", "rm", "triage")[0] == 0
    assert not (sets_dir / "triage.json").exists()
    code, _, err = run(capsys, "sets", "rm", "triage")
    assert code == 2 and "no question set named 'triage'" in err and "ticket-2" in err
    assert [question_set.name for question_set in SetStore().all()] == ["ticket-2"]


def test_the_default_directory_is_the_users_config_directory(monkeypatch):
    platformdirs = pytest.importorskip("platformdirs")
    monkeypatch.delenv(SETS_DIR_ENV, raising=False)
    assert SetStore().root == platformdirs.user_config_path("clef-flash") / "sets"


def request_errors(questions) -> list[dict]:
    """What a request with these questions is refused with."""
    with pytest.raises(RequestInvalid) as refused:
        parse_request({"state": STATE, "questions": questions})
    return refused.value.errors


MALFORMED = {
    "one option": {"team": {"type": "choice", "criteria": {"billing": None}}},
    "unknown type": {"team": {"type": "maybe", "instructions": "?"}},
    "score of one level": {"urgency": {"type": "score", "criteria": ["Now"]}},
    "no questions": {},
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_set_is_refused_with_the_requests_errors(sets_dir, tmp_path, capsys, case):
    questions = MALFORMED[case]
    expected = request_errors(questions)
    schema = write_json(tmp_path / "schema.json", {"questions": questions})
    code, _, err = run(capsys, "sets", "add", "broken", str(schema))
    assert code == 2
    assert f"{schema} is not saved" in err
    for item in expected:  # the same message at the same location as the request's 422
        assert f"{'.'.join(map(str, item['loc']))}: {item['msg']}" in err
    with pytest.raises(RequestInvalid) as refused:
        SetStore().add("broken", {"questions": questions})
    assert refused.value.errors == expected
    assert not sets_dir.exists() or not any(sets_dir.iterdir())


@pytest.mark.parametrize(
    ("name", "schema", "loc"),
    [
        ("bad name", TRIAGE, ["name"]),
        ("../escape", TRIAGE, ["name"]),
        ("decide", TRIAGE, ["name"]),
        ("ok", {**TRIAGE, "state": "a set has no state"}, ["body", "state"]),
        ("ok", {**TRIAGE, "description": 3}, ["body", "description"]),
        ("ok", ["not", "an", "object"], ["body"]),
    ],
)
def test_names_and_shapes_are_checked_before_saving(sets_dir, name, schema, loc):
    with pytest.raises(RequestInvalid) as refused:
        SetStore().add(name, schema)
    assert [item["loc"] for item in refused.value.errors] == [loc]
    assert not sets_dir.exists()


def test_a_damaged_file_is_refused_with_its_path(sets_dir, capsys):
    store = SetStore()
    store.add("triage", TRIAGE)
    store.path("triage").write_text('{"format": "clef-flash-set", "version": 1, "questions": {"x": {"type": "noul"}, "y": 1}}')
    with pytest.raises(QuestionSetError, match="no longer a valid set") as refused:
        store.get("triage")
    assert str(store.path("triage")) in str(refused.value)
    code, _, err = run(capsys, "answer", "--set", "triage", "--state", STATE)
    assert code == 2 and str(store.path("triage")) in err


# -- the same answer everywhere ------------------------------------------------------------------


def test_one_set_answers_the_same_through_cli_server_batch_and_mcp(model, tiny_dir, sets_dir, tmp_path, capsys):
    store = SetStore()
    question_set = store.add("triage", TRIAGE)
    expected = model.answer(question_set.request(STATE))
    assert set(expected["answers"]) == set(TRIAGE["questions"])
    loaded = ("--model", str(tiny_dir), "--precision", "fp32")

    code, out, _ = run(capsys, "answer", "--set", "triage", "--state", STATE, "--json", *loaded)
    assert code == 0 and json.loads(out) == expected

    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from clef_flash.server import create_app

    with TestClient(create_app(model, sets_dir=str(sets_dir), batch_wait_ms=0, warm_up=False)) as client:
        response = client.post("/v1/sets/triage", json={"state": STATE})
        assert response.status_code == 200, response.text
        assert response.json() == expected

    states = tmp_path / "states.jsonl"
    states.write_text(json.dumps({"state": STATE, "id": "ticket-1"}) + "\n")
    output = tmp_path / "answers.jsonl"
    code, _, err = run(capsys, "batch", str(states), str(output), "--set", "triage", *loaded)
    assert code == 0, err
    (line,) = [json.loads(text) for text in output.read_text().splitlines()]
    assert line.pop("line") == 1 and line.pop("id") == "ticket-1"
    assert line == expected

    pytest.importorskip("mcp")
    import anyio
    from mcp import Client

    from clef_flash.server.mcp_tools import ToolServer

    async def call() -> dict:
        async with Client(ToolServer(model, sets=store).server) as client:
            result = await client.call_tool("triage", {"state": STATE})
            assert not result.is_error, result.content
            return result.structured_content

    assert anyio.run(call) == expected


def test_the_set_route_refuses_what_is_not_a_state(model, sets_dir):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from clef_flash.server import create_app

    SetStore().add("triage", TRIAGE)
    with TestClient(create_app(model, sets_dir=str(sets_dir), warm_up=False, api_key="k")) as client:
        headers = {"authorization": "Bearer k"}
        assert client.post("/v1/sets/triage", json={"state": STATE}).status_code == 401
        missing = client.post("/v1/sets/nope", json={"state": STATE}, headers=headers)
        assert missing.status_code == 404 and "no question set named 'nope'" in missing.json()["detail"]
        cases = {
            "questions": ({"state": STATE, "questions": TRIAGE["questions"]}, ["body", "questions"]),
            "no state": ({"text": STATE}, ["body", "state"]),
            "null state": ({"state": None}, ["body", "state"]),
            "array body": ([STATE], ["body"]),
            "another model": ({"state": STATE, "model": "gpt-4"}, ["body", "model"]),
        }
        for case, (body, loc) in cases.items():
            response = client.post("/v1/sets/triage", json=body, headers=headers)
            assert response.status_code == 422, case
            assert [item["loc"] for item in response.json()["detail"]] == [loc], case
        not_json = client.post("/v1/sets/triage", content=b"{state", headers={**headers, "content-type": "application/json"})
        assert not_json.status_code == 422 and not_json.json()["detail"][0]["type"] == "json_invalid"
