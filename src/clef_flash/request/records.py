"""Record rendering: a request -> token ids and spans, token for token as the reference (SPEC §3).

Pure host code. The reference tokenizes each piece of the prompt with its own tokenizer call;
since pieces are tokenized independently, the same ids come from tokenizing every variable piece
in one batched call and reusing cached ids for the fixed pieces. `tests/test_records.py` proves
the two equal on the named edge cases and on generated requests.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

import numpy as np

from ..errors import RecordTooLong, RequestInvalid, media_unsupported
from .images import ImageProcessorConfig, MediaProblem, preprocess_image
from .videos import VideoProcessorConfig, preprocess_video
from .protocol import QUESTION_TYPES
from .tokenizer import Tokenizer

SYSTEM_PROMPT = (
    "Read the complete state and schema. Decide every field jointly. Each answer "
    "must be exactly one of that field's allowed options."
)
PREFIX = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nSTATE:\n"
SCHEMA_HEADER = "\n\nSCHEMA FIELDS:\n"
OPTIONS_HEADER = "\nALLOWED OPTIONS:\n"
OPTION_END = "\n"
FIELD_END = "END FIELD\n"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # one per image, pads expanded; then MEDIA_END
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"  # one per video, after the images (below)
MEDIA_END = "\n"
SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"

NOUL_DEFAULTS = {
    "true": "The proposition is true or the answer is yes.",
    "false": "The proposition is false or the answer is no.",
}
DEFAULT_MAX_LENGTH = 65_536

# json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True), built once.
_compact_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode


def render(value: Any) -> str:
    """A string as itself; any other JSON value as compact JSON, keys sorted, non-ASCII kept."""
    if isinstance(value, str):
        return value
    return _compact_json(value)


def field_header(number: int, question_id: str, question_type: str) -> str:
    return f"\nFIELD {number}\nID: {question_id}\nTYPE: {question_type}\nINSTRUCTION: "


def option_label(number: int) -> str:
    return f"OPTION {number}: "


def question_options(question: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(option id, description) in the model's order: noul true/false, choice keys sorted, score levels."""
    question_type = question["type"]
    criteria = question.get("criteria")
    if question_type == "noul":
        descriptions = dict(NOUL_DEFAULTS)
        descriptions.update(criteria or {})
        return [("true", descriptions["true"]), ("false", descriptions["false"])]
    if question_type == "choice":
        return sorted(((str(key), value) for key, value in criteria.items()), key=lambda item: item[0])
    return [(str(index), value) for index, value in enumerate(criteria)]


def instruction_text(question_id: str, question: Mapping[str, Any]) -> str:
    instructions = question.get("instructions")
    if instructions is None or instructions == "":
        instructions = str(question_id)
    return render(instructions)


def option_text(option_id: str, description: Any) -> str:
    semantics: dict[str, Any] = {"option_id": option_id}
    if description is not None:
        semantics["description"] = description
    return render(semantics)


@dataclass(frozen=True)
class EncodedQuestion:
    question_id: str
    question_type: int  # noul 0, choice 1, score 2
    question_span: tuple[int, int]  # [start, end) in the record's input_ids
    option_spans: tuple[tuple[int, int], ...]
    option_ids: tuple[str, ...]  # in the model's order (choice: sorted keys)


@dataclass(frozen=True, eq=False)
class RecordMedia:
    """A record's images and videos, preprocessed: what the vision tower reads. Their tokens are in `input_ids`
    (after the prefix, before the state, as the reference puts them): the images, then the videos, one pad token
    per merged patch; a video's frame pairs each announced by their time (`media_ids`)."""

    pixel_values: np.ndarray  # [patches, C * temporal_patch * patch²] float32: the images', then the videos'
    grids: tuple[tuple[int, int, int], ...]  # (t, h, w) in patches, per image (t = 1), then per video (t: frame pairs)
    pad_id: int  # the image pad token
    merge: int  # spatial merge size
    digest: str  # sha256 over the images' (and videos') digests: what the state cache keys on
    video_pad_id: int | None = None  # the video pad token (records with videos)
    times: tuple[tuple[float, ...], ...] = ()  # per video: the seconds announced before each frame pair

    @property
    def image_count(self) -> int:
        return len(self.grids) - len(self.times)

    @property
    def pad_ids(self) -> frozenset[int]:
        return frozenset(pad for pad in (self.pad_id, self.video_pad_id) if pad is not None)

    @property
    def tokens(self) -> int:
        return sum(t * h * w for t, h, w in self.grids) // self.merge**2

    @property
    def position_grids(self) -> tuple[tuple[int, int, int], ...]:
        """One grid per run of pad tokens, as `get_rope_index` reads them: each image's, then each frame pair's
        (t = 1: a video's pairs are runs of their own, between their timestamps)."""
        images = self.grids[: self.image_count]
        pairs = tuple((1, h, w) for t, h, w in self.grids[self.image_count :] for _ in range(t))
        return images + pairs


@dataclass(frozen=True)
class EncodedRecord:
    input_ids: tuple[int, ...]
    questions: tuple[EncodedQuestion, ...]
    prefix_tokens: int
    state_tokens: int  # after any explicit truncation
    schema_tokens: int
    suffix_tokens: int
    state_tokens_dropped: int = 0  # > 0 only with truncate_state=True
    media: RecordMedia | None = None  # images (their tokens are part of prefix_tokens)
    adapter: str | None = None  # the fine-tune (a loaded adapter's name) that scores it; None: the base

    @property
    def token_count(self) -> int:
        return len(self.input_ids)

    @property
    def state_span(self) -> tuple[int, int]:
        return (self.prefix_tokens, self.prefix_tokens + self.state_tokens)


@lru_cache(maxsize=8)
def _fixed_pieces(tokenizer: Tokenizer) -> dict[str, tuple[int, ...]]:
    pieces = [PREFIX, SCHEMA_HEADER, OPTIONS_HEADER, OPTION_END, FIELD_END, SUFFIX, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, MEDIA_END]
    return {text: tuple(ids) for text, ids in zip(pieces, tokenizer.encode_batch(pieces))}


@lru_cache(maxsize=4096)
def _option_label_ids(tokenizer: Tokenizer, number: int) -> tuple[int, ...]:
    return tuple(tokenizer.encode(option_label(number)))


def frame_pair_label(seconds: float) -> str:
    """What announces a video's frame pair (Qwen3VLProcessor's `replace_video_token`)."""
    return f"<{seconds:.1f} seconds>"


@lru_cache(maxsize=4096)
def _frame_pair_label_ids(tokenizer: Tokenizer, label: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(label))


def _as_record(request: Any) -> Mapping[str, Any]:
    if hasattr(request, "to_record"):
        return request.to_record()
    if not isinstance(request, Mapping) or "state" not in request or not request.get("questions"):
        raise RequestInvalid(
            [{"type": "invalid_record", "loc": ["body"], "msg": "a record needs a state and at least one question"}]
        )
    return request


def encode_record(
    tokenizer: Tokenizer,
    request: Any,
    *,
    max_length: int = DEFAULT_MAX_LENGTH,
    truncate_state: bool = False,
    image_processor: ImageProcessorConfig | None = None,
    video_processor: VideoProcessorConfig | None = None,
) -> EncodedRecord:
    """Render and tokenize one record (a validated request, or a plain dict in its shape).

    A record with `images` (decoded `RequestImage`s) needs the release's `image_processor`, one with `videos`
    (`RequestVideo`s) its `video_processor`. Before the state: each image as <|vision_start|>, one <|image_pad|>
    per merged patch, <|vision_end|>; then each video as <|vision_start|>, for each frame pair "<t seconds>"
    <|vision_start|> <|video_pad|>... <|vision_end|>, and <|vision_end|>; then "\n".

    Over `max_length` tokens the record is refused with `RecordTooLong` (token count, fixed part,
    limit), unless `truncate_state=True`, which cuts the state's tail exactly as the reference does.
    """
    record = _as_record(request)
    fixed = _fixed_pieces(tokenizer)

    # Every variable piece, in rendering order, tokenized in one call.
    texts = [render(record["state"])]
    layout: list[tuple[str, Mapping[str, Any], list[str]]] = []
    for number, (question_id, question) in enumerate(record["questions"].items(), start=1):
        question_id = str(question_id)
        options = question_options(question)
        texts.append(field_header(number, question_id, question["type"]))
        texts.append(instruction_text(question_id, question))
        texts.extend(option_text(option_id, description) for option_id, description in options)
        layout.append((question_id, question, [option_id for option_id, _ in options]))
    pieces = tokenizer.encode_batch(texts)

    state_ids = pieces[0]
    schema_ids: list[int] = list(fixed[SCHEMA_HEADER])
    spans: list[tuple[str, int, tuple[int, int], list[tuple[int, int]], list[str]]] = []
    cursor = 1
    for question_id, question, option_ids in layout:
        schema_ids.extend(pieces[cursor])
        question_start = len(schema_ids)
        schema_ids.extend(pieces[cursor + 1])
        question_span = (question_start, len(schema_ids))
        schema_ids.extend(fixed[OPTIONS_HEADER])
        option_spans = []
        for number in range(1, len(option_ids) + 1):
            schema_ids.extend(_option_label_ids(tokenizer, number))
            option_start = len(schema_ids)
            schema_ids.extend(pieces[cursor + 1 + number])
            option_spans.append((option_start, len(schema_ids)))
            schema_ids.extend(fixed[OPTION_END])
        schema_ids.extend(fixed[FIELD_END])
        cursor += 2 + len(option_ids)
        spans.append((question_id, QUESTION_TYPES[question["type"]], question_span, option_spans, option_ids))

    prefix_ids, suffix_ids = fixed[PREFIX], fixed[SUFFIX]
    media = None
    if record.get("images") or record.get("videos"):
        media = _media(record.get("images") or (), record.get("videos") or (), image_processor, video_processor, fixed)
        prefix_ids = prefix_ids + media_ids(media, fixed, tokenizer)
    fixed_tokens = len(prefix_ids) + len(schema_ids) + len(suffix_ids)
    token_count = fixed_tokens + len(state_ids)
    dropped = 0
    if token_count > max_length:
        if not truncate_state or fixed_tokens > max_length:
            raise RecordTooLong(
                token_count=token_count, fixed_tokens=fixed_tokens, state_tokens=len(state_ids), limit=max_length
            )
        dropped = token_count - max_length
        state_ids = state_ids[: max_length - fixed_tokens]

    offset = len(prefix_ids) + len(state_ids)
    questions = tuple(
        EncodedQuestion(
            question_id=question_id,
            question_type=question_type,
            question_span=(question_span[0] + offset, question_span[1] + offset),
            option_spans=tuple((start + offset, end + offset) for start, end in option_spans),
            option_ids=tuple(option_ids),
        )
        for question_id, question_type, question_span, option_spans, option_ids in spans
    )
    return EncodedRecord(
        input_ids=(*prefix_ids, *state_ids, *schema_ids, *suffix_ids),
        questions=questions,
        prefix_tokens=len(prefix_ids),
        state_tokens=len(state_ids),
        schema_tokens=len(schema_ids),
        suffix_tokens=len(suffix_ids),
        state_tokens_dropped=dropped,
        media=media,
    )


def marked_text(tokenizer: Tokenizer, record: EncodedRecord) -> str:
    """The rendered record with every question span marked `⟦Q id:...⟧`, option span `⟦O id:...⟧`, each
    image's pads as one mark `⟦IMAGE i: t x h x w = n tokens⟧` and each video frame pair's as `⟦VIDEO i.k: ...⟧`
    (what `clef-flash render` shows)."""
    ids = record.input_ids
    marks: dict[int, list[str]] = {}
    skipped: set[int] = set()
    if record.media is not None:
        media = record.media
        pads = [position for position, token in enumerate(ids) if token in media.pad_ids]
        runs = [[pads[0]]] if pads else []
        for position in pads[1:]:
            if position == runs[-1][-1] + 1:
                runs[-1].append(position)
            else:
                runs.append([position])
        names = [f"IMAGE {number}" for number in range(1, media.image_count + 1)]
        names += [f"VIDEO {number}.{pair}" for number, times in enumerate(media.times, 1) for pair in range(1, len(times) + 1)]
        for name, run, (t, h, w) in zip(names, runs, media.position_grids):
            marks.setdefault(run[0], []).append(f"⟦{name}: {t}x{h // media.merge}x{w // media.merge} = {len(run)} tokens⟧")
            marks.setdefault(run[-1] + 1, [])
        skipped = set(pads)
    for question in record.questions:
        start, end = question.question_span
        marks.setdefault(start, []).append(f"⟦Q {question.question_id}:")
        marks.setdefault(end, []).insert(0, "⟧")
        for option_id, (start, end) in zip(question.option_ids, question.option_spans):
            marks.setdefault(start, []).append(f"⟦O {option_id}:")
            marks.setdefault(end, []).insert(0, "⟧")
    pieces, cursor = [], 0
    for position in sorted(marks):
        pieces.append(tokenizer.decode([token for at, token in enumerate(ids[cursor:position], cursor) if at not in skipped]))
        pieces.append("".join(marks[position]))
        cursor = position
    pieces.append(tokenizer.decode(ids[cursor:]))
    return "".join(pieces)


def _media(
    images: Any,
    videos: Any,
    image_config: ImageProcessorConfig | None,
    video_config: VideoProcessorConfig | None,
    fixed: Mapping[str, tuple[int, ...]],
) -> RecordMedia:
    if images and image_config is None:
        raise media_unsupported("images", "this model source has no image processor (preprocessor_config.json): it answers text only")
    if videos and video_config is None:
        raise media_unsupported("videos", "this model source has no video processor (video_preprocessor_config.json): it answers no videos")
    pixels, grids, times = [], [], []
    for index, image in enumerate(images):
        with _located("images", index):
            image_pixels, grid = preprocess_image(image.image, image_config)
        pixels.append(image_pixels)
        grids.append(grid)
    for index, video in enumerate(videos):
        with _located("videos", index):
            processed = preprocess_video(video, video_config)
        pixels.append(processed.pixel_values)
        grids.append(processed.grid)
        times.append(processed.times)
    digest = hashlib.sha256("".join(image.digest for image in images).encode())
    if videos:
        digest.update(("videos:" + "".join(video.digest for video in videos)).encode())
    merge = (video_config.frames if videos else image_config).merge_size
    return RecordMedia(
        np.concatenate(pixels),
        tuple(grids),
        fixed[IMAGE_PLACEHOLDER][1],
        merge,
        digest.hexdigest(),
        video_pad_id=fixed[VIDEO_PLACEHOLDER][1],
        times=tuple(times),
    )


@contextmanager
def _located(field: str, index: int) -> Iterator[None]:
    """A media problem found while preprocessing, as the 422 item of `["body", field, index]`."""
    try:
        yield
    except MediaProblem as problem:
        raise RequestInvalid([{"type": problem.kind, "loc": ["body", field, index], "msg": str(problem)}]) from None


def media_item_ids(media: RecordMedia, fixed: Mapping[str, tuple[int, ...]], tokenizer: Tokenizer) -> list[tuple[int, ...]]:
    """Each image's tokens (start, pads: one per merged patch, end), then each video's (start; for each frame pair its
    time, start, pads, end; end)."""
    start, image_pad, end = fixed[IMAGE_PLACEHOLDER]
    items: list[tuple[int, ...]] = []
    for t, h, w in media.grids[: media.image_count]:
        items.append((start, *[image_pad] * (t * h * w // media.merge**2), end))
    video_pad = fixed[VIDEO_PLACEHOLDER][1]
    for (t, h, w), times in zip(media.grids[media.image_count :], media.times):
        ids = [start]
        for seconds in times:
            ids += [*_frame_pair_label_ids(tokenizer, frame_pair_label(seconds)), start, *[video_pad] * (h * w // media.merge**2), end]
        items.append((*ids, end))
    return items


def media_ids(media: RecordMedia, fixed: Mapping[str, tuple[int, ...]], tokenizer: Tokenizer) -> tuple[int, ...]:
    """The tokens of a record's images and videos (`media_item_ids`), then "\n"."""
    return (*(token for item in media_item_ids(media, fixed, tokenizer) for token in item), *fixed[MEDIA_END])


def media_spans(tokenizer: Tokenizer, record: EncodedRecord) -> list[tuple[int, int]]:
    """[start, end) of each image's, then each video's tokens in the record's input_ids."""
    if record.media is None:
        return []
    fixed = _fixed_pieces(tokenizer)
    spans, start = [], len(fixed[PREFIX])
    for item in media_item_ids(record.media, fixed, tokenizer):
        spans.append((start, start + len(item)))
        start += len(item)
    return spans
