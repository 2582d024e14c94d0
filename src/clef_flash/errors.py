"""The exception tree. Every error a user can cause says what is wrong and where.

    ClefError
    ├── RequestInvalid          a request that breaks the protocol (HTTP 422)
    │   └── RecordTooLong       a record over max_length tokens (HTTP 422)
    ├── ModelSourceError        a model source that cannot be found or opened
    ├── QuestionSetError        a saved question set that does not exist or cannot be read (HTTP 404)
    ├── CalibrationError        a calibration file that cannot be read, of an unknown format or version, or for another model
    ├── WeightsError            missing / unexpected / misshapen tensors in a release or bundle
    │   └── BundleError         a converted bundle that is incomplete, altered or of unknown format
    └── InferenceError          the model failed on a valid request (HTTP 5xx)
"""

from __future__ import annotations

from typing import Any


class ClefError(Exception):
    """Base class of every error clef-flash raises on purpose."""


class RequestInvalid(ClefError, ValueError):
    """A request that does not follow the System One protocol.

    ``errors`` holds FastAPI-style items: ``{"type", "loc", "msg", "input"?, "ctx"?}``, where
    ``loc`` starts with ``"body"`` (e.g. ``["body", "questions", "team", "criteria"]``), so a
    server can answer ``{"detail": errors}`` with status 422 unchanged.
    """

    def __init__(self, errors: list[dict[str, Any]]):
        self.errors = [dict(item) for item in errors]
        super().__init__(self._summary())

    def _summary(self) -> str:
        lines = [
            f"{'.'.join(str(part) for part in item['loc'])}: {item['msg']}" for item in self.errors[:5]
        ]
        more = len(self.errors) - 5
        if more > 0:
            lines.append(f"... and {more} more")
        count = len(self.errors)
        return f"invalid request ({count} error{'s' if count != 1 else ''}): " + "; ".join(lines)

    def detail(self) -> dict[str, Any]:
        """The 422 response body."""
        return {"detail": self.errors}


class RecordTooLong(RequestInvalid):
    """A rendered record longer than the token limit. Never truncated silently."""

    def __init__(self, *, token_count: int, fixed_tokens: int, state_tokens: int, limit: int):
        self.token_count = token_count
        self.fixed_tokens = fixed_tokens
        self.state_tokens = state_tokens
        self.limit = limit
        if fixed_tokens > limit:
            msg = (
                f"the record needs {token_count} tokens, over the limit of {limit}: the prompt and "
                f"schema alone take {fixed_tokens} tokens; ask fewer questions or shorter options"
            )
        else:
            msg = (
                f"the record needs {token_count} tokens, over the limit of {limit} "
                f"(state {state_tokens}, prompt and schema {fixed_tokens}); shorten the state by "
                f"{token_count - limit} tokens, or pass truncate_state=True (--truncate-state) to cut it explicitly"
            )
        super().__init__(
            [
                {
                    "type": "record_too_long",
                    "loc": ["body", "state"],
                    "msg": msg,
                    "ctx": {
                        "token_count": token_count,
                        "fixed_tokens": fixed_tokens,
                        "state_tokens": state_tokens,
                        "limit": limit,
                    },
                }
            ]
        )


class ModelSourceError(ClefError):
    """A model source (directory, bundle, hub repo id) that cannot be found or opened."""


class QuestionSetError(ClefError):
    """A saved question set (`clef-flash sets`) that does not exist, or whose file cannot be read."""


class CalibrationError(ClefError):
    """A calibration file (`eval labelled --fit-calibration`) that is missing, malformed, of a format version we do
    not read, or fitted on another model."""


class WeightsError(ClefError):
    """Tensors of a release or bundle that do not match what the model needs."""


class BundleError(WeightsError):
    """A converted bundle that is incomplete, altered, or of a format version we do not read."""


class InferenceError(ClefError):
    """The model failed while answering a valid request."""


def media_unsupported(field: str, message: str) -> RequestInvalid:
    """A request with `field` ("images" or "videos") for a model source that cannot read them (a 422 at
    `["body", field]`, type `{field}_unsupported`)."""
    return RequestInvalid([{"type": f"{field}_unsupported", "loc": ["body", field], "msg": message}])


def no_vision_tower(has_images: bool) -> RequestInvalid:
    """A record with images (else videos) for a model source without a vision tower."""
    field = "images" if has_images else "videos"
    return media_unsupported(field, "this model source has no vision tower (model.visual.*): it answers text only")


def adapter_not_loaded(name: str, loaded: list[str]) -> RequestInvalid:
    """A request naming an adapter (clef-flash's own `adapter` field) that this model did not load."""
    served = ", ".join(map(repr, loaded)) if loaded else "none"
    return RequestInvalid(
        [
            {
                "type": "adapter_not_loaded",
                "loc": ["body", "adapter"],
                "msg": f"adapter {name!r} is not loaded here; loaded: {served} (leave 'adapter' out for the default model)",
                "input": name,
                "ctx": {"loaded": loaded},
            }
        ]
    )
