"""Saved question sets: the questions of a request kept under a name, then asked about any state.

    clef-flash sets add triage schema.json          validated as a request is, then saved
    clef-flash answer --set triage --state "..."    POST /v1/sets/triage {"state": ...}
    clef-flash batch states.jsonl out.jsonl --set triage
    clef-flash mcp                                  a tool `triage` whose input is {"state": ...}

A schema file is what `batch --schema` reads: `{"questions": {...}}`, optionally with `"model"` and a
`"description"` (what the MCP tool says it does). One JSON file per set, `NAME.json`, in the user's
config directory (platformdirs: `~/.config/clef-flash/sets` on Linux) or in `$CLEF_FLASH_SETS_DIR`.
Each file describes itself (`"format": "clef-flash-set", "version": 1`) and is written whole or not
at all (a staging file renamed). A set is checked when saved, with the errors a request with those
questions would get (`RequestInvalid`, locations from `"body"`), and again when read: a file edited
by hand into something invalid is refused with its path, never half-used.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import QuestionSetError, RequestInvalid
from .request.protocol import parse_request

SETS_DIR_ENV = "CLEF_FLASH_SETS_DIR"
SET_FORMAT = "clef-flash-set"
SET_VERSION = 1
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
RESERVED_NAMES = ("decide", "classify", "explain")  # the MCP server's own tools: a set is a tool of the same namespace
SCHEMA_KEYS = ("questions", "model", "description")


def default_sets_dir() -> Path:
    """`$CLEF_FLASH_SETS_DIR`, else `sets` in the user's config directory for clef-flash."""
    override = os.environ.get(SETS_DIR_ENV)
    if override:
        return Path(override)
    import platformdirs

    return platformdirs.user_config_path("clef-flash") / "sets"


@dataclass(frozen=True)
class QuestionSet:
    name: str
    questions: dict[str, Any]
    model: str | None = None
    description: str | None = None

    def request(self, state: Any) -> dict[str, Any]:
        """The System One request asking this set about `state`."""
        return self.request_from_body({"state": state})

    def request_from_body(self, body: Any) -> dict[str, Any]:
        """The request for a set's body, `{"state": ...}` (and maybe `"model"`), as the route and the
        tool receive it. A body that brings its own questions is refused at `["body", "questions"]`;
        anything else wrong (not an object, no state) is left for the protocol to name."""
        if not isinstance(body, dict):
            return body  # parse_request says: the body must be a JSON object
        if "questions" in body:
            raise RequestInvalid(
                [
                    {
                        "type": "questions_not_allowed",
                        "loc": ["body", "questions"],
                        "msg": f"the question set {self.name!r} brings its own questions; send only a 'state'",
                        "input": body["questions"],
                    }
                ]
            )
        defaults = {"model": self.model} if self.model is not None else {}
        return {**defaults, **body, "questions": self.questions}

    def describe(self) -> str:
        """One line: its questions and their types, and its description."""
        kinds = ", ".join(f"{question_id} ({question['type']})" for question_id, question in self.questions.items())
        return f"{len(self.questions)} question{'s' * (len(self.questions) != 1)}: {kinds}" + (
            f" - {self.description}" if self.description else ""
        )

    def to_file(self) -> dict[str, Any]:
        extra = {key: value for key, value in (("model", self.model), ("description", self.description)) if value is not None}
        return {"format": SET_FORMAT, "version": SET_VERSION, "name": self.name, "questions": self.questions, **extra}


def _item(kind: str, loc: list[str | int], msg: str, value: Any) -> dict[str, Any]:
    return {"type": kind, "loc": loc, "msg": msg, "input": value}


def check_set(name: Any, schema: Any) -> QuestionSet:
    """A set from a name and a schema, or `RequestInvalid` listing every problem: the name's at
    `["name"]`, the schema's where a request with these questions would have them."""
    errors = []
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        errors.append(
            _item(
                "set_name",
                ["name"],
                "a set name has 1 to 64 letters, digits, '-' or '_', and starts with a letter or digit "
                f"(it names a file, a URL and a tool); got {name!r}",
                name,
            )
        )
    elif name in RESERVED_NAMES:
        errors.append(_item("set_name_reserved", ["name"], f"{name!r} is the name of a built-in MCP tool; pick another", name))
    if not isinstance(schema, dict):
        kind = {str: "string", list: "array", int: "number", float: "number", bool: "boolean"}.get(type(schema), "null")
        errors.append(_item("dict_type", ["body"], f"a set is a JSON object with 'questions'; got {kind}", schema))
        raise RequestInvalid(errors)
    if "state" in schema:
        errors.append(_item("state_not_allowed", ["body", "state"], "a set holds questions only: the state comes with each call", schema["state"]))
    description = schema.get("description")
    if description is not None and not isinstance(description, str):
        errors.append(_item("string_type", ["body", "description"], "a set's description must be a string", description))
    try:
        parsed = parse_request({"model": schema.get("model"), "questions": schema.get("questions"), "state": ""})
    except RequestInvalid as error:
        errors.extend(error.errors)
    if errors:
        raise RequestInvalid(errors)
    # Kept as given (not as parsed): the set asks exactly what the schema file says.
    return QuestionSet(name, schema["questions"], model=parsed.model, description=description)


class SetStore:
    """The saved sets in one directory (default: `default_sets_dir()`)."""

    def __init__(self, root: str | os.PathLike[str] | None = None):
        self.root = Path(root) if root is not None else default_sets_dir()

    def path(self, name: str) -> Path:
        return self.root / f"{name}.json"

    def add(self, name: str, schema: Any, *, replace: bool = False) -> QuestionSet:
        """Check and save a set; an existing one is refused unless `replace`."""
        question_set = check_set(name, schema)
        path = self.path(name)
        if path.exists() and not replace:
            raise QuestionSetError(f"a set named {name!r} exists already ({path}); `sets rm {name}` it first, or add --replace")
        self.root.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.tmp")
        staging.write_text(json.dumps(question_set.to_file(), ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        os.replace(staging, path)
        return question_set

    def get(self, name: str) -> QuestionSet:
        """A saved set; `QuestionSetError` when there is none by that name or its file is damaged."""
        path = self.path(name) if isinstance(name, str) and NAME_PATTERN.fullmatch(name) else None
        if path is None or not path.is_file():
            known = ", ".join(self.names()) or "none yet"
            raise QuestionSetError(f"no question set named {str(name)[:100]!r} in {self.root} (saved: {known}); add one with `clef-flash sets add NAME schema.json`")
        try:
            stored = json.loads(path.read_bytes())
        except ValueError as error:
            raise QuestionSetError(f"{path} is not JSON ({error}); save the set again with `sets add --replace`") from None
        if not isinstance(stored, dict) or stored.get("format") != SET_FORMAT or stored.get("version") != SET_VERSION:
            raise QuestionSetError(f"{path} is not a version {SET_VERSION} {SET_FORMAT} file; save the set again with `sets add --replace`")
        try:
            return check_set(name, {key: stored[key] for key in SCHEMA_KEYS if key in stored})
        except RequestInvalid as error:
            raise QuestionSetError(f"{path} is no longer a valid set: {error}") from None

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(path.stem for path in self.root.glob("*.json") if NAME_PATTERN.fullmatch(path.stem))

    def all(self) -> list[QuestionSet]:
        return [self.get(name) for name in self.names()]

    def remove(self, name: str) -> None:
        path = self.path(name) if isinstance(name, str) and NAME_PATTERN.fullmatch(name) else None
        if path is None or not path.is_file():
            self.get(name)  # raises: no such set, naming the saved ones
        path.unlink()
