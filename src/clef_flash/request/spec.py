"""A request written by hand on a command line: questions as one-line specs, text files read as UTF-8.

    parse_question_spec("team=choice:Which team?:billing=Charges,engineering=Bugs")   -> (id, question)
    decode_text(data, where)                                                           -> str, or one clear line
"""

from __future__ import annotations

from typing import Any

from ..errors import ClefError

QUESTION_TYPES = ("noul", "choice", "score")


def parse_question_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """`id=type:instructions[:criteria]` -> (id, question).

    noul:   `urgent=noul:Is it urgent?`
    choice: `team=choice:Which team?:billing=Charges,engineering=Bugs,other` (a bare label: no description)
    score:  `urgency=score:How urgent?:Low,Normal,High` (levels low to high)
    The instructions may contain ':'; the criteria are what follows the last ':'.
    """
    question_id, equals, rest = spec.partition("=")
    kind, colon, rest = rest.partition(":")
    kind = kind.strip()
    if not equals or not question_id or not colon or kind not in QUESTION_TYPES:
        raise ClefError(
            f"bad --question {spec!r}: write ID=TYPE:INSTRUCTIONS[:CRITERIA] with TYPE noul, choice or score, "
            "e.g. team=choice:Which team?:billing=Charges,engineering=Bugs"
        )
    if kind == "noul":
        return question_id, {"type": "noul", "instructions": rest}
    instructions, colon, criteria_text = rest.rpartition(":")
    if not colon or not criteria_text.strip():
        raise ClefError(f"bad --question {spec!r}: a {kind} question needs its options after a last ':'")
    items = [item.strip() for item in criteria_text.split(",") if item.strip()]
    if kind == "score":
        return question_id, {"type": "score", "instructions": instructions, "criteria": items}
    criteria: dict[str, str | None] = {}
    for item in items:
        label, has_description, description = item.partition("=")
        criteria[label.strip()] = description.strip() if has_description else None
    return question_id, {"type": "choice", "instructions": instructions, "criteria": criteria}


def decode_text(data: bytes, where: str) -> str:
    """`data` as text, or one line naming `where` and the byte offset of the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ClefError(
            f"{where} is not UTF-8 text: byte 0x{data[error.start]:02x} at offset {error.start} ({error.reason}); "
            "convert it first, e.g. iconv -f latin1 -t utf-8"
        ) from None
