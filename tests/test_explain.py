"""Explanations (issue 51, "why"): each part of the state's contribution to every option.

- the parts of text and JSON states, and the edited requests (pure host code);
- exact: each left-out variant's probabilities equal answering that edited request from scratch (fp32, 1e-5
  relative) for JSON, text and image + video states, the full request's answers unchanged by an explain call, and
  the shared prefix run once (tokens run against whole records, printed);
- faithful: on generated requests, leaving parts out in the order of their attribution lowers the decided option's
  probability faster than a random order (the deletion curve's area, both methods, printed);
- every bad input, through the API, the CLI, the server and MCP; gradients refused under int8;
- the shells: the CLI's table, --json and --plot, POST /v1/explain in the OpenAPI, the MCP tool.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import clef_flash
from clef_flash.cli import main
from clef_flash.errors import RequestInvalid
from clef_flash.explain import faithfulness, state_parts, without
from clef_flash.request.protocol import parse_request
from clef_flash.request.samples import random_requests

QUESTIONS = {
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "Charges", "engineering": "Bugs", "sales": None}},
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["Low", "Normal", "High"]},
}
TICKET = (
    "Subject: Charged twice for my annual plan\n\nHi, I upgraded to the annual plan yesterday. My card was charged twice! "
    "Please refund the duplicate charge.\n\nThanks, Dana"
)
JSON_STATE = {
    "subject": "Charged twice",
    "body": "Please refund the duplicate payment.",
    "customer": {"plan": "annual", "since": 2021, "tags": ["vip", "card"]},
    "priority": 2,
}


def relative_error(got: float, want: float, scale: float) -> float:
    return abs(got - want) / scale


def from_scratch(model, request) -> dict[str, dict[str, float]]:
    model.state_cache.clear()
    return model.probabilities(request)


def check_exact(model, request, edited: list, **options) -> tuple[float, object]:
    """Explain `request`; each part's probabilities against `edited[i]` (the request without part i, built by the
    test) answered from scratch. Returns the largest relative error and the explanation."""
    model.state_cache.clear()
    before = model.answer(request, decimals=None)
    explanation = model.explain(request, **options)
    model.state_cache.clear()
    assert model.answer(request, decimals=None) == before  # the full request's answers are unchanged, to the bit
    assert len(explanation.parts) == len(edited)
    full = from_scratch(model, request)
    worst = 0.0
    for question in explanation.questions:
        scale = max(full[question.question_id].values())
        for option in question.options:
            worst = max(worst, relative_error(option.probability, full[question.question_id][option.option_id], scale))
    for index, request_without in enumerate(edited):
        want = from_scratch(model, request_without)
        for question in explanation.questions:
            scale = max(want[question.question_id].values())
            for option in question.options:
                worst = max(worst, relative_error(option.without[index], want[question.question_id][option.option_id], scale))
                assert option.contributions[index] == pytest.approx(option.probability - option.without[index], abs=1e-12)
    return worst, explanation


# -- parts (no model) ---------------------------------------------------------------------------------


def test_a_text_splits_into_lines_then_sentences():
    request = parse_request({"state": TICKET, "questions": QUESTIONS})
    parts = state_parts(request)
    assert [part.label for part in parts] == ["line 1", "line 3, sentence 1", "line 3, sentence 2", "line 3, sentence 3", "line 5"]
    assert [TICKET[slice(*part.chars)] for part in parts][1:3] == ["Hi, I upgraded to the annual plan yesterday.", "My card was charged twice!"]
    edits = [without(request, parts, [index]).state for index in range(len(parts))]
    assert edits[0] == TICKET.replace("Subject: Charged twice for my annual plan\n", "")
    assert edits[2] == TICKET.replace("My card was charged twice! ", "")
    assert edits[3] == TICKET.replace(" Please refund the duplicate charge.", "")  # the last sentence takes the space before it
    assert edits[4] == TICKET.replace("\nThanks, Dana", "")
    assert without(request, parts, range(len(parts))).state.strip() == ""


def test_a_json_state_splits_to_the_depth_asked():
    request = parse_request({"state": JSON_STATE, "questions": QUESTIONS})
    assert [part.label for part in state_parts(request, 1)] == ["body", "customer", "priority", "subject"]  # rendered order
    deep = state_parts(request, 3)
    assert [part.label for part in deep] == [
        "body", "customer.plan", "customer.since", "customer.tags[0]", "customer.tags[1]", "priority", "subject"
    ]
    assert without(request, deep, [4]).state["customer"]["tags"] == ["vip"]
    assert without(request, deep, [1, 2]).state["customer"] == {"tags": ["vip", "card"]}
    assert request.state == JSON_STATE  # never changed in place


# -- exact ---------------------------------------------------------------------------------------------


def test_leave_out_equals_each_edited_request_answered_from_scratch(model, figures):
    text_request = {"state": TICKET, "questions": QUESTIONS}
    parts = state_parts(parse_request(text_request))
    edited_text = [{**text_request, "state": without(parse_request(text_request), parts, [index]).state} for index in range(len(parts))]
    text_error, explanation = check_exact(model, text_request, edited_text)
    cost = explanation.cost
    assert cost.records == len(parts) + 1 and cost.tokens_run < cost.tokens_whole

    json_request = {"state": JSON_STATE, "questions": QUESTIONS}
    edited_json = []
    for key in sorted(JSON_STATE):
        edited_json.append({**json_request, "state": {name: value for name, value in JSON_STATE.items() if name != key}})
    json_error, json_explanation = check_exact(model, json_request, edited_json)
    nested = {**json_request, "state": {"customer": {"plan": "annual", "since": 2021}, "note": "Charged twice."}}
    edited_nested = [
        {**nested, "state": {"customer": {"since": 2021}, "note": "Charged twice."}},
        {**nested, "state": {"customer": {"plan": "annual"}, "note": "Charged twice."}},
        {**nested, "state": {"customer": {"plan": "annual", "since": 2021}}},
    ]
    nested_error, _ = check_exact(model, nested, edited_nested, depth=2)
    worst = max(text_error, json_error, nested_error)
    line = (
        f"explain, leave-out vs each edited request from scratch (tiny, fp32): rel {worst:.1e} (text {text_error:.1e}, "
        f"JSON {json_error:.1e}, depth 2 {nested_error:.1e}); text: {cost.tokens_run} of {cost.tokens_whole} tokens run "
        f"({cost.tokens_run / cost.tokens_whole:.2f}x), JSON: {json_explanation.cost.tokens_run / json_explanation.cost.tokens_whole:.2f}x"
    )
    print(line)
    figures(line)
    assert worst <= 1e-5, line


def test_leave_out_with_images_and_a_video(vision_release, figures):
    Image = pytest.importorskip("PIL.Image")
    model = clef_flash.load(str(vision_release("explain-vision", 5, preprocessor_config=64 * 64, video_preprocessor_config=4 * 64 * 64)), precision="fp32")
    rng = np.random.default_rng(0)

    def picture(width, height):
        return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))

    same = [picture(64, 64), picture(64, 64)]  # same size: the same pad tokens, only their pixels differ
    other = picture(96, 48)
    frames = [picture(64, 64) for _ in range(4)]
    request = {"state": "Two photos of the parcel. The box is crushed.", "images": [*same, other], "videos": [frames], "questions": QUESTIONS}
    edited = [
        {**request, "images": [same[1], other]},
        {**request, "images": [same[0], other]},
        {**request, "images": same},
        {**request, "videos": None},
        {**request, "state": "The box is crushed."},
        {**request, "state": "Two photos of the parcel."},
    ]
    worst, explanation = check_exact(model, request, edited)
    assert [part.part.kind for part in explanation.parts] == ["image", "image", "image", "video", "sentence", "sentence"]
    spans = [part.token_span for part in explanation.parts]
    assert all(start < end for start, end in spans) and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    line = f"explain, leave-out with 3 images and a video vs from scratch (tiny-vision, fp32): rel {worst:.1e}"
    print(line)
    figures(line)
    assert worst <= 1e-5, line


# -- faithful ------------------------------------------------------------------------------------------


def faithful_requests(count: int) -> list[dict]:
    picked = []
    for request in random_requests(51, 200, state_words=(40, 90)):
        if 4 <= len(state_parts(parse_request(request))) <= 10:
            picked.append(request)
        if len(picked) == count:
            return picked
    raise AssertionError("too few generated requests of 4 to 10 parts")


def deletion_areas(model, requests: list[dict], **options) -> tuple[float, float]:
    """The mean deletion-curve areas over `requests` (`faithfulness`): by attribution, and in random orders."""
    areas = [faithfulness(model, request, **options) for request in requests]
    return sum(area for area, _ in areas) / len(areas), sum(area for _, area in areas) / len(areas)


def test_leaving_out_the_top_parts_first_lowers_the_decision_faster(model, figures):
    by_attribution, random_order = deletion_areas(model, faithful_requests(4))
    line = f"explain, deletion-curve area (leave-out, tiny, 4 generated requests): by attribution {by_attribution:.4f}, random order {random_order:.4f}"
    print(line)
    figures(line)
    assert by_attribution < random_order, line


@pytest.mark.slow  # ~25 s of CPU: integrated gradients on 8 requests
def test_integrated_gradients_order_lowers_the_decision_faster(model, figures):
    by_attribution, random_order = deletion_areas(model, faithful_requests(8), method="integrated-gradients", steps=8)
    line = (
        f"explain, deletion-curve area (integrated gradients, 8 steps, tiny, 8 generated requests): by attribution "
        f"{by_attribution:.4f}, random order {random_order:.4f}"
    )
    print(line)
    figures(line)
    assert by_attribution < random_order, line


def test_integrated_gradients_sum_to_the_change_from_the_baseline(model, figures):
    explanation = model.explain({"state": TICKET, "questions": QUESTIONS}, method="integrated-gradients", steps=16, question_ids=["refund"])
    assert [question.question_id for question in explanation.questions] == ["refund"]
    tokens = explanation.tokens
    yes, no = explanation.questions[0].options
    for option in (yes, no):
        assert len(option.token_scores) == len(tokens)
        for index, part in enumerate(explanation.parts):
            owned = [score for token, score in zip(tokens, option.token_scores) if token.part == index]
            assert option.contributions[index] == pytest.approx(sum(owned), abs=1e-9)
    assert [a + b for a, b in zip(yes.token_scores, no.token_scores)] == pytest.approx([0.0] * len(tokens), abs=1e-6)  # p(yes) + p(no) = 1
    change = sum(yes.token_scores) - yes.convergence_delta  # p(input) - p(baseline)
    line = f"explain, integrated gradients (16 steps, tiny): attributions sum {sum(yes.token_scores):.2e}, convergence delta {yes.convergence_delta:.1e}"
    print(line)
    figures(line)
    assert abs(yes.convergence_delta) <= 0.25 * abs(change), line


def test_gradients_through_the_decoder_match_finite_differences(tiny_dir, one_torch_thread):
    """The decoder's differentiable path (the delta rule's chunked twin under autograd) in fp64: grad . v of a scalar
    of the last hidden state against the central difference along v, over the state's embeddings; and the same
    forward as the engine's."""
    import torch

    from clef_flash.explain.gradients import Attributed

    model = clef_flash.load(tiny_dir, precision="fp64")
    record = model.encode({"state": TICKET, "questions": QUESTIONS})
    attributed = Attributed(model, record)
    with torch.no_grad():
        probabilities = attributed(attributed.embeds)[0].tolist()
    assert probabilities == pytest.approx([value for result in model.score([record])[0] for value in result.probabilities], rel=1e-6)

    generator = torch.Generator().manual_seed(0)
    start, end = record.state_span
    direction = torch.zeros_like(attributed.embeds)
    direction[:, start:end] = torch.randn(1, end - start, direction.shape[-1], generator=generator, dtype=direction.dtype)
    weights = torch.randn(attributed.embeds.shape[-1], generator=generator, dtype=direction.dtype)

    def scalar(embeds):
        return (model.parts.decoder(attributed.input_ids, embeds=embeds)[0, -1] * weights).sum()

    inputs = attributed.embeds.clone().requires_grad_()
    with torch.enable_grad():
        (gradient,) = torch.autograd.grad(scalar(inputs), inputs)
    step = 1e-6
    with torch.no_grad():
        numeric = (scalar(attributed.embeds + step * direction) - scalar(attributed.embeds - step * direction)) / (2 * step)
    analytic = float((gradient * direction).sum())
    print(f"d/dv of the last hidden state (fp64): autograd {analytic:.10e}, central difference {float(numeric):.10e}")
    assert analytic == pytest.approx(float(numeric), rel=1e-6)


# -- bad input -----------------------------------------------------------------------------------------

BAD = {
    "unknown question id": ({"state": TICKET, "questions": QUESTIONS}, {"question_ids": ["team", "teem"]}, "question_unknown",
                            ["body", "question_ids", 1], "no question 'teem' in this request"),
    "empty state": ({"state": "  \n", "questions": QUESTIONS}, {}, "state_empty", ["body", "state"], "the state is empty"),
    "one part": ({"state": "My card was charged twice.", "questions": QUESTIONS}, {}, "state_one_part", ["body", "state"],
                 "the state is one part (line 1: 'My card was charged twice.')"),
    "too many parts": ({"state": {f"field{i}": i for i in range(9)}, "questions": QUESTIONS}, {"max_parts": 8}, "too_many_parts",
                       ["body", "state"], "the state has 9 parts, over max_parts=8: pass max_parts=9"),
    "too costly": ({"state": TICKET, "questions": {**QUESTIONS, "topic": {"type": "choice", "criteria": {f"t{i}": None for i in range(20)}}}},
                   {"method": "integrated-gradients", "steps": 256}, "explain_too_costly", ["body", "question_ids"],
                   "integrated-gradients here would run 7168 forward and backward passes (28 options x 256 steps), over 2048"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_clear_line_before_any_inference(model, monkeypatch, capsys, tiny_dir, name):
    request, options, kind, loc, message = BAD[name]
    for name in ("score", "score_branches"):
        monkeypatch.setattr(model.engine, name, lambda *args, **kwargs: pytest.fail("inference ran"))
    with pytest.raises(RequestInvalid) as raised:
        model.explain(request, **options)
    (item,) = raised.value.errors
    assert (item["type"], item["loc"]) == (kind, loc) and message in item["msg"], item

    flags = [f"--{name.replace('_', '-')}={value}" for name, value in options.items() if name != "question_ids"]
    flags += [f"--question-id={question_id}" for question_id in options.get("question_ids", [])]
    path = Path(tiny_dir).parent / f"bad-{kind}.json"
    path.write_text(json.dumps(request))
    assert main(["explain", str(path), "--model", str(tiny_dir), "--precision", "fp32", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_gradients_are_refused_under_int8(tiny_dir, one_torch_thread):
    model = clef_flash.load(tiny_dir, precision="int8-weight-only")
    with pytest.raises(RequestInvalid, match='precision="fp32"') as raised:
        model.explain({"state": TICKET, "questions": QUESTIONS}, method="integrated-gradients")
    assert raised.value.errors[0]["type"] == "explain_method_unsupported"
    assert "int8-weight-only" in raised.value.errors[0]["msg"]
    assert model.explain({"state": TICKET, "questions": QUESTIONS}).method == "leave-out"  # leave-out runs on any model


# -- the shells ----------------------------------------------------------------------------------------


def test_cli_table_json_and_plot(tiny_dir, tmp_path, capsys):
    flags = ["--model", str(tiny_dir), "--precision", "fp32", "--state", TICKET, "--question", "refund=noul:Does the customer ask for a refund?",
             "--question", "team=choice:Which team?:billing=Charges,engineering=Bugs,sales=Deals"]
    assert main(["explain", *flags]) == 0
    table = capsys.readouterr().out
    assert "refund  (noul)  -> " in table and "team  (choice)  -> " in table and "line 3, sentence 2" in table
    assert "decoder tokens run of" in table
    plot = tmp_path / "why.png"
    assert main(["explain", *flags, "--json", "--method", "input-x-gradient", "--plot", str(plot)]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["method"] == "input-x-gradient" and list(body["questions"]) == ["refund", "team"]
    assert len(body["parts"]) == 5 and len(body["tokens"]) == len(body["questions"]["refund"]["options"]["true"]["token_scores"])
    assert plot.read_bytes().startswith(b"\x89PNG") and plot.stat().st_size > 10_000


@pytest.fixture(scope="module")
def client(model):
    from fastapi.testclient import TestClient

    from clef_flash.server import create_app

    with TestClient(create_app(model, batch_wait_ms=0)) as client:
        yield client


def test_server_route_openapi_and_errors(model, client):
    from clef_flash.server.schemas import ExplanationBody

    body = {"model": "clef-flash", "state": JSON_STATE, "questions": QUESTIONS, "depth": 2, "question_ids": ["team"]}
    response = client.post("/v1/explain", json=body)
    assert response.status_code == 200, response.text
    explained = ExplanationBody.model_validate(response.json())
    assert list(explained.questions) == ["team"] and len(explained.parts) == 6  # customer's three fields at depth 2
    assert response.json() == json.loads(json.dumps(model.explain(body, depth=2, question_ids=["team"]).to_dict() | {"cost": response.json()["cost"]}))

    for name, (request, options, kind, loc, message) in BAD.items():
        response = client.post("/v1/explain", json={**request, **options})
        assert response.status_code == 422, name
        (item,) = response.json()["detail"]
        assert (item["type"], item["loc"]) == (kind, loc) and message in item["msg"], item
    systemone = client.post("/v1/systemone", json={"state": TICKET, "questions": {"team": {"type": "choice", "criteria": {"a": None}}}})
    explain = client.post("/v1/explain", json={"state": TICKET, "questions": {"team": {"type": "choice", "criteria": {"a": None}}}})
    assert explain.status_code == systemone.status_code == 422 and explain.json() == systemone.json()  # the same validation
    assert client.post("/v1/explain", json={"state": TICKET, "questions": QUESTIONS, "max_parts": 1}).json()["detail"][0]["loc"] == ["body", "max_parts"]

    schema = client.get("/openapi.json").json()
    route = schema["paths"]["/v1/explain"]["post"]
    assert route["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ExplainRequest"}
    assert {"200", "422"} <= set(route["responses"])
    fields = schema["components"]["schemas"]["ExplainRequest"]["properties"]
    assert {"state", "questions", "method", "depth", "max_parts", "steps", "question_ids"} <= set(fields)
    assert fields["max_parts"]["maximum"] == 256


def test_mcp_tool_explain(model, tmp_path):
    pytest.importorskip("mcp")
    import anyio
    from mcp import Client

    from clef_flash.server.app import ServerSettings
    from clef_flash.server.mcp_tools import ToolServer
    from clef_flash.sets import SetStore

    tools = ToolServer(model, ServerSettings(batch_wait_ms=0), SetStore(tmp_path))

    async def run():
        async with Client(tools.server) as client:
            listed = {tool.name: tool for tool in (await client.list_tools()).tools}
            good = await client.call_tool("explain", {"state": TICKET, "questions": QUESTIONS})
            bad = await client.call_tool("explain", {"state": "One sentence.", "questions": QUESTIONS})
        return listed, good, bad

    listed, good, bad = anyio.run(run)
    assert "method" in listed["explain"].input_schema["properties"]
    assert not good.is_error and len(good.structured_content["parts"]) == 5
    assert bad.is_error and bad.structured_content["detail"][0]["type"] == "state_one_part"


def test_under_a_calibration_explain_reads_the_calibrated_probabilities(model, monkeypatch):
    """With a calibration loaded, the full request's probability in an explanation is the answer's (tempered), and
    each left-out variant is tempered alike: contributions are of the probabilities a user is shown."""
    from clef_flash.calibration import Calibration

    request = {"state": JSON_STATE, "questions": QUESTIONS}
    plain = model.explain(request)
    monkeypatch.setattr(model, "calibration", Calibration.fitted({None: {"team": 0.5, "urgency": 2.0}}, {}))
    model.state_cache.clear()
    answered = model.probabilities(request)
    tempered_explanation = model.explain(request)
    for question in tempered_explanation.questions:
        for option in question.options:
            assert option.probability == pytest.approx(answered[question.question_id][option.option_id], abs=1e-6)  # the full record run in pieces (its kept states): float rounding
    team = {option.option_id: option.contributions for question in plain.questions if question.question_id == "team" for option in question.options}
    tempered_team = {option.option_id: option.contributions for question in tempered_explanation.questions if question.question_id == "team" for option in question.options}
    assert team != tempered_team  # the temperature changed the contributions
    refund_plain = [option.contributions for question in plain.questions if question.question_id == "refund" for option in question.options]
    refund_now = [option.contributions for question in tempered_explanation.questions if question.question_id == "refund" for option in question.options]
    assert refund_plain == refund_now  # an untempered question: bit for bit
