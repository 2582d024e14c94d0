"""The System One protocol: every limit, FastAPI-shaped errors, answer shaping against the reference."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clef_flash.errors import RequestInvalid
from clef_flash.request.protocol import (
    DEFAULT_MODEL_NAME,
    MAX_CHOICE_OPTIONS,
    MAX_ID_LENGTH,
    MAX_QUESTIONS,
    MAX_SCORE_LEVELS,
    SystemOneRequest,
    SystemOneResponse,
    parse_request,
    parse_request_json,
    served_request,
)
from clef_flash.request.answers import shape_answer, shape_response

NOUL = {"type": "noul", "instructions": "Is this about billing?"}
CHOICE = {"type": "choice", "instructions": "Tone?", "criteria": {"calm": None, "angry": "An upset message"}}
SCORE = {"type": "score", "instructions": "Urgency?", "criteria": ["Can wait", "This week", "Today"]}
VALID = {
    "model": "clef-flash",
    "state": "I was charged twice.",
    "questions": {"billing": NOUL, "tone": CHOICE, "urgency": SCORE},
}


_DEFAULT: Any = object()


def body(questions: Any = _DEFAULT, **top: Any) -> dict[str, Any]:
    """A valid request, with its questions and top-level fields replaced where given."""
    out: dict[str, Any] = {"state": "text", "questions": {"q": NOUL} if questions is _DEFAULT else questions}
    out.update(top)
    return out


def without(key: str) -> dict[str, Any]:
    out = copy.deepcopy(VALID)
    del out[key]
    return out


def question(**fields: Any) -> dict[str, Any]:
    return body({"q": fields})


def options(n: int) -> dict[str, str]:
    return {f"option-{i}": f"description {i}" for i in range(n)}


def errors_of(value: Any) -> list[dict[str, Any]]:
    with pytest.raises(RequestInvalid) as caught:
        parse_request(value)
    return caught.value.errors


def check_detail(error: RequestInvalid) -> None:
    """The 422 body FastAPI would send: serialisable as strict UTF-8 JSON, every item well formed."""
    detail = error.detail()
    assert list(detail) == ["detail"] and detail["detail"]
    json.dumps(detail, ensure_ascii=False, allow_nan=False).encode("utf-8")
    for item in detail["detail"]:
        assert {"type", "loc", "msg"} <= set(item) <= {"type", "loc", "msg", "input", "ctx"}
        assert isinstance(item["type"], str) and item["type"]
        assert isinstance(item["msg"], str) and item["msg"]
        assert isinstance(item["loc"], list) and item["loc"][0] == "body"
        assert all(isinstance(part, (str, int)) for part in item["loc"])
        assert "ctx" not in item or isinstance(item["ctx"], dict)


Q = ["body", "questions", "q"]
MALFORMED = [
    # (id, body, loc of the first error, its type)
    ("body-array", [], ["body"], "dict_type"),
    ("body-string", "state", ["body"], "dict_type"),
    ("body-null", None, ["body"], "dict_type"),
    ("body-number", 3, ["body"], "dict_type"),
    ("state-missing", without("state"), ["body", "state"], "missing"),
    ("state-null", body(state=None), ["body", "state"], "state_null"),
    ("state-lone-surrogate", body(state="bad \ud800 text"), ["body", "state"], "string_unicode"),
    ("state-nan", body(state={"x": math.nan}), ["body", "state"], "json_type"),
    ("state-python-set", body(state={1, 2}), ["body", "state"], "json_type"),
    ("state-int-keys", body(state={1: "a"}), ["body", "state"], "json_type"),
    ("questions-missing", without("questions"), ["body", "questions"], "missing"),
    ("questions-array", body([NOUL]), ["body", "questions"], "dict_type"),
    ("questions-null", body(questions=None), ["body", "questions"], "dict_type"),
    ("questions-empty", body({}), ["body", "questions"], "too_short"),
    (
        "questions-65",
        body({f"q{i}": NOUL for i in range(MAX_QUESTIONS + 1)}),
        ["body", "questions"],
        "too_many_questions",
    ),
    ("id-empty", body({"": NOUL}), ["body", "questions", ""], "string_too_short"),
    ("id-101", body({"x" * (MAX_ID_LENGTH + 1): NOUL}), ["body", "questions", "x" * 101], "string_too_long"),
    ("question-string", body({"q": "Is it?"}), Q, "dict_type"),
    ("question-null", body({"q": None}), Q, "dict_type"),
    ("question-array", body({"q": [NOUL]}), Q, "dict_type"),
    ("type-unknown", question(type="box"), [*Q, "type"], "literal_error"),
    ("type-wrong-case", question(type="Choice", criteria=options(2)), [*Q, "type"], "literal_error"),
    ("type-number", question(type=1), [*Q, "type"], "literal_error"),
    ("type-null", question(type=None), [*Q, "type"], "literal_error"),
    ("type-missing", question(instructions="Is it?"), [*Q, "type"], "missing"),
    ("choice-no-criteria", question(type="choice"), [*Q, "criteria"], "missing"),
    ("choice-null-criteria", question(type="choice", criteria=None), [*Q, "criteria"], "dict_type"),
    ("choice-1-option", question(type="choice", criteria=options(1)), [*Q, "criteria"], "too_short"),
    ("choice-0-options", question(type="choice", criteria={}), [*Q, "criteria"], "too_short"),
    ("choice-256", question(type="choice", criteria=options(MAX_CHOICE_OPTIONS + 1)), [*Q, "criteria"], "too_long"),
    ("choice-list", question(type="choice", criteria=["a", "b"]), [*Q, "criteria"], "dict_type"),
    (
        "choice-empty-label",
        question(type="choice", criteria={"": "x", "b": "y"}),
        [*Q, "criteria", ""],
        "string_too_short",
    ),
    (
        "choice-number-description",
        question(type="choice", criteria={"a": 1, "b": "y"}),
        [*Q, "criteria", "a"],
        "content_type",
    ),
    ("score-no-criteria", question(type="score"), [*Q, "criteria"], "missing"),
    ("score-1-level", question(type="score", criteria=["only"]), [*Q, "criteria"], "too_short"),
    ("score-11-levels", question(type="score", criteria=["l"] * (MAX_SCORE_LEVELS + 1)), [*Q, "criteria"], "too_long"),
    ("score-object", question(type="score", criteria={"0": "low", "1": "high"}), [*Q, "criteria"], "list_type"),
    ("score-string", question(type="score", criteria="low,high"), [*Q, "criteria"], "list_type"),
    ("score-null-level", question(type="score", criteria=["low", None]), [*Q, "criteria", 1], "content_type"),
    ("score-number-level", question(type="score", criteria=[0, 1]), [*Q, "criteria", 0], "content_type"),
    (
        "noul-maybe",
        question(type="noul", criteria={"true": "yes", "maybe": "?"}),
        [*Q, "criteria", "maybe"],
        "extra_forbidden",
    ),
    ("noul-list", question(type="noul", criteria=["yes", "no"]), [*Q, "criteria"], "dict_type"),
    ("noul-string", question(type="noul", criteria="yes"), [*Q, "criteria"], "dict_type"),
    ("noul-number-value", question(type="noul", criteria={"true": 1}), [*Q, "criteria", "true"], "content_type"),
    ("instructions-number", question(type="noul", instructions=42), [*Q, "instructions"], "content_type"),
    ("instructions-bool", question(type="noul", instructions=True), [*Q, "instructions"], "content_type"),
    ("unknown-question-field", question(type="noul", instruction="typo"), [*Q, "instruction"], "extra_forbidden"),
    ("images-undecodable", body(images=["data:image/png;base64,AAAA"]), ["body", "images", 0], "image_undecodable"),
    ("images-string", body(images="data:image/png;base64,AAAA"), ["body", "images"], "list_type"),
    ("images-url", body(images=["https://example.com/a.png"]), ["body", "images", 0], "image_url_refused"),
    (
        "assets",
        body(assets={"<image:1>": {"type": "image", "part": "asset-0"}}),
        ["body", "assets"],
        "images_unsupported",
    ),
    ("videos-not-a-uri", body(videos=["v.mp4"]), ["body", "videos", 0], "video_type"),
    ("videos-string", body(videos="data:video/mp4;base64,AAAA"), ["body", "videos"], "list_type"),
    ("model-number", body(model=3), ["body", "model"], "string_type"),
    ("model-object", body(model={"name": "clef"}), ["body", "model"], "string_type"),
    # Ids that spell a union tag still locate by position, not by name.
    (
        "id-named-choice",
        body({"choice": {"type": "choice", "criteria": options(1)}}),
        ["body", "questions", "choice", "criteria"],
        "too_short",
    ),
    (
        "id-named-noul",
        body({"noul": {"type": "score", "criteria": [1, "x"]}}),
        ["body", "questions", "noul", "criteria", 0],
        "content_type",
    ),
    (
        "label-named-key",
        question(type="choice", criteria={"[key]": 5, "b": None}),
        [*Q, "criteria", "[key]"],
        "content_type",
    ),
]


@pytest.mark.parametrize(
    ("value", "loc", "error_type"), [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED]
)
def test_malformed_request_is_refused_at_its_location(value, loc, error_type):
    with pytest.raises(RequestInvalid) as caught:
        parse_request(value)
    check_detail(caught.value)
    first = caught.value.errors[0]
    assert (first["loc"], first["type"]) == (loc, error_type), first


def test_messages_say_what_is_allowed():
    assert (
        errors_of(question(type="choice", criteria=options(1)))[0]["msg"]
        == "a choice question needs 2 to 255 options; got 1"
    )
    assert (
        errors_of(question(type="score", criteria=["l"] * 11))[0]["msg"]
        == "a score question needs 2 to 10 levels; got 11"
    )
    assert errors_of(body({f"q{i}": NOUL for i in range(65)}))[0]["msg"] == "a request needs 1 to 64 questions; got 65"
    unknown = errors_of(question(type="box"))[0]
    assert all(name in unknown["msg"] for name in ("'box'", "'noul'", "'choice'", "'score'"))
    assert unknown["input"] == "box"
    assert errors_of(body(images=["x"]))[0]["msg"] == "an image must be a data URI: data:image/png|jpeg|webp;base64,..."
    assert errors_of(body(videos=["v.mp4"]))[0]["msg"] == "a video must be a data URI: data:video/mp4|webm;base64,..."
    assert errors_of(question(type="choice", criteria=options(1)))[0]["ctx"] == {
        "min_length": 2,
        "max_length": 255,
        "actual_length": 1,
    }


def test_every_error_is_reported_in_body_order():
    bad = {
        "model": 1,
        "state": None,
        "questions": {"a": {"type": "choice", "criteria": options(1)}, "b": {"type": "score", "criteria": [None, 3]}},
    }
    locs = [item["loc"] for item in errors_of(bad)]
    assert locs == [
        ["body", "model"],
        ["body", "state"],
        ["body", "questions", "a", "criteria"],
        ["body", "questions", "b", "criteria", 0],
        ["body", "questions", "b", "criteria", 1],
    ]


def test_state_missing_and_null_are_different_errors():
    missing, null = errors_of(without("state"))[0], errors_of(body(state=None))[0]
    assert missing["type"] == "missing" and null["type"] == "state_null"
    assert missing["loc"] == null["loc"] == ["body", "state"]


VALID_EDGES = [
    ("64-questions", body({f"q{i}": NOUL for i in range(MAX_QUESTIONS)})),
    ("255-options", question(type="choice", criteria=options(MAX_CHOICE_OPTIONS))),
    ("2-options", question(type="choice", criteria=options(2))),
    ("10-levels", question(type="score", criteria=[f"level {i}" for i in range(MAX_SCORE_LEVELS)])),
    ("2-levels", question(type="score", criteria=["low", {"high": True}])),
    ("score-mixed-levels", question(type="score", criteria=["a", {"b": 1}, ["c"]])),
    ("noul-only-true", question(type="noul", criteria={"true": "Unsolicited advertising"})),
    ("noul-only-false", question(type="noul", criteria={"false": {"not": "spam"}})),
    ("noul-null-values", question(type="noul", criteria={"true": "yes", "false": None})),
    ("noul-empty-criteria", question(type="noul", criteria={})),
    ("noul-null-criteria", question(type="noul", criteria=None)),
    ("choice-null-descriptions", question(type="choice", criteria={"calm": None, "angry": None})),
    ("choice-digit-labels", question(type="choice", criteria={"10": "ten", "9": "nine"})),
    ("choice-empty-description", question(type="choice", criteria={"a": "", "b": []})),
    ("unicode-ids", body({"température": NOUL, "東京": NOUL, "😀": NOUL, "a b\nc": NOUL})),
    ("id-1-char", body({"x": NOUL})),
    ("id-100-chars", body({"é" * MAX_ID_LENGTH: NOUL})),
    ("instructions-object", question(type="noul", instructions={"task": "spam?"})),
    ("instructions-list", question(type="noul", instructions=["spam?", {"hint": 1}])),
    ("instructions-missing", question(type="noul")),
    ("instructions-null", question(type="noul", instructions=None)),
    ("instructions-empty", question(type="noul", instructions="")),
    ("state-object", body(state={"message": "hi", "n": [1, 2.5, None, True]})),
    ("state-array", body(state=["a", {"b": None}])),
    ("state-number", body(state=3.5)),
    ("state-bool", body(state=False)),
    ("state-empty-string", body(state="")),
    ("model-missing", body()),
    ("model-null", body(model=None)),
    ("model-alias", body(model="jev-latest")),
    ("media-empty", body(images=[], videos=None, assets={})),
    ("unknown-top-level-fields", body(stream=False, metadata={"k": 1}, id="r1")),
]


@pytest.mark.parametrize("value", [case[1] for case in VALID_EDGES], ids=[case[0] for case in VALID_EDGES])
def test_valid_edge_case_is_accepted(value):
    request = parse_request(value)
    assert list(request.questions) == list(value["questions"])
    json.dumps(request.to_record())


# Bodies typesafe-sdk 0.7.5 sent through a mock transport (Noul/Choice/Score objects, raw dicts,
# a model override and extra_body), captured once; the SDK is not a dependency.
SDK_BODIES = [
    {
        "state": "I was charged twice.",
        "model": "jev-latest",
        "questions": {
            "billing": {"type": "noul", "instructions": "Is this about billing?"},
            "spam": {"type": "noul", "criteria": {"true": "Unsolicited", "false": None}},
            "tone": {"type": "choice", "instructions": "What is the tone?", "criteria": {"calm": None, "angry": None}},
            "urgency": {
                "type": "score",
                "instructions": {"task": "rate"},
                "criteria": ["Can wait", "This week", ["today"]],
            },
        },
    },
    {
        "state": {"message": "x"},
        "model": "jev-1.13.0",
        "questions": {
            "a": {"type": "noul", "instructions": "q", "criteria": None},
            "a2": {"type": "noul", "instructions": None, "criteria": {"true": "t"}},
            "b": {"type": "choice", "criteria": {"x": None, "y": {"d": 1}}},
            "c": {"type": "score", "criteria": ["lo", "hi"]},
        },
        "stream": False,
        "metadata": {"k": 1},
    },
    {"state": ["a", {"b": None}], "model": "jev-latest", "questions": {"n": {"type": "noul", "instructions": ["x"]}}},
]


@pytest.mark.parametrize("value", SDK_BODIES)
def test_typesafe_sdk_bodies_validate(value):
    request = parse_request_json(json.dumps(value).encode())
    assert request.model == value["model"]


def test_to_record_keeps_request_order_and_sent_keys():
    value = {
        "state": {"b": 1, "a": 2},
        "questions": {
            "zeta": {"type": "choice", "criteria": {"b": "bee", "10": None, "9": "nine", "a": "ay"}},
            "alpha": {"type": "noul", "criteria": {"false": None}},
            "mid": {"type": "score", "instructions": "", "criteria": ["lo", "hi"]},
            "plain": {"type": "noul"},
        },
    }
    record = parse_request(value).to_record()
    assert record == {
        "state": {"b": 1, "a": 2},
        "questions": {
            "zeta": {
                "type": "choice",
                "instructions": None,
                "criteria": {"b": "bee", "10": None, "9": "nine", "a": "ay"},
            },
            "alpha": {"type": "noul", "instructions": None, "criteria": {"false": None}},
            "mid": {"type": "score", "instructions": "", "criteria": ["lo", "hi"]},
            "plain": {"type": "noul", "instructions": None, "criteria": None},
        },
    }
    assert list(record["questions"]) == ["zeta", "alpha", "mid", "plain"]
    assert list(record["questions"]["zeta"]["criteria"]) == ["b", "10", "9", "a"]


def test_to_record_renders_like_the_reference(reference):
    """The record gives the reference's own option lists (noul keys left out get the defaults)."""
    record = parse_request(SDK_BODIES[0]).to_record()
    spam = reference.question_options(record["questions"]["spam"])
    billing = reference.question_options(record["questions"]["billing"])
    assert spam == [("true", "Unsolicited"), ("false", None)]
    assert billing[0] == ("true", "The proposition is true or the answer is yes.")


def test_parse_request_accepts_a_model_and_is_immutable():
    request = parse_request(VALID)
    assert parse_request(request) is request
    with pytest.raises(pydantic.ValidationError):  # frozen
        request.model = "other"  # type: ignore[misc]


# --- raw bodies ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw", [b'{"state": "x",', "{'state': 1}", b"[1, 2", b"nope", b'{"state": NaN, "questions": {}}', b"\xff\xfe{}"]
)
def test_undecodable_body_is_json_invalid(raw):
    with pytest.raises(RequestInvalid) as caught:
        parse_request_json(raw)
    check_detail(caught.value)
    (item,) = caught.value.errors
    assert item["type"] == "json_invalid" and item["loc"][0] == "body" and isinstance(item["loc"][1], int)


def test_json_invalid_position_is_fastapis():
    raw = '{"state": "x", "questions": }'
    with pytest.raises(json.JSONDecodeError) as python:
        json.loads(raw)
    with pytest.raises(RequestInvalid) as caught:
        parse_request_json(raw)
    assert caught.value.errors[0]["loc"] == ["body", python.value.pos]


@pytest.mark.parametrize("raw", [b"", b"  \n", ""])
def test_empty_body_is_missing(raw):
    with pytest.raises(RequestInvalid) as caught:
        parse_request_json(raw)
    assert caught.value.errors[0]["type"] == "missing" and caught.value.errors[0]["loc"] == ["body"]


def test_escaped_lone_surrogate_is_refused_and_reported_safely():
    raw = b'{"state": "x\\ud800", "questions": {"\\udc00": {"type": "noul", "\\ud801": 1}}}'
    with pytest.raises(RequestInvalid) as caught:
        parse_request_json(raw)
    check_detail(caught.value)
    assert caught.value.errors[0]["loc"] == ["body", "state"]
    assert caught.value.errors[0]["type"] == "string_unicode"


def test_raw_bodies_validate():
    assert parse_request_json(json.dumps(VALID)).model == "clef-flash"
    assert list(parse_request_json(json.dumps(VALID, ensure_ascii=False).encode("utf-8")).questions) == [
        "billing",
        "tone",
        "urgency",
    ]


# --- fuzz ------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
KEYS = st.sampled_from(["type", "instructions", "criteria", "true", "false", "state", "questions", "model", "images"])


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON value, the root included."""
    found = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            found += paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += paths(child, (*prefix, index))
    return found


@st.composite
def mutated_requests(draw) -> Any:
    """A valid request with a few random edits: keys dropped, values replaced, keys added."""
    value: Any = copy.deepcopy(VALID)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths(value)))
        action = draw(st.sampled_from(["drop", "replace", "add"]))
        if not path:
            value = draw(JSON) if action == "replace" else value
            continue
        parent = value
        for key in path[:-1]:
            parent = parent[key]
        if action == "drop":
            del parent[path[-1]]
        elif action == "replace":
            parent[path[-1]] = draw(JSON)
        elif isinstance(parent[path[-1]], dict):
            parent[path[-1]][draw(KEYS | st.text(max_size=6))] = draw(JSON)
    return value


def assert_parses_or_refuses_cleanly(value: Any) -> None:
    try:
        request = parse_request(value)
    except RequestInvalid as error:
        check_detail(error)
    else:
        assert isinstance(request, SystemOneRequest)
        json.dumps(request.to_record(), allow_nan=False)


FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(JSON)
def test_fuzz_arbitrary_json(value):
    assert_parses_or_refuses_cleanly(value)


@FAST
@given(mutated_requests())
def test_fuzz_mutated_requests(value):
    assert_parses_or_refuses_cleanly(value)


@FAST
@given(st.binary(max_size=40) | st.text(max_size=40).map(str.encode) | mutated_requests().map(json.dumps))
def test_fuzz_raw_bodies(raw):
    try:
        parse_request_json(raw)
    except RequestInvalid as error:
        check_detail(error)


# --- answers -------------------------------------------------------------------------------

LABELS = st.lists(st.text(min_size=1, max_size=3), min_size=2, max_size=8, unique=True)
# A few values make ties common; the rest exercise rounding.
PROBABILITY = st.sampled_from([0.0, 0.25, 0.5, 1 / 3, 0.12345, 0.99995]) | st.floats(0, 1)


def encoder_order(question: dict[str, Any], reference) -> list[str]:
    """The option ids as the encoder yields them (choice labels sorted)."""
    return [option for option, _ in reference.question_options(question)]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), question_type=st.sampled_from(["noul", "choice", "score"]))
def test_shape_answer_equals_the_reference(reference, data, question_type):
    if question_type == "noul":
        question = {"type": "noul", "criteria": None}
    elif question_type == "choice":
        question = {"type": "choice", "criteria": {label: None for label in data.draw(LABELS)}}
    else:
        question = {"type": "score", "criteria": [f"level {i}" for i in range(data.draw(st.integers(2, 10)))]}
    option_ids = encoder_order(question, reference)
    probabilities = data.draw(st.lists(PROBABILITY, min_size=len(option_ids), max_size=len(option_ids)))
    ours = shape_answer(question, option_ids, probabilities)
    theirs = reference.systemone_answer(question, dict(zip(option_ids, probabilities, strict=True)))
    assert ours == theirs
    assert json.dumps(ours) == json.dumps(theirs)  # the same key order too
    if question_type == "choice":
        assert list(ours["probabilities"]) == list(question["criteria"])


def test_choice_follows_criteria_order_and_ties_go_first(reference):
    question = {"type": "choice", "criteria": {"b": None, "10": None, "9": None, "a": None}}
    option_ids = encoder_order(question, reference)
    assert option_ids == ["10", "9", "a", "b"]
    answer = shape_answer(question, option_ids, [0.1, 0.4, 0.1, 0.4])
    assert answer["choice"] == "b"  # tied with "9", and first in the request's order
    assert list(answer["probabilities"]) == ["b", "10", "9", "a"]
    assert shape_answer(question, option_ids, [0.25] * 4)["choice"] == "b"


def test_argmax_uses_unrounded_probabilities():
    question = {"type": "choice", "criteria": {"a": None, "b": None}}
    answer = shape_answer(question, ["a", "b"], [0.499996, 0.500004])
    assert answer["choice"] == "b" and answer["probabilities"] == {"a": 0.5, "b": 0.5}


def test_decimals():
    score = {"type": "score", "criteria": ["lo", "mid", "hi"]}
    raw = shape_answer(score, ["0", "1", "2"], [0.123456, 0.2, 0.676544], decimals=None)
    assert raw["probabilities"]["0"] == 0.123456 and raw["score"] == pytest.approx(0.2 + 2 * 0.676544)
    assert raw["legend"] == {"0": "lo", "1": "mid", "2": "hi"} and raw["confidence"] == 0.676544
    assert shape_answer(score, ["0", "1", "2"], [0.123456, 0.2, 0.676544], decimals=2)["probabilities"]["0"] == 0.12
    noul = shape_answer({"type": "noul"}, ["true", "false"], [0.876543, 0.123457])
    assert noul == {"type": "noul", "noul": 0.8765}


@pytest.mark.parametrize(
    ("option_ids", "probabilities"),
    [(["a"], [1.0]), (["a", "c"], [0.5, 0.5]), (["a", "a"], [0.5, 0.5]), (["a", "b"], [1.0])],
)
def test_shape_answer_refuses_mismatched_options(option_ids, probabilities):
    with pytest.raises(ValueError):
        shape_answer({"type": "choice", "criteria": {"a": None, "b": None}}, option_ids, probabilities)


def test_shape_response(reference):
    request = parse_request(SDK_BODIES[1])
    record = request.to_record()["questions"]
    per_question = []
    for question in record.values():
        option_ids = encoder_order(question, reference)
        per_question.append((option_ids, [1 / len(option_ids)] * len(option_ids)))
    response = shape_response(request, per_question, input_tokens=321)
    assert response["model"] == "jev-1.13.0"
    assert list(response["answers"]) == ["a", "a2", "b", "c"]
    assert response["usage"] == {"input_tokens": 321, "output_tokens": 0}
    assert response["answers"]["c"] == {
        "type": "score",
        "score": 0.5,
        "confidence": 0.5,
        "legend": {"0": "lo", "1": "hi"},
        "probabilities": {"0": 0.5, "1": 0.5},
    }
    SystemOneResponse.model_validate(response)
    unnamed = parse_request(body({"q": NOUL}))
    assert shape_response(unnamed, [(["true", "false"], [0.3, 0.7])], 5)["model"] == DEFAULT_MODEL_NAME
    assert shape_response(unnamed, [(["true", "false"], [0.3, 0.7])], 5, default_model="mine")["model"] == "mine"
    with pytest.raises(ValueError):
        shape_response(unnamed, [], 5)


def test_models_serve_as_fastapi_body_and_response():
    fastapi = pytest.importorskip("fastapi")
    app = fastapi.FastAPI()

    @app.post("/v1/systemone", response_model=SystemOneResponse)
    def answer(request: SystemOneRequest) -> dict[str, Any]:  # pragma: no cover - schema only
        raise NotImplementedError

    schemas = app.openapi()["components"]["schemas"]
    assert {"SystemOneRequest", "SystemOneResponse", "ChoiceQuestion", "ScoreAnswer"} <= set(schemas)
    questions = schemas["SystemOneRequest"]["properties"]["questions"]
    assert (questions["minProperties"], questions["maxProperties"]) == (1, MAX_QUESTIONS)


# -- the published schema is the validation (issue 30) -------------------------------------------


def test_every_published_bound_is_the_enforced_one():
    """Each min/max the JSON schema states: a body at it is accepted, one past it refused."""
    schema = SystemOneRequest.model_json_schema()
    questions = schema["properties"]["questions"]
    ids = questions["propertyNames"]
    choice = schema["$defs"]["ChoiceQuestion"]["properties"]["criteria"]
    score = schema["$defs"]["ScoreQuestion"]["properties"]["criteria"]
    bounded = {
        "questions": (lambda n: body({f"q{i}": NOUL for i in range(n)}), questions["minProperties"], questions["maxProperties"]),
        "question id": (lambda n: body({"x" * n: NOUL}), ids["minLength"], ids["maxLength"]),
        "options": (lambda n: question(type="choice", criteria=options(n)), choice["minProperties"], choice["maxProperties"]),
        "option label": (
            lambda n: question(type="choice", criteria={"x" * n: None, "other": None}),
            choice["propertyNames"]["minLength"],
            None,
        ),
        "levels": (lambda n: question(type="score", criteria=["level"] * n), score["minItems"], score["maxItems"]),
    }
    for what, (make, low, high) in bounded.items():
        for accepted in (low, high) if high is not None else (low,):
            parse_request(make(accepted))
        for refused in (low - 1, high + 1) if high is not None else (low - 1,):
            assert errors_of(make(refused)), (what, refused)


def test_images_are_published_with_their_count_limit():
    null, published = SystemOneRequest.model_json_schema()["properties"]["images"]["anyOf"]
    assert null == {"type": "null"} and published["type"] == "array" and published["maxItems"] == 4
    assert published["items"]["pattern"].startswith("^data:image/(png|jpeg|webp);base64,")
    for media in ([{"url": "x"}], {"a": 1}, 0, "", ["https://example.com/a.png"], ["data:image/png;base64,x"] * 5):
        assert errors_of(body(images=media))[0]["loc"][:2] == ["body", "images"]


def test_assets_are_published_as_empty_only():
    published = SystemOneRequest.model_json_schema()["properties"]["assets"]["anyOf"]
    assert published == [{"type": "null"}, {"type": "array", "maxItems": 0}, {"type": "object", "maxProperties": 0}]
    for empty in (None, [], {}):
        parse_request(body(assets=empty))
    for media in ([{"url": "x"}], {"a": 1}, 0, ""):
        assert errors_of(body(assets=media))[0]["loc"] == ["body", "assets"]


def test_videos_are_published_and_located():
    null, published = SystemOneRequest.model_json_schema()["properties"]["videos"]["anyOf"]
    assert null == {"type": "null"} and published["type"] == "array" and published["maxItems"] == 4
    uri, frames = published["items"]["anyOf"]
    assert uri["pattern"].startswith("^data:video/(mp4|webm);base64,") and frames["items"]["pattern"].startswith("^data:image/")
    for empty in (None, []):
        assert parse_request(body(videos=empty)).videos is None
    for media in ([{"url": "x"}], {"a": 1}, 0, "", ["https://example.com/a.mp4"], ["data:video/mp4;base64,x"] * 5):
        assert errors_of(body(videos=media))[0]["loc"][:2] == ["body", "videos"]


def test_a_served_request_publishes_and_enforces_its_model_names():
    request_type = served_request(("clef-flash", "clef"))
    published = request_type.model_json_schema()["properties"]["model"]["anyOf"]
    assert published == [{"type": "string", "enum": ["clef-flash", "clef", ""]}, {"type": "null"}]
    for name in ("clef-flash", "clef", ""):
        assert parse_request(body(model=name), request_type).model == name
    assert parse_request(body(), request_type).model is None
    with pytest.raises(RequestInvalid) as caught:
        parse_request(body(model="jev-latest"), request_type)
    (item,) = caught.value.errors
    assert item["type"] == "model_not_served" and item["loc"] == ["body", "model"] and item["input"] == "jev-latest"
    assert item["msg"] == "this server serves 'clef-flash'; 'model' must be one of 'clef-flash', 'clef' or left out; got 'jev-latest'"
    assert item["ctx"] == {"served": ["clef-flash", "clef"]}
    assert parse_request(body(model="jev-latest")).model == "jev-latest"  # the protocol alone takes any name
