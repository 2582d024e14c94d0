"""A request's state as parts, and the request with some parts left out: pure host code, no torch.

Parts, in the order their tokens come in the record (SPEC §3: the images and videos precede the state):

- each image, then each video;
- a JSON state (an object or an array): each member, recursively to `depth` levels (1: the top-level fields or
  items), in the rendered order (keys sorted); a member that is a scalar, an empty object or an empty array is a
  part at any depth. A number or boolean state is one part;
- a text state: its lines, each split into sentences after `.`, `!`, `?` or `…` followed by whitespace; blank
  lines are no part.

Left out, a JSON member is deleted from its object or array; an image or video leaves the request's list; a
sentence takes the spaces and tabs after it (the last sentence of a line the separator before it instead), and a
part that is a whole line takes its line break. Leaving out several parts deletes each (the union of the text cut).
The edited request is an ordinary request: the record is rendered from it as any other (SPEC §3).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from ..request.protocol import SystemOneRequest
from ..request.records import render

EXCERPT_CHARACTERS = 80
SENTENCE_BREAK = re.compile(r"(?<=[.!?…])\s+")  # a sentence ends at one of these marks, then whitespace


@dataclass(frozen=True)
class Part:
    """One part of a request's state."""

    kind: str  # "image", "video", "field" (an object's member), "item" (an array's), "value", "line", "sentence"
    label: str  # "images[0]", "customer.name", "tags[2]", "line 3", "line 3, sentence 2"
    path: tuple[str | int, ...]  # ("images", 0); the keys and indices to a JSON member; (line, sentence) of a text
    excerpt: str  # the part as rendered, cut to EXCERPT_CHARACTERS
    chars: tuple[int, int] | None = None  # a text's part: its characters [start, end) in the state
    cut: tuple[int, int] | None = None  # a text's part: the characters [start, end) removed when it is left out

    def describe(self) -> dict[str, Any]:
        described = {"kind": self.kind, "label": self.label, "path": list(self.path), "excerpt": self.excerpt}
        return described if self.chars is None else {**described, "chars": list(self.chars)}


def state_parts(request: SystemOneRequest, depth: int = 1) -> list[Part]:
    """The parts of `request`'s state (its images and videos, then its text or JSON), in record order."""
    parts = [Part("image", f"images[{index}]", ("images", index), _image_excerpt(index, image)) for index, image in enumerate(request.images or ())]
    parts += [Part("video", f"videos[{index}]", ("videos", index), _video_excerpt(index, video)) for index, video in enumerate(request.videos or ())]
    state = request.state
    if isinstance(state, str):
        return parts + text_parts(state)
    if isinstance(state, (dict, list)):
        return parts + _members(state, (), depth)
    return parts + [Part("value", "state", (), _excerpt(render(state)))]


def _json(value: Any) -> str:
    """A JSON member as the record renders it (compact, keys sorted, non-ASCII kept)."""
    return render(value) if not isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def without(request: SystemOneRequest, parts: Sequence[Part], removed: Collection[int]) -> SystemOneRequest:
    """`request` with the parts at the indices `removed` left out (nothing else changes)."""
    gone = [parts[index] for index in sorted(set(removed))]
    update: dict[str, Any] = {}
    for field in ("images", "videos"):
        dropped = {part.path[1] for part in gone if part.kind == field[:-1]}
        if dropped:
            update[field] = [item for index, item in enumerate(getattr(request, field)) if index not in dropped] or None
    state_gone = [part for part in gone if part.kind not in ("image", "video")]
    if state_gone:
        state = request.state
        if isinstance(state, str):
            update["state"] = _cut_text(state, [part.cut for part in state_gone])
        elif isinstance(state, (dict, list)):
            update["state"] = _without_members(state, {part.path for part in state_gone})
        else:
            update["state"] = ""  # a number or boolean left out: nothing stays
    return request.model_copy(update=update)


# -- text ------------------------------------------------------------------------------------------


def text_parts(text: str) -> list[Part]:
    """A text's sentences, line by line (module docstring), each with the characters it takes when left out."""
    parts: list[Part] = []
    line_start = 0
    lines = text.split("\n")
    for line_number, line in enumerate(lines):
        sentences = _sentences(line)  # [(start, end)] within the line
        for number, (start, end) in enumerate(sentences):
            if len(sentences) == 1:
                ends_text = line_number == len(lines) - 1
                cut = (max(line_start - 1, 0), line_start + len(line)) if ends_text else (line_start, line_start + len(line) + 1)
                kind, label = "line", f"line {line_number + 1}"
            elif number < len(sentences) - 1:
                cut = (line_start + start, line_start + sentences[number + 1][0])
                kind, label = "sentence", f"line {line_number + 1}, sentence {number + 1}"
            else:
                trailing = len(line[end:]) - len(line[end:].lstrip(" \t"))
                cut = (line_start + sentences[number - 1][1], line_start + end + trailing)
                kind, label = "sentence", f"line {line_number + 1}, sentence {number + 1}"
            chars = (line_start + start, line_start + end)
            parts.append(Part(kind, label, (line_number, number), _excerpt(line[start:end]), chars, cut))
        line_start += len(line) + 1
    return parts


def _sentences(line: str) -> list[tuple[int, int]]:
    """[start, end) of each sentence of a line, its surrounding whitespace excluded."""
    pieces, start = [], 0
    for brk in [*SENTENCE_BREAK.finditer(line), None]:
        end = len(line) if brk is None else brk.start()
        piece = line[start:end]
        if piece.strip():
            lead = len(piece) - len(piece.lstrip())
            pieces.append((start + lead, start + len(piece.rstrip())))
        if brk is not None:
            start = brk.end()
    return pieces


def _cut_text(text: str, cuts: Sequence[tuple[int, int]]) -> str:
    """`text` without the characters of every cut (overlapping cuts merge)."""
    kept, position = [], 0
    for start, end in sorted(cuts):
        if start > position:
            kept.append(text[position:start])
        position = max(position, end)
    kept.append(text[position:])
    return "".join(kept)


# -- JSON --------------------------------------------------------------------------------------------


def _members(value: dict | list, path: tuple[str | int, ...], depth: int) -> list[Part]:
    """The members of an object (keys sorted: the rendered order) or array, split further while `depth` allows."""
    items = sorted(value.items()) if isinstance(value, dict) else list(enumerate(value))
    parts: list[Part] = []
    for key, member in items:
        where = (*path, key)
        if depth > 1 and isinstance(member, (dict, list)) and member:
            parts += _members(member, where, depth - 1)
            continue
        kind = "field" if isinstance(value, dict) else "item"
        shown = f"{_json(key)}:{_json(member)}" if kind == "field" else _json(member)
        parts.append(Part(kind, json_label(where), where, _excerpt(shown)))
    return parts


def json_label(path: Sequence[str | int]) -> str:
    """`customer.name`, `tags[2]`, `["a.b"].c`: a JSON member's path as people write it."""
    label = ""
    for key in path:
        if isinstance(key, int):
            label += f"[{key}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", key):
            label += f".{key}" if label else key
        else:
            label += f"[{_json(key)}]"
    return label


def _without_members(value: Any, paths: set[tuple[str | int, ...]], where: tuple[str | int, ...] = ()) -> Any:
    """A copy of `value` without the members at `paths` (the rest shared, not copied)."""
    if not isinstance(value, (dict, list)) or not any(path[: len(where)] == where and len(path) > len(where) for path in paths):
        return value
    if isinstance(value, dict):
        return {key: _without_members(member, paths, (*where, key)) for key, member in value.items() if (*where, key) not in paths}
    return [_without_members(member, paths, (*where, index)) for index, member in enumerate(value) if (*where, index) not in paths]


# -- media and excerpts ------------------------------------------------------------------------------


def _image_excerpt(index: int, image: Any) -> str:
    pixels = getattr(image, "image", None)
    size = f"{pixels.width}x{pixels.height}" if pixels is not None else "?"
    return f"image {index + 1} ({size})"


def _video_excerpt(index: int, video: Any) -> str:
    width, height = getattr(video, "size", (0, 0))
    return f"video {index + 1} ({width}x{height}, {getattr(video, 'frame_count', '?')} frames)"


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= EXCERPT_CHARACTERS else text[: EXCERPT_CHARACTERS - 1] + "…"
